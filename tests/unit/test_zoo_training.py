"""The zoo's training pieces against independent references: the fused head loss against autograd's
cross-entropy and KL, the packed windows against the stream they cut, the loop test on made-up runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cascade_service.zoo.evaluate import ends_in_loop
from cascade_service.zoo.fused import head_loss, teacher_distribution
from cascade_service.zoo.train import packed_windows


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("chunk", [7, 64, 1000])  # chunks that split rows unevenly, and one chunk for all
def test_fused_cross_entropy_matches_autograd_loss_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(90, 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(33, 12, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 33, (90,), generator=gen)
    h1, w1 = _leaves(hidden, weight)
    h2, w2 = _leaves(hidden, weight)
    fused = head_loss(h1, w1, targets=targets, chunk=chunk)
    (2.5 * fused).backward()  # a scale on the way back must reach both gradients
    reference = F.cross_entropy(h2 @ w2.T, targets)
    (2.5 * reference).backward()
    torch.testing.assert_close(fused, reference)
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_fused_distillation_is_kl_teacher_to_student_with_no_gradient_into_the_teacher():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(21, 8, generator=gen, dtype=torch.float64)
    t_hidden, t_weight = _leaves(
        torch.randn(50, 16, generator=gen, dtype=torch.float64), torch.randn(21, 16, dtype=torch.float64)
    )
    h1, w1 = _leaves(hidden, weight)
    h2, w2 = _leaves(hidden, weight)
    fused = head_loss(h1, w1, teacher=teacher_distribution(t_hidden, t_weight), chunk=16)
    fused.backward()
    teacher_log = F.log_softmax(t_hidden.detach() @ t_weight.detach().T, dim=-1)
    reference = F.kl_div(F.log_softmax(h2 @ w2.T, dim=-1), teacher_log, log_target=True, reduction="batchmean")
    reference.backward()
    torch.testing.assert_close(fused, reference)
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
    assert t_hidden.grad is None and t_weight.grad is None
    same = head_loss(h1, w1, teacher=teacher_distribution(h1, w1)).detach()
    assert float(same) == pytest.approx(0.0, abs=1e-12)  # KL(p || p) = 0


def test_head_loss_takes_exactly_one_of_targets_and_teacher():
    hidden, weight = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="exactly one"):
        head_loss(hidden, weight)
    with pytest.raises(ValueError, match="exactly one"):
        head_loss(
            hidden, weight, targets=torch.zeros(4, dtype=torch.long), teacher=teacher_distribution(hidden, weight)
        )


def test_packed_windows_cover_the_stream_once_per_epoch_overlapping_by_one_token():
    stream = torch.arange(1, 102)  # 101 tokens -> 100 (input, target) pairs = 10 windows of 11
    batches = packed_windows(stream, batch=2, length=11, gen=torch.Generator().manual_seed(0))
    epoch = torch.cat([next(batches) for _ in range(5)])  # [10, 11]
    assert sorted(int(w[0]) for w in epoch) == list(range(1, 101, 10))
    for window in epoch:  # consecutive tokens of the stream
        assert window.tolist() == list(range(int(window[0]), int(window[0]) + 11))
    pairs = {(int(w[i]), int(w[i + 1])) for w in epoch for i in range(10)}
    assert pairs == {(t, t + 1) for t in range(1, 101)}  # every next-token pair, once
    second = torch.cat([next(batches) for _ in range(5)])
    assert sorted(second[:, 0].tolist()) == sorted(epoch[:, 0].tolist())
    assert second[:, 0].tolist() != epoch[:, 0].tolist()  # a fresh order


def test_packed_windows_refuse_a_stream_too_short_for_one_batch():
    with pytest.raises(ValueError, match="fewer than 4 windows"):
        next(packed_windows(torch.arange(20), batch=4, length=11, gen=torch.Generator()))


def test_a_loop_is_a_four_gram_four_times_in_the_last_32_tokens():
    code = list(range(64))  # nothing repeats
    assert not ends_in_loop(code)
    assert ends_in_loop(code[:40] + [7, 8, 9, 10] * 6)  # a 4-token cycle
    assert ends_in_loop(code[:40] + [5, 5] * 12)  # a 2-token cycle repeats its 4-grams too
    three = [1, 2, 3, 4] * 3
    assert not ends_in_loop(code[:52] + three)  # three times is not yet a loop
    assert not ends_in_loop([1, 2, 3, 4] * 4 + code[:32])  # a loop that ended more than 32 tokens ago
    assert not ends_in_loop([])
