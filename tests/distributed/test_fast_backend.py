"""The default rollout backend (`fast`) under 2-process DDP over gloo (fast_run.py): the hand-written decoder serves
every round on both processes (no fall-back tier runs), the processes agree on each round's prompt groups and end
with identical weights that training changed, and every logged loss is finite.

Unlike the harness's runs, these rollouts are sampled by the trainer itself, so they are not compared with a
1-process run: what is checked is what must hold whatever was sampled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import harness  # tests/distributed, on sys.path through conftest.py
import pytest

from tests.distributed.conftest import LAUNCH_TIMEOUT_S, accelerate_launch, launch_env

pytestmark = pytest.mark.distributed

FAST_RUN = Path(__file__).with_name("fast_run.py")


def _launch(tmp_path_factory, model_dir, *flags: str) -> dict:
    out = tmp_path_factory.mktemp("dist_fast")
    log = out / "launch.log"
    code, wall = accelerate_launch("ddp.yaml", ["--out", str(out), "--model-dir", str(model_dir), *flags],
                                   launch_env({"ACCELERATE_USE_CPU": "true"}), log, script=FAST_RUN)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert code == 0 and (out / "result.json").exists(), \
        f"accelerate launch exited {code} after {wall:.0f}s (timeout {LAUNCH_TIMEOUT_S}s):\n{tail}"
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def fast_ddp(model_dir, tmp_path_factory) -> dict:
    return _launch(tmp_path_factory, model_dir)


def test_the_decoder_serves_every_round_and_both_processes_end_with_the_same_trained_weights(fast_ddp):
    assert fast_ddp["num_processes"] == 2 and fast_ddp["distributed_type"] == "MULTI_CPU"
    rank0, rank1 = fast_ddp["ranks"]
    for rank in (rank0, rank1):
        assert rank["backend"] == "fast"  # the default, not set by the run
        # one round per optimizer step, each on the hand-written decoder: neither fall-back tier ran
        assert rank["served"] == {"_fast_rollout": harness.STEPS, "forward_rollout": 0, "generate_rollout": 0}
        assert len(rank["rounds"]) == harness.STEPS
    assert rank0["initial_digest"] == rank1["initial_digest"]
    assert rank0["digest"] == rank1["digest"], "the processes ended with different parameters"
    assert rank0["digest"] != rank0["initial_digest"], "training changed nothing"
    losses = [entry["loss"] for entry in fast_ddp["log_history"] if "loss" in entry]
    assert len(losses) == harness.STEPS and all(math.isfinite(loss) for loss in losses)


def test_processes_agree_on_each_rounds_prompt_groups(fast_ddp, run_reference):
    """The 2 processes' rows of each round, in process order, are the 1-process run's round (the sampler does not
    depend on the backend): whole groups of G copies of one prompt, the middle group split across the two."""
    rank0, rank1 = fast_ddp["ranks"]
    reference, _ = run_reference(False)
    expected = [r["prompts"] for r in reference["ranks"][0]["rounds"]]
    assert [a["prompts"] + b["prompts"] for a, b in zip(rank0["rounds"], rank1["rounds"])] == expected
    for a, b in zip(rank0["rounds"], rank1["rounds"]):
        prompts = a["prompts"] + b["prompts"]
        groups = [prompts[i:i + harness.G] for i in range(0, len(prompts), harness.G)]
        assert len(groups) == 3 and all(len(set(group)) == 1 for group in groups)
        assert a["prompts"][-2:] == b["prompts"][:2]  # the group that spans the processes
        assert len(a["completions"]) == len(b["completions"]) == 6


def test_truncated_sampling_and_the_mismatch_report_under_ddp(model_dir, tmp_path_factory):
    """top-k / top-p sampling with `sampling_mismatch_report=True` over 2 processes: both processes end with the same
    trained weights, the report's metrics are logged every step (reduced over the processes) and its per-round
    files are written once, by the main process, one per round (named by the sampling weights' step)."""
    run = _launch(tmp_path_factory, model_dir, "--truncated")
    rank0, rank1 = run["ranks"]
    assert rank0["digest"] == rank1["digest"] != rank0["initial_digest"]
    steps = [entry for entry in run["log_history"] if "loss" in entry]
    assert len(steps) == harness.STEPS and all(math.isfinite(entry["loss"]) for entry in steps)
    assert all(math.isfinite(entry["sampling/sampling_logp_difference/max"]) for entry in steps)
    # in-process sampling at float32: the sampler's exact log-probs over the kept supports are the trainer's
    assert max(entry["sampling/sampling_logp_difference/max"] for entry in steps) < 1e-4
    assert rank0["mismatch_files"] == [f"step_{step:06d}.json" for step in range(harness.STEPS)]
