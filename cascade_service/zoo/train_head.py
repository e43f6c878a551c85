"""Train a SpecDec++ acceptance head offline (arXiv 2405.19715 Sec. 4.4, App. D.1).

Data (Sec. 4.4, dataset and token mixing): prompts are windows of training-split text; the target
samples a response X at temperature T (its sampling pass also yields target_probs(.|X_<i)); one
teacher-forced drafter pass gives draft_probs(.|X_<i), from which Y_i is drawn; the label is P_i =
min(1, target_probs(Y_i) / draft_probs(Y_i)), both at T over the full vocabulary (official code: T =
1, no top-k; T = 0 is the greedy limit, P_i = 1[argmax target = argmax draft]). Token mixing builds
Z with Z_i = X_i on a share r of positions (no label) and Z_i = Y_i elsewhere (labelled); the head
reads the drafter's final hidden state at Z_i's position of [prompt, Z]. After EOS: no labels.

Training (Sec. 4.4, the loss): weighted soft-label BCE, w_acc = 1, normalised as the official code
does; only the head trains. The drafter is frozen, so its hidden states are computed once and cached
(ours; the mixing mask is fixed per data set as in the code, so this changes nothing).
Deviations, for a data set ~1000x smaller than the paper's: each response gives `views` rows with
their own Y and mask, cheap since target sampling dominates the cost (demo zoo, small drafter,
1500 steps: held-out loss 0.735 with 1 view of 128 responses, 0.657 with 4); a fixed number of AdamW
steps on random minibatches of labelled tokens at lr 1e-3 (paper: 3 epochs, 32 sequences a batch,
lr 5e-5).
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cascade_service.core.sampling import sharpen
from cascade_service.models.acceptance_head import AcceptanceHead
from cascade_service.models.cachearg import cache_kwargs, returned_cache

_WARMUP = 0.03  # fraction of steps with a linear ramp (official code: warmup_ratio 0.03, then cosine)
_LOSS_WINDOW = 20  # the reported final loss averages the last steps: one minibatch is noisy
_SEQ_CHUNK = 16  # sequences per forward pass while building data (bounds [b, S, V] logits memory)

# `cascade-service train-head` defaults per zoo: demo takes a few minutes on 2 CPU cores, test seconds.
_FULL = dict(sequences=128, views=4, prompt_len=64, response_len=128, steps=800, batch=1024)
_TEST = dict(sequences=24, views=2, prompt_len=24, response_len=32, steps=200, batch=256)
RUN_PRESETS = dict.fromkeys(("demo", "quality", "grown"), _FULL) | {"test": _TEST}


@dataclass
class HeadData:
    """The offline data set: R rows, each a P-token prompt and N response positions.

    Row r is view `r % views` of generated response `r // views`: the views share X and draw their
    own Y and mixing mask (a cheap multiplier of labelled examples; the paper has one view).
    """

    views: int
    prompts: torch.Tensor  # [R, P] int64
    target_tokens: torch.Tensor  # [R, N] X, sampled from the target
    draft_tokens: torch.Tensor  # [R, N] Y_i ~ draft_probs(.|prompt, X_<i)
    mixed: torch.Tensor  # [R, N] Z: X_i where taken from the target, else Y_i
    labelled: torch.Tensor  # [R, N] bool: Z_i = Y_i and i is not after the response's first EOS
    labels: torch.Tensor  # [R, N] float32 min(1, p/q) of Y_i (defined everywhere, used where labelled)
    draft_prob: torch.Tensor  # [R, N] draft probability of Y_i (at T = 1 when greedy): confidence baselines
    draft_max: torch.Tensor  # [R, N] max_v of the same distribution
    features: torch.Tensor  # [R, N, H] drafter's final hidden state at Z_i's position

    def rows(self, responses: slice) -> tuple[torch.Tensor, ...]:
        """Labelled examples of the rows of `responses`: features [M, H], labels, draft_prob, draft_max [M]."""
        seqs = slice(responses.start * self.views, responses.stop * self.views)
        keep = self.labelled[seqs]
        return tuple(t[seqs][keep] for t in (self.features, self.labels, self.draft_prob, self.draft_max))


def prompt_windows(tokenizer, texts: Sequence[str], count: int, length: int, seed: int) -> torch.Tensor:
    """`count` prompts of `length` tokens, each from a different random text at a random line: [count, length]."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    windows = []
    for i in order:
        starts = [0] + [j + 1 for j, c in enumerate(texts[i]) if c == "\n"]
        start = rng.choice(starts[: max(1, len(starts) * 3 // 4)])  # leave text after the window
        ids = tokenizer(texts[i][start : start + 16 * length], add_special_tokens=False).input_ids
        if len(ids) >= length:
            windows.append(ids[:length])
        if len(windows) == count:
            return torch.tensor(windows, dtype=torch.long)
    raise ValueError(f"only {len(windows)} of {len(texts)} texts give a {length}-token prompt, need {count}")


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T); T = 0 is its limit, greedy: 0 at the argmax, -inf elsewhere."""
    logits = logits.float()
    if temperature == 0.0:
        top = logits.max(dim=-1, keepdim=True).values
        return torch.where(logits == top, 0.0, -math.inf)
    return torch.log_softmax(sharpen(logits, temperature), dim=-1)


def _draw(logp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # [..., V] -> [...]; works for the greedy limit too (all mass on the argmax)
    return torch.multinomial(logp.exp().reshape(-1, logp.shape[-1]), 1, generator=gen).reshape(logp.shape[:-1])


@torch.inference_mode()
def respond(
    target, prompts: torch.Tensor, new_tokens: int, temperature: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses, KV-cached, full vocabulary: [B, P] -> X [B, N] and target log-probs [B, N, V]
    (row i: log target_probs(.|prompt, X_<i) at `temperature`, the distribution X_i was drawn from)."""
    out = target(input_ids=prompts, use_cache=True, logits_to_keep=1)
    tokens, rows = [], []
    for step in range(new_tokens):
        rows.append(log_probs(out.logits[:, -1], temperature))  # [B, V]
        tokens.append(_draw(rows[-1], gen))  # [B]
        if step + 1 < new_tokens:
            out = target(input_ids=tokens[-1][:, None], use_cache=True, **cache_kwargs(target, returned_cache(out)))
    return torch.stack(tokens, dim=1), torch.stack(rows, dim=1)


@torch.inference_mode()
def _views(drafter, prompts, target_tokens, target_logp, views, mix, temperature, eos_ids, gen) -> dict:
    prompt_len = prompts.shape[1]
    # Row P-1+i of a teacher-forced pass is the distribution of response position i given X_<i.
    logits = drafter(input_ids=torch.cat([prompts, target_tokens], dim=1)).logits[:, prompt_len - 1 : -1]
    draft_logp = log_probs(logits, temperature)  # [b, N, V]
    confidence = torch.softmax(logits.float(), -1) if temperature == 0.0 else draft_logp.exp()
    is_eos = torch.isin(target_tokens, torch.tensor(sorted(eos_ids), dtype=torch.long))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
    parts = []
    for _ in range(views):
        draft_tokens = _draw(draft_logp, gen)  # [b, N]
        lq = draft_logp.gather(-1, draft_tokens[..., None]).squeeze(-1)  # log draft_probs(Y_i)
        lp = target_logp.gather(-1, draft_tokens[..., None]).squeeze(-1)  # log target_probs(Y_i)
        from_target = torch.rand(draft_tokens.shape, generator=gen) < mix  # r = share of X (Sec. 7.2)
        mixed = torch.where(from_target, target_tokens, draft_tokens)
        out = drafter(input_ids=torch.cat([prompts, mixed], dim=1), output_hidden_states=True)
        parts.append(
            {
                "prompts": prompts,
                "target_tokens": target_tokens,
                "draft_tokens": draft_tokens,
                "mixed": mixed,
                "labelled": ~from_target & ~after_eos,
                "labels": (lp - lq).clamp(max=0.0).exp().nan_to_num(0.0),  # greedy: -inf - 0 -> 0
                "draft_prob": confidence.gather(-1, draft_tokens[..., None]).squeeze(-1),
                "draft_max": confidence.max(-1).values,
                # hidden_states[-1] is the final-norm output the LM head reads; position P+i holds Z_i.
                "features": out.hidden_states[-1][:, prompt_len:].float(),
            }
        )
    # Interleave so that row r is view r % views of response r // views.
    return {k: torch.stack([p[k] for p in parts], dim=1).flatten(0, 1) for k in parts[0]}


def build_data(
    target,
    drafter,
    prompts: torch.Tensor,
    response_len: int,
    *,
    views: int = 1,
    mix: float = 0.15,
    temperature: float = 1.0,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
) -> HeadData:
    """The offline data set for HF causal LMs `target` and `drafter` (frozen, eval mode); T = 0 is greedy."""
    if not 0.0 <= mix < 1.0 or not temperature >= 0.0 or response_len < 1 or views < 1:
        raise ValueError(
            f"need 0 <= mix < 1, temperature >= 0, response_len >= 1, views >= 1; "
            f"got {mix}, {temperature}, {response_len}, {views}"
        )
    gen = torch.Generator().manual_seed(seed)
    parts: list[dict] = []
    for start in range(0, len(prompts), _SEQ_CHUNK):
        chunk = prompts[start : start + _SEQ_CHUNK]
        target_tokens, target_logp = respond(target, chunk, response_len, temperature, gen)
        parts.append(_views(drafter, chunk, target_tokens, target_logp, views, mix, temperature, set(eos_ids), gen))
    return HeadData(views=views, **{k: torch.cat([p[k] for p in parts]) for k in parts[0]})


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w_rej: float) -> torch.Tensor:
    """Sec. 7.3: sum(-P log p_hat - w_rej (1-P) log(1-p_hat)) / sum(P + w_rej (1-P)) (official normalisation)."""
    accept, reject = labels, w_rej * (1.0 - labels)
    total = -(accept * F.logsigmoid(logits) + reject * F.logsigmoid(-logits)).sum()
    return total / (accept + reject).sum().clamp_min(1e-12)


def _lr(step: int, total: int, peak: float) -> float:
    warmup = max(1, round(total * _WARMUP))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def fit(
    head: AcceptanceHead,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    w_rej: float,
    seed: int,
    weight_decay: float = 0.0,
) -> list[float]:
    """Train `head` in place on cached features [M, H] and labels [M]; returns the per-step losses."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    head.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        idx = torch.randint(0, len(labels), (min(batch, len(labels)),), generator=gen)
        loss = weighted_bce(head(features[idx]), labels[idx], w_rej)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head.eval()
    return losses


def soft_auc(score: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a rejection > score of an acceptance), each example a rejection with weight 1 - P
    and an acceptance with weight P (ties count half)."""
    order = score.argsort()
    groups, inverse = torch.unique_consecutive(score[order], return_inverse=True)
    accept = torch.zeros(len(groups), dtype=torch.float64).index_add(0, inverse, labels[order].double())
    reject = torch.zeros(len(groups), dtype=torch.float64).index_add(0, inverse, 1.0 - labels[order].double())
    below = accept.cumsum(0) - accept
    denom = float(accept.sum() * reject.sum())
    return float((reject * (below + 0.5 * accept)).sum()) / denom if denom > 0 else math.nan


def _binary_kl(labels: torch.Tensor, pred: torch.Tensor) -> float:
    # The paper's eval metric (App. D.3): KL(P || p_hat) of Bernoullis, = BCE - H(P).
    pred = pred.double().clamp(1e-7, 1 - 1e-7)
    p = labels.double()
    kl = torch.xlogy(p, p) - p * pred.log() + torch.xlogy(1 - p, 1 - p) - (1 - p) * (1 - pred).log()
    return float(kl.mean())


@torch.no_grad()
def evaluate(head: AcceptanceHead, features: torch.Tensor, labels: torch.Tensor, w_rej: float) -> dict:
    """Objective, the paper's KL, and calibration: raw predictions under-predict acceptance by odds
    factor w_rej (ours: the optimum of the weighted BCE), so they are also reported corrected,
    w p / (1 - p + w p)."""
    logits = head(features)
    pred = torch.sigmoid(logits)
    corrected = w_rej * pred / (1 - pred + w_rej * pred)
    return {
        "weighted_bce": round(float(weighted_bce(logits, labels, w_rej)), 4),
        "kl": round(_binary_kl(labels, pred), 4),
        "kl_corrected": round(_binary_kl(labels, corrected), 4),
        "mean_label": round(float(labels.mean()), 4),
        "mean_pred": round(float(pred.mean()), 4),
        "mean_pred_corrected": round(float(corrected.mean()), 4),
        "brier_corrected": round(float(((corrected - labels) ** 2).mean()), 4),
        "auc_reject": round(soft_auc(-logits, labels), 4),
    }


def train_head(
    target_dir: str | Path,
    drafter_dir: str | Path,
    out_dir: str | Path,
    *,
    texts: Sequence[str],
    steps: int = 800,
    depth: int = 3,
    w_rej: float = 6.0,
    seed: int = 0,
    sequences: int = 128,
    views: int = 4,
    prompt_len: int = 64,
    response_len: int = 128,
    mix: float = 0.15,
    temperature: float = 1.0,
    lr: float = 1e-3,
    batch: int = 1024,
    eval_fraction: float = 0.2,
    tie_blocks: bool = False,
    progress: bool = False,
) -> dict:
    """Build data from training-split `texts`, train a head for the drafter, save it to `out_dir`.

    Defaults: the paper's recommended depth 3 and w_rej 6, r = 0.15, T = 1 (use the serving
    temperature; 0 = greedy). Returns the summary also stored in head.json: example counts, the
    training loss, held-out metrics before and after training, and the confidence baselines.
    """
    from cascade_service.models.hf import (  # transformers only when training
        HFModel,
        load_tokenizer,
    )

    if steps < 1 or batch < 1 or not 0.0 < eval_fraction < 1.0 or not w_rej > 0.0 or not lr > 0.0:
        raise ValueError(
            f"need steps, batch >= 1, 0 < eval_fraction < 1, w_rej, lr > 0; "
            f"got {steps}, {batch}, {eval_fraction}, {w_rej}, {lr}"
        )
    began = time.perf_counter()
    target = HFModel.load(target_dir, name=Path(target_dir).name)
    drafter = HFModel.load(drafter_dir, name=Path(drafter_dir).name)
    if target.vocab_size != drafter.vocab_size:
        raise ValueError(f"target and drafter vocabularies differ: {target.vocab_size} vs {drafter.vocab_size}")
    prompts = prompt_windows(load_tokenizer(drafter_dir), texts, sequences, prompt_len, seed)
    _say(
        progress,
        f"data: {sequences} responses x {response_len} tokens x {views} views, "
        f"target {target.name}, drafter {drafter.name}",
    )
    data = build_data(
        target.module,
        drafter.module,
        prompts,
        response_len,
        views=views,
        mix=mix,
        temperature=temperature,
        seed=seed,
        eos_ids=sorted(drafter.eos_token_ids | target.eos_token_ids),
    )
    data_s = time.perf_counter() - began
    held = max(1, round(sequences * eval_fraction))  # split by response: held-out tokens share no context
    train_x, train_y, _, _ = data.rows(slice(0, sequences - held))
    eval_set = data.rows(slice(sequences - held, sequences))
    torch.manual_seed(seed)
    head = AcceptanceHead(drafter.config.hidden_size, depth, tie_blocks)
    before = (evaluate(head, train_x, train_y, w_rej)["weighted_bce"], evaluate(head, eval_set[0], eval_set[1], w_rej))
    _say(progress, f"training: {len(train_y)} examples, {steps} steps (data took {data_s:.0f} s)")
    losses = fit(head, train_x, train_y, steps=steps, batch=batch, lr=lr, w_rej=w_rej, seed=seed)
    summary = {
        "target": target.name,
        "drafter": drafter.name,
        "examples": {
            "train": len(train_y),
            "eval": len(eval_set[1]),
            "responses": sequences,
            "eval_responses": held,
            "views": views,
        },
        "recipe": {
            "prompt_len": prompt_len,
            "response_len": response_len,
            "mix": mix,
            "temperature": temperature,
            "w_rej": w_rej,
            "depth": depth,
            "tie_blocks": tie_blocks,
            "steps": steps,
            "batch": batch,
            "lr": lr,
            "seed": seed,
        },
        "train_loss": {
            "before": before[0],
            "last_steps": round(statistics.fmean(losses[-_LOSS_WINDOW:]), 4),
            "after": evaluate(head, train_x, train_y, w_rej)["weighted_bce"],
        },
        "eval_before": before[1],
        "eval": evaluate(head, eval_set[0], eval_set[1], w_rej),
        "eval_baselines": _baselines(float(train_y.mean()), *eval_set[1:]),
        "time_s": {"data": round(data_s, 1), "total": round(time.perf_counter() - began, 1)},
    }
    head.meta = {"drafter": _describe(drafter, drafter_dir), "training": summary}
    head.save(out_dir)
    return summary


def _baselines(train_mean: float, labels: torch.Tensor, draft_prob: torch.Tensor, draft_max: torch.Tensor) -> dict:
    # What the head must beat: the confidence heuristics' ranking, a constant's KL.
    return {
        "auc_reject_draft_prob": round(soft_auc(-draft_prob, labels), 4),
        "auc_reject_draft_max": round(soft_auc(-draft_max, labels), 4),
        "kl_constant": round(_binary_kl(labels, torch.full_like(labels, train_mean)), 4),
    }


def _describe(model, path: str | Path) -> dict:
    digest = hashlib.sha256()
    for weights in sorted(Path(path).glob("*.safetensors")):
        digest.update(weights.read_bytes())
    return {
        "name": model.name,
        "path": str(Path(path).resolve()),
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.vocab_size,
        "weights_sha256": digest.hexdigest(),
    }


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
