"""Training and measurement for the offline zoo: the large model learns the corpus, drafters learn it.

The large model is trained as a plain next-token LM on the pre-tokenized corpus, packed into windows
that each epoch visits once in a fresh order; the head and its loss run fused (`fused.head_loss`).
The drafters are distilled from it (Hinton et al. 2015, at temperature 1): speculative decoding rewards
a drafter for agreeing with the target, not for modelling the text, so their only loss is
KL(large || drafter) on corpus windows. They train alongside the large model (its last hidden states
come free with its own training step) and then against the finished large model for a short phase
that costs a teacher forward only.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from cascade_service.models.hf import HFModel, pass_time_s
from cascade_service.zoo.fused import head_loss, teacher_distribution

_WARMUP = 0.1  # fraction of steps with a linear learning-rate ramp
_FLOOR = 0.1  # the cosine decays to this fraction of the peak
_LOSS_WINDOW = 10  # "final loss" is the mean over the last steps: one batch is noisy


@dataclass(frozen=True)
class Schedule:
    """How one training run draws batches and steps."""

    batch: int  # windows per step
    seq_len: int  # tokens per window (inputs; one more is read for the last target)
    lm_steps: int  # large-model steps; the drafters follow it along
    distill_steps: int  # drafter-only steps against the finished large model
    lm_lr: float  # peak learning rate of the large model's blocks
    drafter_lr: float  # peak learning rate of the drafters' blocks
    # Measured on this corpus: token embeddings learn far faster with a much larger step, the output
    # head with a somewhat larger one (as in modded-nanogpt); blocks of wider models want smaller ones.
    embed_lr: float = 0.1  # peak learning rate of every model's token embeddings
    head_lr_mult: float = 3.0  # output head's peak learning rate, relative to the blocks'
    threads: int = 2  # torch threads while training: results depend on it, so it is part of the spec
    # Fraction of lm_steps before the drafters join: distilling a teacher that still knows little is
    # mostly wasted, and a drafter step costs about half of the large model's on a CPU.
    drafters_from: float = 0.0

    @property
    def drafters_start(self) -> int:
        return round(self.lm_steps * self.drafters_from)


@dataclass
class TrainLog:
    """What the report says about one model's training."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of the steps this model took part in
    losses: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        tail = self.losses[-_LOSS_WINDOW:]
        final = statistics.fmean(tail) if tail else math.nan
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 1),
            "final_loss": round(final, 4),
        }


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads: timings and float results depend on the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Laps:
    """A build's seconds per phase: `laps("train")` ends the phase running since the last call."""

    def __init__(self) -> None:
        self.began = self.clock = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self.clock, 2)
        self.clock = now

    def total(self) -> dict[str, float]:
        """Every phase's seconds, and the whole build's as "total"."""
        return self.seconds | {"total": round(time.perf_counter() - self.began, 2)}


def cosine_lr(step: int, total: int, peak: float) -> float:
    warmup = max(1, round(total * _WARMUP))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (_FLOOR + (1 - _FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainee:
    """One model with its optimizer, schedule and log."""

    def __init__(self, module: PreTrainedModel, block_lr: float, schedule: Schedule, total_steps: int):
        self.module = module.train()
        self.total_steps = total_steps
        embed = module.get_input_embeddings().weight
        head = module.get_output_embeddings().weight
        blocks = [p for p in module.parameters() if p is not embed and p is not head]
        groups = [
            {"params": [embed], "peak": schedule.embed_lr},
            {"params": [head], "peak": block_lr * schedule.head_lr_mult},
            {"params": blocks, "peak": block_lr},
        ]
        # No weight decay: runs are a few hundred steps, and decay at the embeddings' rate would
        # shrink them by half.
        self.opt = torch.optim.AdamW(groups, lr=block_lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.log = TrainLog()

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """Last hidden states, one row per position: [B * S, d]."""
        states = self.module.base_model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, S, d]
        return states.reshape(-1, states.shape[-1])

    @property
    def head(self) -> torch.Tensor:
        return self.module.get_output_embeddings().weight  # [V, d]

    def step(self, loss: torch.Tensor, tokens: int) -> None:
        for group in self.opt.param_groups:
            group["lr"] = cosine_lr(self.log.steps, self.total_steps, group["peak"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.log.steps += 1
        self.log.tokens += tokens
        self.log.losses.append(float(loss.detach()))


def packed_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Batches of `batch` windows of `length` tokens, [batch, length], forever: the stream cut into
    windows that overlap by one token (the last target of one is the first input of the next), every
    window once per epoch in a fresh order."""
    count = (stream.numel() - 1) // (length - 1)
    if count < batch:
        raise ValueError(f"a corpus of {stream.numel()} tokens holds fewer than {batch} windows of {length}")
    while True:
        starts = (torch.randperm(count, generator=gen) * (length - 1)).tolist()
        for first in range(0, count - batch + 1, batch):
            yield torch.stack([stream[s : s + length] for s in starts[first : first + batch]])


def train_family(
    large: PreTrainedModel,
    drafters: dict[str, PreTrainedModel],
    stream: torch.Tensor,
    schedule: Schedule,
    seed: int,
    progress: bool = True,
) -> dict[str, TrainLog]:
    """Train `large` on `stream` (1-D token ids) and distill each drafter from it, in place."""
    batches = packed_windows(stream, schedule.batch, schedule.seq_len + 1, torch.Generator().manual_seed(seed))
    teacher = Trainee(large, schedule.lm_lr, schedule, schedule.lm_steps)
    total = schedule.lm_steps + schedule.distill_steps
    joined = schedule.drafters_start
    students = {name: Trainee(m, schedule.drafter_lr, schedule, total - joined) for name, m in drafters.items()}
    tokens = schedule.batch * schedule.seq_len
    bar = tqdm(total=total, desc="train large + drafters", unit="step", disable=not progress)
    for step in range(total):
        began = time.perf_counter()
        window = next(batches)  # [B, S+1]
        inputs, targets = window[:, :-1], window[:, 1:].reshape(-1)  # [B, S], [B * S]
        if step < schedule.lm_steps:
            states = teacher.hidden(inputs)  # [B * S, d]
            if step >= joined and students:  # from the head as it was for this forward pass, not as the step leaves it
                reference = teacher_distribution(states, teacher.head)
            teacher.step(head_loss(states, teacher.head, targets=targets), tokens)
        else:
            if step == schedule.lm_steps:
                bar.set_description("distill drafters")
                large.eval()
            with torch.no_grad():
                reference = teacher_distribution(teacher.hidden(inputs), teacher.head)
        learning = list(students.values()) if step >= joined else []
        for student in learning:
            student.step(head_loss(student.hidden(inputs), student.head, teacher=reference), tokens)
        spent = time.perf_counter() - began
        for log in ([teacher.log] if step < schedule.lm_steps else []) + [s.log for s in learning]:
            log.seconds += spent
        logs = {"large": teacher.log} | {n: s.log for n, s in students.items()}
        shown = {n: log.losses[-1] for n, log in logs.items() if log.losses}
        bar.set_postfix({n: f"{v:.3f}" for n, v in shown.items()}, refresh=False)
        bar.update()
    bar.close()
    for m in (large, *drafters.values()):
        m.eval()
    return {"large": teacher.log} | {name: s.log for name, s in students.items()}


def step_times_ms(models: dict[str, HFModel], thread_count: int, rounds: int = 5) -> dict[str, float]:
    """Median single-token decode step (64-token cache) per model; rounds interleave the models so a
    burst of load from another process hits all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in models}
    with threads(thread_count):
        for _ in range(rounds):
            for name, model in models.items():
                fresh = HFModel(model.module, name)  # step_time_s caches per object
                samples[name].append(fresh.step_time_s(context_len=64, repeats=9) * 1e3)
    return {name: round(statistics.median(ms), 3) for name, ms in samples.items()}


def pass_times_ms(model: HFModel, thread_count: int, max_tokens: int = 9, repeats: int = 7) -> list[float]:
    """Median wall time of one pass over 1..max_tokens new tokens (a review of k drafts is k + 1) with
    a 64-token cache: what speculation pays the target per round, against one decode step."""
    with threads(thread_count):
        return [round(pass_time_s(model, 1, 64, repeats, tokens) * 1e3, 3) for tokens in range(1, max_tokens + 1)]


def greedy_agreement(
    drafters: dict[str, HFModel], prompts_ids: Sequence[Sequence[int]], trajectories: Sequence[Sequence[int]]
) -> dict[str, float]:
    """Per drafter: how often its argmax equals the target's along the target's greedy `trajectories`
    (one per prompt)."""
    result = {}
    for name, drafter in drafters.items():
        matched = total = 0
        for prompt, chosen in zip(prompts_ids, trajectories):
            rows = drafter.full_logits(list(prompt) + list(chosen))[len(prompt) - 1 : -1]  # [steps, V]
            matched += sum(int(a == b) for a, b in zip(chosen, rows.argmax(-1).tolist()))
            total += len(chosen)
        result[name] = round(matched / max(1, total), 4)
    return result


def teacher_forced(target: HFModel, models: dict[str, HFModel], windows: Sequence[Sequence[int]]) -> dict:
    """On `windows` of text: each model's next-token loss (nats/token), and its top-1 agreement with the
    target."""
    report: dict[str, dict[str, float]] = {}
    target_top = [target.full_logits(w)[:-1].argmax(-1) for w in windows]  # [len(w) - 1] each
    for name, model in models.items():
        losses, agree, total = [], 0, 0
        for window, top in zip(windows, target_top):
            logits = model.full_logits(window)[:-1]  # [len(w) - 1, V]
            labels = torch.tensor(window[1:])
            losses.append(float(F.cross_entropy(logits, labels, reduction="sum")))
            agree += int((logits.argmax(-1) == top).sum())
            total += len(window) - 1
        report[name] = {"loss": round(sum(losses) / max(1, total), 4), "agreement": round(agree / max(1, total), 4)}
    return report


CONTEXT_BUCKETS = (0, 256, 512, 1024, 2048)  # where a window's positions are counted (by_context)


def by_context(target: HFModel, models: dict[str, HFModel], windows: Sequence[Sequence[int]]) -> dict:
    """`teacher_forced`'s loss and agreement counted by the position in the window that predicts:
    0-256, 256-512, 512-1024, ... (a family trained on short windows shows it here, past them)."""
    target_top = [target.full_logits(w)[:-1].argmax(-1) for w in windows]
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name, model in models.items():
        sums: dict[str, list[float]] = {}
        for window, top in zip(windows, target_top):
            logits = model.full_logits(window)[:-1]  # [len(w) - 1, V]
            losses = F.cross_entropy(logits, torch.tensor(window[1:]), reduction="none")
            agree = logits.argmax(-1) == top
            for lo, hi in itertools.pairwise(CONTEXT_BUCKETS):
                if lo >= len(losses):
                    break
                tally = sums.setdefault(f"{lo}-{hi}", [0.0, 0.0, 0.0])
                tally[0] += float(losses[lo:hi].sum())
                tally[1] += float(agree[lo:hi].sum())
                tally[2] += len(losses[lo:hi])
        report[name] = {
            span: {"loss": round(loss / n, 4), "agreement": round(same / n, 4)}
            for span, (loss, same, n) in sums.items()
        }
    return report
