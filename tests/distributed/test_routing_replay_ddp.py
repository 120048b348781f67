"""`routing_replay='on'` under 2-process DDP over gloo (moe_run.py): every process records its rollouts' routing and
replays it in its forwards (the reference's without grad, the policy's with it, through DDP's wrapper), the
processes end with identical weights that training changed, router weights included, and every loss is finite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import harness  # tests/distributed, on sys.path through conftest.py
import pytest

from tests.distributed.conftest import LAUNCH_TIMEOUT_S, accelerate_launch, launch_env

pytestmark = pytest.mark.distributed

MOE_RUN = Path(__file__).with_name("moe_run.py")


def test_replay_under_ddp_trains_both_processes_alike(tmp_path):
    log = tmp_path / "launch.log"
    code, wall = accelerate_launch("ddp.yaml", ["--out", str(tmp_path)], launch_env({"ACCELERATE_USE_CPU": "true"}),
                                   log, script=MOE_RUN)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert code == 0 and (tmp_path / "result.json").exists(), \
        f"accelerate launch exited {code} after {wall:.0f}s (timeout {LAUNCH_TIMEOUT_S}s):\n{tail}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["num_processes"] == 2 and result["distributed_type"] == "MULTI_CPU"
    rank0, rank1 = result["ranks"]
    for rank in (rank0, rank1):
        assert rank["replay_on"]
        # per round (one per optimizer step): the reference forward of each of the 2 micro-batches without grad,
        # the policy's with it
        assert rank["calls"] == {"no_grad": harness.STEPS * harness.ACCUMULATION,
                                 "grad": harness.STEPS * harness.ACCUMULATION}, rank["calls"]
    assert rank0["initial_digest"] == rank1["initial_digest"]
    assert rank0["digest"] == rank1["digest"], "the processes ended with different parameters"
    assert rank0["routers"] != rank0["initial_routers"], "the routers did not train"
    losses = [entry["loss"] for entry in result["log_history"] if "loss" in entry]
    assert len(losses) == harness.STEPS and all(math.isfinite(loss) for loss in losses)
