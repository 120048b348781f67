"""benchmarks/gpu/decode_bench.py, wired on CPU so that a short GPU session does not fail on an API mismatch:
without CUDA it exits 0 saying why; with `--device cpu --shape tiny` every variant but transformers' continuous
batching (which does not finish on CPU within its timeout) runs, writes its JSON, and counts the same generated
tokens for each (the same seeded lengths: the static steps end rows where generate does)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

SCRIPT = f"{REPO}/benchmarks/gpu/decode_bench.py"


def _run(*args, timeout=300):
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_without_cuda_it_exits_0_with_the_reason():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"skipped": "no CUDA device"}


def test_a_tiny_cpu_dry_run_measures_every_variant(tmp_path):
    out = tmp_path / "decode.json"
    variants = "generate,generate/static,ours/decoder,ours/compact,ours/graphs"
    proc = _run("--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--length", "24", "--prompt-length",
                "12", "--length-spread", "10,0.8", "--variants", variants, "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    rows = {row["variant"]: row for row in summary["results"]}
    assert list(rows) == variants.split(",")
    assert all("failed" not in row and row["tokens_per_s"] > 0 for row in rows.values()), rows
    assert len({row["tokens"] for row in rows.values()}) == 1  # lengths are the schedule's, for every variant
    assert rows["generate"]["x_generate"] == 1.0 and summary["weight_bytes"] > 0
