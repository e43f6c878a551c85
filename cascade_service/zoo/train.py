"""Training and measurement for the offline zoo: the large model learns the corpus, drafters learn it.

The large model is trained as a plain next-token LM. The drafters are distilled from it (Hinton et al.
2015, at temperature 1): speculative decoding rewards a drafter for agreeing with the target, not for
modelling the text, so their only loss is KL(large || drafter) on corpus windows. They train alongside
the large model (its logits come free with its own training step) and then against the finished large
model for a short phase that costs a teacher forward only.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import greedy_tokens

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


@dataclass
class TrainLog:
    """What the report says about one model's training."""

    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        tail = self.losses[-_LOSS_WINDOW:]
        final = statistics.fmean(tail) if tail else math.nan
        return {"steps": self.steps, "tokens": self.tokens, "final_loss": round(final, 4)}


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads: timings and float results depend on the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cosine_lr(step: int, total: int, peak: float) -> float:
    warmup = max(1, round(total * _WARMUP))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (_FLOOR + (1 - _FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


class _Trainee:
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

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=inputs, use_cache=False).logits  # [B, S, V]

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


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` consecutive tokens: [batch, length]."""
    starts = torch.randint(0, stream.numel() - length + 1, (batch,), generator=gen).tolist()
    return torch.stack([stream[s : s + length] for s in starts])


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    # KL(teacher || student) per position, averaged: [B, S, V] -> scalar.
    vocab = student_logits.shape[-1]
    student = F.log_softmax(student_logits.reshape(-1, vocab), dim=-1)
    teacher = F.log_softmax(teacher_logits.reshape(-1, vocab), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def train_family(
    large: PreTrainedModel,
    drafters: dict[str, PreTrainedModel],
    stream: torch.Tensor,
    schedule: Schedule,
    seed: int,
    progress: bool = True,
) -> dict[str, TrainLog]:
    """Train `large` on `stream` (1-D token ids) and distill each drafter from it, in place."""
    gen = torch.Generator().manual_seed(seed)
    teacher = _Trainee(large, schedule.lm_lr, schedule, schedule.lm_steps)
    total = schedule.lm_steps + schedule.distill_steps
    students = {name: _Trainee(m, schedule.drafter_lr, schedule, total) for name, m in drafters.items()}
    tokens = schedule.batch * schedule.seq_len
    bar = tqdm(total=total, desc="train large + drafters", unit="step", disable=not progress)
    for step in range(total):
        window = sample_windows(stream, schedule.batch, schedule.seq_len + 1, gen)  # [B, S+1]
        inputs, targets = window[:, :-1], window[:, 1:]  # [B, S] each
        if step < schedule.lm_steps:
            logits = teacher.logits(inputs)  # [B, S, V]
            lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            teacher.step(lm_loss, tokens)
            target_logits = logits.detach()
        else:
            if step == schedule.lm_steps:
                bar.set_description("distill drafters")
                large.eval()
            with torch.no_grad():
                target_logits = teacher.logits(inputs)
        for student in students.values():
            student.step(_kl(student.logits(inputs), target_logits), tokens)
        shown = {"large": teacher.log.losses[-1]} | {n: s.log.losses[-1] for n, s in students.items()}
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


def greedy_agreement(
    target: HFModel, drafters: dict[str, HFModel], prompts_ids: Sequence[Sequence[int]], steps: int
) -> dict[str, float]:
    """Per drafter: how often its argmax equals the target's along the target's greedy trajectories."""
    trajectories = [greedy_tokens(target, prompt, steps) for prompt in prompts_ids]
    result = {}
    for name, drafter in drafters.items():
        matched = total = 0
        for prompt, chosen in zip(prompts_ids, trajectories):
            rows = drafter.full_logits(list(prompt) + chosen)[len(prompt) - 1 : -1]  # [steps, V]
            matched += sum(int(a == b) for a, b in zip(chosen, rows.argmax(-1).tolist()))
            total += len(chosen)
        result[name] = round(matched / max(1, total), 4)
    return result


def teacher_forced(target: HFModel, models: dict[str, HFModel], windows: Sequence[Sequence[int]]) -> dict:
    """On held-out windows: each model's next-token loss, and its top-1 agreement with the target."""
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
        report[name] = {
            "heldout_loss": round(sum(losses) / max(1, total), 4),
            "teacher_forced_agreement": round(agree / max(1, total), 4),
        }
    return report
