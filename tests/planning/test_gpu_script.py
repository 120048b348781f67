"""benchmarks/gpu/memory_grid.py, wired on CPU: without CUDA it exits 0 saying why, and its child runs (ours, ours
on the model-logits path, TRL) train and report every phase, so a GPU run does not fail on an API mismatch."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "memory_grid.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from memory_grid import Config, _env  # noqa: E402 - benchmarks/ on sys.path above


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_without_cuda_it_exits_0_with_the_reason():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"skipped": "no CUDA device"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run of the children")
@pytest.mark.parametrize("run", ["ours", "ours_model_logits", "trl"])
def test_each_child_trains_and_reports_its_phases(tmp_path, tokenizer, run):
    from grpo_trainer.cli.toy import make_tiny_model

    make_tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = Config("smoke", "-", 6, micro_batch=8, bf16=True, steps=1)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", run, "--config", json.dumps(asdict(config)),
                           "--model-dir", str(tmp_path / "model"), "--out", str(out)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = {phase for phase, _ in result["phases_allocated_gib"]}
    assert {"rollout", "loss forward", "backward", "optimizer step"} <= phases
    assert (result["prediction"] is None) == (run == "trl")


def test_phase_snapshots_replay_the_allocator_history():
    """A hand-made history: the loss forward's peak is A + B = 150 bytes (before A is freed), with A and B alive;
    the later allocation C (30) after A's free stays below it (50 + 30 = 80). The rollout occurs twice: the last
    occurrence's peak counts (W still alive from the rollout: 10 + 5 = 15, not the first's 40).
    1000 bytes were allocated before the history began: an entry of their own."""
    from importlib import util

    spec = util.spec_from_file_location("gpu_memory_grid", SCRIPT)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def mark(addr):
        return {"action": "alloc", "addr": addr, "size": 512, "frames": [{"filename": "x.py", "line": 1,
                                                                         "name": "_phase_mark"}]}

    def alloc(addr, size, where):
        return {"action": "alloc", "addr": addr, "size": size,
                "frames": [{"filename": f"/site/torch/{where}.py", "line": 3, "name": where},
                           {"filename": "/repo/grpo_trainer/trainer/loss.py", "line": 58, "name": "__call__"}]}

    def free(addr):
        return {"action": "free_completed", "addr": addr}

    trace = [mark(1), alloc(10, 40, "first"), free(10), mark(1),
             mark(1), alloc(11, 10, "kept"), alloc(12, 5, "rollout"), free(12), mark(1),
             mark(1), alloc(20, 100, "a"), alloc(21, 50, "b"), free(20), alloc(22, 30, "c"), mark(1)]
    marks = [("rollout", "start"), ("rollout", "end"), ("rollout", "start"), ("rollout", "end"),
             ("loss forward", "start"), ("loss forward", "end")]
    result = {r["phase"]: r for r in module.phase_snapshots(trace, marks, baseline=1000)}
    assert result["rollout"]["peak_gib"] * 2**30 == 1000 + 15
    loss = result["loss forward"]
    assert loss["peak_gib"] * 2**30 == 1000 + 10 + 100 + 50  # the rollout's kept block is alive too
    assert [(t["site"], t["gib"] * 2**30) for t in loss["top"]] == [
        ("(allocated before the recorded step)", 1000),
        ("torch/a.py:3 a < grpo_trainer/trainer/loss.py:58 __call__", 100),
        ("torch/b.py:3 b < grpo_trainer/trainer/loss.py:58 __call__", 50),
        ("torch/kept.py:3 kept < grpo_trainer/trainer/loss.py:58 __call__", 10)]
