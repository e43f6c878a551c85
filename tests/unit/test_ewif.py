"""EWIF (Theorem 4.1 / Corollary 4.2) against closed forms and hand-computed values."""

import pytest

from cascade_service.core.ewif import best_k, ewif, ewif_single


def test_single_drafter_matches_corollary_4_2_closed_form():
    for alpha in (0.3, 0.6, 0.9):
        for cost in (0.0, 0.05, 0.3):
            for k in (1, 4, 9):
                closed = (1 - alpha ** (k + 1)) / ((1 - alpha) * (cost * k + 1))
                assert ewif_single(alpha, cost, k) == pytest.approx(closed)


def test_theorem_4_1_by_hand_for_a_horizontal_block():
    # positions 1-2 from base (alpha .8, cost .2), position 3 from MaG (alpha .5, cost 0)
    expected = (1 + 0.8 + 0.64 + 0.32) / (1 + 0.2 + 0.2 + 0.0)
    assert ewif([0.8, 0.8, 0.5], [0.2, 0.2, 0.0]) == pytest.approx(expected)


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    assert best_k(0.9, 0.05) > best_k(0.6, 0.05) > 1
    assert best_k(0.8, 0.02) >= best_k(0.8, 0.2)
    assert best_k(0.1, 0.5) == 1


def test_paper_table_1_simulated_ewif_shape():
    # Table 1 reports base alone 2.96 -> base + small 3.03 on CNNDM: a cheap tail of lower-acceptance
    # tokens can raise EWIF. The same holds here for a free tail (MaG, cost 0) at any positive alpha.
    alone = ewif([0.8] * 5, [0.1] * 5)
    with_tail = ewif([0.8] * 5 + [0.3] * 3, [0.1] * 5 + [0.0] * 3)
    assert with_tail > alone


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="one entry per block position"):
        ewif([0.5], [])
