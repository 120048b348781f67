"""The combination matrix of issues 38 and 50 on CPU (the vLLM rows: tests/vllm_integration/test_matrix_vllm.py, in the
real-vLLM stage): every pair of levels of `factors.FACTORS` neither refused nor unbuilt together is in some row
(`covering.covering_rows`, greedy and deterministic); each row trains 2 steps on a tiny model and must show finite
losses, weights that moved, equal weights on every process, the launch facts the refusal tables were read with,
routing replay where asked, a resumed run equal to the straight run (resume cells), a packed run equal to its padded
twin (packed cells), async staleness within its bound, and resampling that ran and kept informative groups only. Each
package refusal the factors reach stops with its own message (`factors.refusal`: the package's tables), before any
model loads.

The rows of one process layout run in one launch, one after the other (`cell_run.py`): the 1-process rows here in
pytest's process, the DDP (with the sp_size=2 rows), ZeRO-2, ZeRO-3 and FSDP2 rows in one `accelerate launch` each (2
processes over gloo); once per session, also under pytest-xdist (`checks.once_per_session`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.matrix import cell_run, factors
from tests.matrix.checks import check_refused, check_trained, launch, once_per_session

pytestmark = pytest.mark.matrix

ROWS = [row for row in factors.rows() if not factors.uses_vllm(row)]
REFUSED = [row for row in factors.refusal_cells() if not factors.uses_vllm(row)]
# Combinations the matrix found broken and not yet fixed: {cell name: the bug}. Each stays xfail(strict=True), so
# the fix turns its cell into a failure until it is removed from here.
KNOWN_BUGS: dict[str, str] = {}
# Combinations that fail only in some runs (a race): xfail without strict, so that a run that passes passes too.
INTERMITTENT_BUGS: dict[str, str] = {}


def group(row: dict) -> list[dict]:
    """The cells launched with `row`: its process layout's rows, then its refusal cells of the trainer's kind."""
    return [r for r in ROWS if r["processes"] == row["processes"]] + \
        [{**r, "refused": True} for r in REFUSED
         if r["processes"] == row["processes"] and factors.refusal(r).where == "trainer"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`launched(row)` -> its cell's record; each process layout is run once, on first use."""
    cache: dict[str, list[dict] | str] = {}

    def result(row: dict) -> dict:
        layout = row["processes"]
        cells = group(row)
        if layout not in cache:
            def run(out: Path) -> list[dict] | str:
                start = time.perf_counter()
                records = cell_run.run_all(cells, out) if layout == "1" else launch(layout, cells, out)
                print(f"\n[matrix] {layout}: {len(cells)} cells in {time.perf_counter() - start:.1f}s")
                return records

            cache[layout] = once_per_session(tmp_path_factory, f"matrix_{layout}", run)
        if isinstance(cache[layout], str):
            pytest.fail(cache[layout])
        index = next(i for i, c in enumerate(cells) if c == row or (c.get("refused") and
                                                                   {**row, "refused": True} == c))
        return cache[layout][index]

    return result


def _param(row: dict, refused: bool = False):
    name = factors.name(row)
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])] if name in KNOWN_BUGS else \
        [pytest.mark.xfail(strict=False, reason=INTERMITTENT_BUGS[name])] if name in INTERMITTENT_BUGS else []
    if row["processes"] != "1":
        marks.append(pytest.mark.distributed)
    return pytest.param(row, id=name, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_cell_trains(row, launched):
    check_trained(row, launched(row))


@pytest.mark.parametrize("row", [_param(r) for r in REFUSED])
def test_refused_combination_is_named_before_the_model_loads(row, launched, tmp_path):
    if factors.refusal(row).where == "config":  # GRPOConfig's own check: no process layout involved
        record = cell_run.refuse_cell(row, tmp_path)
    else:
        record = launched({**row})
    check_refused(row, record)
