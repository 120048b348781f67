"""Dynamic sampling with 2 real processes (see resample_run.py): one process's groups all have equal rewards, the
other's none. Both processes draw and generate the same extra rounds (no collective waits forever), and each keeps
informative groups only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, _free_port, launch_env

pytestmark = pytest.mark.distributed


def _launch(tmp_path: Path, layout: str, saturated: int) -> list[dict]:
    script = Path(__file__).with_name("resample_run.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu/ddp.yaml",
               "--main_process_port", str(_free_port()), str(script), "--out", str(tmp_path), "--layout", layout,
               "--saturated", str(saturated)]
    done = subprocess.run(command, cwd=REPO, env=launch_env({"ACCELERATE_USE_CPU": "true"}), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]


def test_one_process_all_zero_variance_whole_groups(tmp_path):
    """4 rows per process, G = 2: process 0's 2 groups have equal rewards at each step's first call. Empty places:
    2 on process 0, 0 on process 1; 2 of 4 groups informative -> ceil(2 / 0.5) = 4 prompts per process, at most its
    2 groups: 2 extra prompts per process, 4 rows each. Process 1 generates its 4 rows too (the same collectives),
    and they are dropped; process 0's two informative extra groups fill its places."""
    ranks = _launch(tmp_path, "whole", saturated=0)
    assert [r["num_processes"] for r in ranks] == [2, 2] and [r["steps"] for r in ranks] == [2, 2]
    for rank in ranks:
        assert rank["calls"] == [4, 4, 4, 4]  # per step: the round's 4 rows, then the extra round's 4 rows
        for entry in rank["logs"]:
            assert entry == {"zero_variance_groups/extra_rounds": 1.0, "zero_variance_groups/prompts_generated": 8.0,
                             "zero_variance_groups/fraction": 0.25, "zero_variance_groups/kept": 0.0}
        for kept in rank["kept"]:
            assert kept["rows"] == 4
            # every kept group has rewards (0, 1) or (2, 3): advantages -/+ 0.7071 (sample std of two values)
            assert all(abs(abs(a) - 0.7071) < 1e-3 for a in kept["advantages"])


def test_one_process_all_zero_variance_groups_spanning_processes(tmp_path):
    """3 rows per process, G = 2: group 0 on process 0, group 1 split (row 2 of process 0, row 0 of process 1),
    group 2 on process 1. Process 1 saturates: its group 2 (rewards 1, 1) is empty; group 1 (2.0 from process 0,
    1.0 from process 1) is informative. Groups span processes, so the extra round is a full round of the same
    layout: its group 2 (position rewards 1, 2 on process 1) fills place 2."""
    ranks = _launch(tmp_path, "spanning", saturated=1)
    for rank in ranks:
        assert rank["calls"] == [3, 3, 3, 3]
        for entry in rank["logs"]:
            assert entry == {"zero_variance_groups/extra_rounds": 1.0, "zero_variance_groups/prompts_generated": 6.0,
                             "zero_variance_groups/fraction": pytest.approx(1 / 6), "zero_variance_groups/kept": 0.0}
        for kept in rank["kept"]:
            assert kept["rows"] == 3 and all(a != 0 for a in kept["advantages"])
