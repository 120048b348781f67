"""`partial_rollouts` under 2-process DDP and ZeRO-2 over gloo (partial_run.py): each process parks and resumes its own
groups (no row crosses processes), every process trains the same number of groups in every round (its share of
the round, whole groups), the processes end with identical weights that training changed, and every loss is
finite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.conftest import LAUNCH_TIMEOUT_S, accelerate_launch, launch_env

pytestmark = pytest.mark.distributed

PARTIAL_RUN = Path(__file__).with_name("partial_run.py")


@pytest.mark.parametrize("config", ["ddp.yaml", "deepspeed_zero2.yaml"], ids=["ddp", "zero2"])
def test_processes_train_the_same_number_of_whole_groups_and_stay_in_sync(tmp_path, config):
    from tests.trained_policy import trained_policy

    trained_policy()  # built (or found) here once, so the launched processes only load it
    log = tmp_path / "launch.log"
    code, wall = accelerate_launch(config, ["--out", str(tmp_path)], launch_env({"ACCELERATE_USE_CPU": "true"}), log,
                                   script=PARTIAL_RUN)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert code == 0 and (tmp_path / "result.json").exists(), \
        f"accelerate launch exited {code} after {wall:.0f}s (timeout {LAUNCH_TIMEOUT_S}s):\n{tail}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["num_processes"] == 2
    rank0, rank1 = result["ranks"]
    for rank in (rank0, rank1):
        assert [r["trained_groups"] for r in rank["rounds"]] == [2, 2, 2]
        assert all(r["parked"] >= 1 for r in rank["rounds"])  # alpha 0.5 of 2 groups: one parked every round
    assert any(r["resumed_rows"] > 0 for rank in (rank0, rank1) for r in rank["rounds"])
    assert rank0["initial_digest"] == rank1["initial_digest"]
    assert rank0["digest"] == rank1["digest"] != rank0["initial_digest"]
    losses = [entry["loss"] for entry in result["log_history"] if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert any(entry.get("partial/stale_token_share", 0) > 0 for entry in result["log_history"])
