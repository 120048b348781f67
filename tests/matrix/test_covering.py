"""The covering-array generator itself, and the matrix's reading of the package's refusal tables: every admitted pair
of levels is in some row (checked by enumerating all pairs, and for the matrix by a search of its own for each
pair), no row breaks a rule, the refused pairs are in none, the result is the same on every call, and it is small
(at least the product of the two largest factors, which any pairwise array needs); `factors.READS` names every
setting the tables read and the factors that decide it; each refusal the factors reach has a cell where it alone
applies."""

import itertools

import pytest

from tests.matrix import factors as matrix
from tests.matrix.covering import all_pairs, covering_rows, pairs_of
from tests.matrix.test_matrix import INTERMITTENT_BUGS, KNOWN_BUGS
from tests.vllm_integration.test_matrix_vllm import KNOWN_BUGS as KNOWN_VLLM_BUGS


def admitted(factors, allowed):
    """The pairs of levels of some full row that `allowed` admits, by enumerating every full row."""
    names = list(factors)
    full = (dict(zip(names, levels)) for levels in itertools.product(*factors.values()))
    return set().union(*(pairs_of(row, names) for row in full if allowed(row)))


def completes(row, factors, allowed) -> bool:
    """Whether some full row extending `row` is allowed: depth first over the unset factors, in factor order, pruning
    a partial row `allowed` refuses (the matrix's rules are decided once their factors are set, so a refused partial
    row has no allowed completion)."""
    if not allowed(row):
        return False
    todo = [n for n in factors if n not in row]
    return not todo or any(completes({**row, todo[0]: level}, factors, allowed) for level in factors[todo[0]])


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
    assert want == {p for p in all_pairs(factors) if completes(dict(p), factors, allowed)}  # the search agrees


def test_the_matrix_covers_every_admitted_pair_of_its_factors_and_is_deterministic():
    rows = matrix.rows()
    names = list(matrix.FACTORS)
    pairs = all_pairs(matrix.FACTORS)
    # 4 x 3 x 5 x 2 x 2 x 3 x 2^9 = 368,640 full rows: too many to enumerate here, so each pair is searched for
    assert len(list(itertools.product(*matrix.FACTORS.values()))) == 368_640
    want = {p for p in pairs if completes(dict(p), matrix.FACTORS, matrix.allowed)}
    assert covered(rows, names) == want
    assert all(matrix.allowed(row) for row in rows)
    assert rows == matrix.rows()
    # every pair left out is refused (or unbuilt) as a pair: none is lost only through a third factor
    lost = set(pairs) - want
    assert all(not matrix.allowed(dict(p)) for p in lost)
    refused = {(r.table, r.name) for p in lost for r in [matrix.refusal(dict(p))] if r is not None}
    assert refused == {("config", "skip_with_gradient"), ("config", "resample_ahead"),
                       ("config", "routing_replay_engine"), ("config", "speculative_backend")} | {
        ("sequence", name) for name in ("processes", "engine", "padding_free", "vllm", "routing_replay", "async",
                                        "recompute_attention", "vision")}
    assert {matrix.unbuilt(dict(p)).name for p in lost if matrix.unbuilt(dict(p))} == {u.name for u in matrix.UNBUILT}
    largest = sorted(len(levels) for levels in matrix.FACTORS.values())[-2:]
    assert largest[0] * largest[1] <= len(rows) <= 2 * largest[0] * largest[1]
    assert len(rows) == 26 and sum(map(matrix.uses_vllm, rows)) == 10  # docs/COMPATIBILITY.md says so


def test_reads_names_every_setting_the_package_tables_read():
    for table in matrix.tables():
        for rule in table.refusals:
            missing = set(rule.reads) - set(matrix.READS[table.name])
            assert not missing, f"{table.name} refusal {rule.name!r} reads {sorted(missing)}: add them to READS"


def test_a_factor_changes_only_the_settings_reads_lists_for_it():
    """For every row of the matrix and refusal cell, every other level of every factor: the names a table reads
    whose value changes are among those `READS` gives that factor (so a partial row decides only what it can)."""
    for row in matrix.rows() + matrix.refusal_cells():
        for table in matrix.tables():
            names = matrix.READS[table.name]
            before = table.settings(row)
            for factor, levels in matrix.FACTORS.items():
                for level in levels:
                    after = table.settings({**row, factor: level})
                    changed = {n for n in names if matrix.value(before, n) != matrix.value(after, n)}
                    assert changed <= {n for n, fs in names.items() if factor in fs}, (table.name, factor, level)
            assert all(matrix.value(before, n) is not matrix._MISSING for n in names), table.name


@pytest.mark.parametrize("cell", matrix.refusal_cells(), ids=lambda c: matrix.refusal(c).name)
def test_each_reached_refusal_has_a_cell_where_it_alone_applies(cell):
    assert matrix.unbuilt(cell) is None
    assert len(matrix.applicable(cell)) == 1


def test_the_refusals_no_row_reaches_are_those_no_level_of_the_factors_makes_apply():
    """(A fixed setting, such as rollout_func or loss_type, or a value no level gives, such as transformers'
    continuous batching as the backend.)"""
    reached = {(r.table, r.name) for r in map(matrix.refusal, matrix.refusal_cells())}
    assert len(reached) == len(matrix.refusal_cells()) == 14
    for table in matrix.tables():
        for rule in table.refusals:
            if (table.name, rule.name) in reached:
                continue
            assert (table.name, rule.name) in matrix.unreached()
            own = matrix.reads_factors(table.name, rule)
            for levels in itertools.product(*(matrix.FACTORS[n] for n in own)):
                assert not rule.applies(table.settings(dict(zip(own, levels)))), (rule.name, levels)


def test_known_bugs_name_rows_of_their_stage():
    rows = matrix.rows()
    assert set(KNOWN_BUGS) | set(INTERMITTENT_BUGS) <= {matrix.name(row) for row in rows if not matrix.uses_vllm(row)}
    assert set(KNOWN_VLLM_BUGS) <= {matrix.name(row) for row in rows if matrix.uses_vllm(row)}
