"""The output head and its loss in one pass, for training the zoo on a CPU.

With a vocabulary of a few thousand and models this small, the head is the biggest matrix product of a
step, and autograd's cross-entropy costs as much again in memory traffic: it materialises the logits,
their log-softmax, that log-softmax's gradient and a zero-filled buffer for it (measured: 1.35x more
tokens/s with this function on the demo's large model). Here each chunk of rows computes its logits,
its loss and its gradient at once; the backward pass only scales the stored gradients.

One loss per call: next-token cross-entropy against `targets`, or distillation, KL(teacher || student)
at temperature 1, against the teacher's distribution (`teacher_distribution`: computed once per batch
and shared by every student).
"""

from __future__ import annotations

import torch

CHUNK = 1024  # rows per chunk: a [CHUNK, vocab] float block stays cache-friendly


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher_log, teacher_probs, chunk):  # type: ignore[override]
        rows = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        total = hidden.new_zeros(())
        for start in range(0, rows, chunk):
            part = hidden[start : start + chunk]  # [c, d]
            log_probs = torch.log_softmax(part @ weight.T, dim=-1)  # [c, V]
            if teacher_log is None:
                picked = targets[start : start + chunk]  # [c]
                total -= log_probs.gather(1, picked[:, None]).sum()
                grad = log_probs.exp_()  # d(-log p_y)/d logits = softmax - onehot(y)
                grad[torch.arange(picked.numel(), device=grad.device), picked] -= 1
            else:
                t_log, t_probs = teacher_log[start : start + chunk], teacher_probs[start : start + chunk]
                total += (t_probs * (t_log - log_probs)).sum()
                grad = log_probs.exp_().sub_(t_probs)  # d KL / d logits = softmax - teacher
            grad.div_(rows)
            grad_hidden[start : start + chunk] = grad @ weight
            grad_weight.addmm_(grad.T, part)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total / rows

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out, grad_weight * grad_out, None, None, None, None


def teacher_distribution(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's (log-probabilities, probabilities), [N, V] each, from its last hidden states [N, d] and
    its head [V, d]; no gradient flows back into the teacher."""
    with torch.no_grad():
        log_probs = torch.log_softmax(hidden @ weight.T, dim=-1)
        return log_probs, log_probs.exp()


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Mean loss of the head `weight` [V, d] over `hidden` [N, d]: cross-entropy against `targets` [N],
    or KL(teacher || student) against `teacher`, the teacher's distribution (`teacher_distribution`)."""
    if (targets is None) == (teacher is None):
        raise ValueError("head_loss takes exactly one of targets and teacher")
    teacher_log, teacher_probs = teacher if teacher is not None else (None, None)
    return _HeadLoss.apply(hidden, weight, targets, teacher_log, teacher_probs, chunk)
