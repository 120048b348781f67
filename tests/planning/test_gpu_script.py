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
