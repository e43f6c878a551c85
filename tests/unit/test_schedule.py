"""K-matrix convention: row r = reviewer T_r, column c = drafter T_{c+1}, per-drafter increments."""

import pytest

from cascade_service.core.schedule import Schedule, ScheduleError

THREE = ("base", "small", "mag")


# --- the paper's configs ---------------------------------------------------------------------


def test_authors_flan_t5_config_parses():
    s = Schedule.parse([[5, 14, 10], [0, 1, 10], [0, 0, 10]], THREE)
    assert s.k == ((5, 14, 10), (0, 1, 10), (0, 0, 10)) and s.drafters == THREE
    assert s.to_lists() == [[5, 14, 10], [0, 1, 10], [0, 0, 10]]


def test_llama_config_with_one_model_drafter_and_mag_parses():
    s = Schedule.parse([[13, 10], [0, 10]], ["llama-160m", "mag"])
    assert s.row(0) == [(0, 13), (1, 10)] and s.row(1) == [(1, 10)]


def test_single_drafter_speculative_decoding_is_a_one_by_one_matrix():
    s = Schedule.parse([[4]], ["small"])
    assert s.row(0) == [(0, 4)] and s.is_leaf(1) and s.block_size(0) == 4


def test_no_drafters_means_an_empty_matrix():
    assert Schedule.parse([], []).k == ()


def test_integral_floats_become_ints():
    s = Schedule.parse([[5.0]], ["small"])
    assert s.k == ((5,),) and type(s.k[0][0]) is int


# --- row, is_leaf, block_size, default -------------------------------------------------------


def test_row_lists_positive_quotas_in_column_order():
    s = Schedule.parse([[5, 0, 10], [0, 1, 0], [0, 0, 10]], THREE)
    assert s.row(0) == [(0, 5), (2, 10)] and s.row(1) == [(1, 1)] and s.row(2) == [(2, 10)]


def test_block_size_is_the_sum_of_the_reviewers_row():
    s = Schedule.parse([[5, 14, 10], [0, 1, 10], [0, 0, 10]], THREE)
    assert [s.block_size(r) for r in range(3)] == [29, 11, 10]


def test_reviewer_with_all_zero_row_is_a_leaf_and_last_drafter_always_is():
    s = Schedule.parse([[5, 3, 10], [0, 0, 0], [0, 0, 10]], THREE)
    assert [s.is_leaf(r) for r in (1, 2, 3)] == [True, False, True]


def test_is_leaf_and_row_reject_tiers_outside_the_cascade():
    s = Schedule.parse([[5]], ["small"])
    with pytest.raises(IndexError):
        s.is_leaf(0)
    with pytest.raises(IndexError):
        s.row(1)


def test_default_is_a_diagonal_with_more_tokens_from_mag():
    assert Schedule.default(THREE).to_lists() == [[5, 0, 0], [0, 5, 0], [0, 0, 10]]
    assert Schedule.default(["small"]).to_lists() == [[5]]
    assert Schedule.default([]).to_lists() == []


def test_from_json_parses_a_matrix():
    s = Schedule.from_json("[[13, 10], [0, 10]]", ["llama-160m", "mag"])
    assert s.to_lists() == [[13, 10], [0, 10]]


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, drafters, message",
    [
        ([[5, 1, 1], [0, 1, 1]], THREE, r"K-matrix must have 3 rows, one per drafter \(base, small, mag\); got 2"),
        ([], THREE, r"must have 3 rows.*got 0"),
        ([[5]], [], r"must have 0 rows"),
        ([[5, 1], [0, 1], [0, 0, 1]], THREE, r"row 0 must have 3 entries.*got 2"),
        (
            [[5, 0, 0], [3, 5, 0], [0, 0, 8]],
            THREE,
            r"K\[1\]\[0\] = 3 is below the diagonal: tier 'base' cannot review 'base'",
        ),
        (
            [[5, 0, 0], [0, 5, 0], [0, 2, 8]],
            THREE,
            r"K\[2\]\[1\] = 2 is below the diagonal: tier 'small' cannot review 'small'",
        ),
        ([[5, -1, 0], [0, 5, 0], [0, 0, 8]], THREE, r"K\[0\]\[1\] must be a non-negative integer, got -1"),
        ([[True]], ["small"], r"K\[0\]\[0\] must be a non-negative integer, got True"),
        ([[2.5]], ["small"], r"K\[0\]\[0\] must be a non-negative integer, got 2.5"),
        ([["5"]], ["small"], r"K\[0\]\[0\] must be a non-negative integer, got '5'"),
        ([[None]], ["small"], r"K\[0\]\[0\] must be a non-negative integer, got None"),
        ([[1000]], ["small"], r"K\[0\]\[0\] = 1000 exceeds 256"),
        ([[0, 0, 0], [0, 5, 0], [0, 0, 8]], THREE, r"row 0 \(target\) is all zeros: no drafter is used"),
        (
            [[5, 0, 10], [0, 0, 0], [0, 0, 10]],
            THREE,
            r"drafter 'small' is never used: no reachable row gives it tokens",
        ),
        ([[5, 0, 0], [0, 0, 0], [0, 0, 10]], THREE, r"drafter 'small' is never used"),
        ("[[5]]", ["small"], r"K-matrix must be a list of lists, got str"),
        ([5], ["small"], r"K-matrix must be a list of lists: row 0 is int"),
        ([[5, 5], [0, 5]], ["mag", "small"], r"'mag' cannot review: it must be the last drafter"),
        ([[5, 5], [0, 5]], ["small", "small"], r"drafter names must be unique: 'small' appears 2 times"),
    ],
)
def test_invalid_matrix_is_rejected_with_a_precise_message(k, drafters, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.parse(k, drafters)


def test_unreachable_row_leaves_its_drafters_unused():
    # base is never given tokens by the target, so its row (the only one feeding small) is dead.
    with pytest.raises(ScheduleError, match="drafter 'base' is never used"):
        Schedule.parse([[0, 0, 4], [0, 2, 0], [0, 0, 3]], THREE)


def test_an_entry_that_can_never_run_is_named_with_its_tiers():
    # The refusal names the dead entry (row, column), the reviewer and the drafter, and why.
    with pytest.raises(ScheduleError, match=r"K\[1\]\[1\] = 2 \('base' reviewing 'small'\) can never run"):
        Schedule.parse([[0, 0, 4], [0, 2, 0], [0, 0, 3]], THREE)


def test_the_overshoot_shape_is_accepted_because_every_entry_runs():
    # Inner systems are no longer capped by what their parent still needs, so small reviewing mag
    # (row 2) runs even though base asks small for one token: nothing here is refused.
    assert Schedule.parse([[3, 0, 0], [0, 1, 0], [0, 0, 4]], THREE).row(2) == [(2, 4)]


def test_leaf_only_names_are_configurable():
    with pytest.raises(ScheduleError, match="'ngram' cannot review"):
        Schedule.parse([[5, 5], [0, 5]], ["ngram", "small"], leaf_only={"ngram"})
    assert Schedule.default(["small", "ngram"], leaf_only={"ngram"}).to_lists() == [[5, 0], [0, 10]]


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_direct_construction_is_validated_too():
    with pytest.raises(ScheduleError, match="below the diagonal"):
        Schedule(("base", "small"), ((5, 0), (1, 5)))


@pytest.mark.parametrize(
    "text, message",
    [("[[5, 1", "not valid JSON"), ('{"k": 1}', "list of lists, got dict"), ("[1, 2]", "row 0 is int")],
)
def test_from_json_rejects_invalid_json_and_non_matrices(text, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_json(text, ["small", "mag"])
