"""Asynchronous rollouts under 2-process DDP on CPU (gloo) with the default `fast` backend (async_run.py): the
processes train together (identical weights), each samples its own share of every round ahead, and a second launch
reproduces the first exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.conftest import accelerate_launch, launch_env

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("async_run.py")


def _launch(out: Path) -> list[dict]:
    code, _ = accelerate_launch("ddp.yaml", [str(out)], launch_env({"ACCELERATE_USE_CPU": "true"}),
                                out.with_suffix(".log"), script=SCRIPT)
    assert code == 0, out.with_suffix(".log").read_text()[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_two_processes_train_together_and_reproducibly_with_rounds_sampled_ahead(tmp_path):
    first = _launch(tmp_path / "first")
    assert [r["processes"] for r in first] == [2, 2] and {r["backend"] for r in first} == {"fast"}
    assert first[0]["digest"] == first[1]["digest"]  # DDP kept the processes' weights identical
    # 3 steps: round 0 sampled up front, rounds 1 and 2 one step ahead; staleness 0 then 1
    assert [len(r["rounds"]) for r in first] == [3, 3] and first[0]["staleness"] == [0.0, 1.0, 1.0]
    assert first[0]["rounds"] != first[1]["rounds"]  # each process sampled its own rows (and seed stream)
    second = _launch(tmp_path / "second")
    assert [r["digest"] for r in second] == [r["digest"] for r in first]
    assert [r["rounds"] for r in second] == [r["rounds"] for r in first]
