"""The covering-array generator itself: every admitted pair of levels is in some row (checked by enumerating all
pairs), no row breaks the rule, the refused pairs are in none, the result is the same on every call, and it is
small (at least the product of the two largest factors, which any pairwise array needs)."""

import itertools

import pytest

from tests.matrix import factors as matrix
from tests.matrix.covering import all_pairs, covering_rows, pairs_of


def admitted(factors, allowed):
    """The pairs of levels of some full row that `allowed` admits, by enumerating every full row."""
    names = list(factors)
    full = (dict(zip(names, levels)) for levels in itertools.product(*factors.values()))
    return set().union(*(pairs_of(row, names) for row in full if allowed(row)))


def covered(rows, names):
    return set().union(*(pairs_of(row, names) for row in rows))


def test_every_pair_of_a_small_unconstrained_space_is_covered_in_few_rows():
    factors = {"a": ["0", "1", "2"], "b": ["0", "1", "2"], "c": ["0", "1"], "d": ["0", "1"]}
    rows = covering_rows(factors)
    assert covered(rows, list(factors)) == set(all_pairs(factors))
    # 3 x 3 pairs of (a, b) need 9 rows, and 9 suffice (an orthogonal array); the greedy fill needs one more
    assert len(rows) == 10
    # by enumeration: the 3 * 3 + 3 * 2 * 2 + 3 * 2 * 2 + 2 * 2 = 37 pairs
    assert len(all_pairs(factors)) == 37


def test_a_rule_keeps_its_pairs_out_and_every_other_pair_in():
    factors = {"a": ["x", "y"], "b": ["x", "y"], "c": ["p", "q", "r"]}

    def allowed(row):  # a=x with b=y is refused; a=y, b=y, c=r together is refused (a 3-way rule)
        return not (row.get("a") == "x" and row.get("b") == "y") and \
            not (row.get("a") == "y" and row.get("b") == "y" and row.get("c") == "r")

    rows = covering_rows(factors, allowed)
    assert all(allowed(row) for row in rows)
    want = admitted(factors, allowed)
    assert (("a", "x"), ("b", "y")) not in want  # refused as a pair
    assert (("b", "y"), ("c", "r")) not in want  # a=x is refused with b=y, a=y with b=y and c=r: no row holds it
    assert (("a", "y"), ("c", "r")) in want  # with b=x
    assert covered(rows, list(factors)) == want


def test_the_matrix_covers_every_admitted_pair_of_its_factors_and_is_deterministic():
    rows = matrix.rows()
    names = list(matrix.FACTORS)
    pairs = all_pairs(matrix.FACTORS)
    want = admitted(matrix.FACTORS, lambda row: matrix.refusal(row) is None)
    assert covered(rows, names) == want
    assert all(matrix.refusal(row) is None for row in rows)
    assert rows == matrix.rows()
    # the refused pairs (each tested as a refusal cell instead) are exactly the pair rules
    assert {frozenset(p) for p in set(pairs) - want} == {
        frozenset({("zero_variance_groups", "resample"), ("async_rollouts", "1")}),
        frozenset({("zero_variance_groups", "skip"), ("beta", "0.04")})}
    largest = sorted(len(levels) for levels in matrix.FACTORS.values())[-2:]
    assert largest[0] * largest[1] <= len(rows) <= 2 * largest[0] * largest[1]
    # the space the pairs were enumerated over: 4 x 4 x 3 x 2^7 full rows
    assert len(list(itertools.product(*matrix.FACTORS.values()))) == 6144


@pytest.mark.parametrize("rule", range(len(matrix.REFUSALS)))
def test_each_refusal_rule_has_a_cell(rule):
    cell = matrix.refusal_cells()[rule]
    assert matrix.refusal(cell) == matrix.REFUSALS[rule]
