"""A pairwise covering array (all-pairs) with constraints, deterministic: the test-side generator of the combination
matrix (`factors.py`, `test_matrix.py`).

Greedy, one row at a time (AETG's row construction with IPOG's deterministic order): each new row starts from the
first pair of levels (in factor order, then level order) that no row covers yet, and fills the other factors in
their order, each with the level that covers the most still-uncovered pairs with the levels already chosen (ties:
the earlier level), among the levels `allowed` accepts for the row so far, backtracking where a rule would leave a
later factor without a level. A pair that no allowed row can hold (`allowed` refuses the two levels together, or
every row with them) is not required; every other pair ends up in some row. The same factors and rule always give
the same rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

Row = dict[str, str]
Pair = tuple[tuple[str, str], tuple[str, str]]  # ((factor a, level), (factor b, level)), a before b in factor order


def all_pairs(factors: Mapping[str, Sequence[str]]) -> list[Pair]:
    """Every pair of levels of two different factors, in factor order then level order."""
    names = list(factors)
    return [((a, la), (b, lb)) for a, b in itertools.combinations(names, 2) for la in factors[a] for lb in factors[b]]


def pairs_of(row: Mapping[str, str], names: Sequence[str]) -> set[Pair]:
    """The pairs a (possibly partial) row covers; `names` gives the factor order."""
    present = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(present, 2)}


def covering_rows(factors: Mapping[str, Sequence[str]], allowed: Callable[[Row], bool] = lambda row: True
                  ) -> list[Row]:
    """Rows (factor -> level) covering every pair of levels that some row `allowed` admits holds. `allowed(partial
    row)` must be False only for rows that break a rule whose factors are all assigned (a refusal)."""
    names = list(factors)
    uncovered = [p for p in all_pairs(factors) if allowed(dict(p))]
    remaining = set(uncovered)
    rows: list[Row] = []
    for seed in uncovered:
        if seed not in remaining:
            continue
        row = _complete(dict(seed), names, factors, allowed, remaining)
        if row is None:  # no admitted row holds this pair (a rule of three or more factors excludes every completion)
            remaining.discard(seed)
            continue
        rows.append(row)
        remaining -= pairs_of(row, names)
    return rows


def _complete(row: Row, names: list[str], factors: Mapping[str, Sequence[str]], allowed: Callable[[Row], bool],
              remaining: set[Pair]) -> Row | None:
    """`row` filled in factor order, each factor's levels tried by how many `remaining` pairs they cover with the
    levels chosen so far (most first, ties: the earlier level), backtracking where a rule leaves a later factor no
    level; None when no admitted row extends `row`."""
    todo = [n for n in names if n not in row]
    if not todo:
        return {n: row[n] for n in names}
    name = todo[0]
    candidates = [{**row, name: level} for level in factors[name]]
    gains = [len(pairs_of(c, names) & remaining) if allowed(c) else -1 for c in candidates]
    for i in sorted(range(len(candidates)), key=lambda i: -gains[i]):  # stable: ties keep level order
        if gains[i] < 0:
            break
        done = _complete(candidates[i], names, factors, allowed, remaining)
        if done is not None:
            return done
    return None
