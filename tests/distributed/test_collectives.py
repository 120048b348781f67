"""The trainer's cross-process reductions for TRL's loss options, with 2 real processes (see collectives.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.conftest import accelerate_launch, launch_env

pytestmark = pytest.mark.distributed


def test_cross_process_entropy_quantile_clip_extremes_and_entropy_control(tmp_path):
    script = Path(__file__).with_name("collectives.py")
    log = tmp_path / "launch.log"
    code, _ = accelerate_launch("ddp.yaml", ["--out", str(tmp_path)], launch_env({"ACCELERATE_USE_CPU": "true"}), log,
                                script=script)
    assert code == 0, log.read_text(errors="replace")[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    # Pooled completion-token entropies: 0.1 0.9 0.5 0.3 0.7 | 2 3 -> sorted 0.1 0.3 0.5 0.7 0.9 2 3; the 0.5
    # quantile is the 4th value, 0.7. Kept: 0.9 and 0.7 on process 0 (alone it would be 0.5: also 0.5), both of
    # process 1; never a padding position.
    assert ranks[0]["kept"] == [[0, 1, 0, 0], [0, 1, 0, 0]]
    assert ranks[1]["kept"] == [[1, 1, 0, 0]]
    # low_min over every completion of both processes: min(0.5, NaN, 0.25, 0.75) = 0.25 on each process
    assert [r["low_min"] for r in ranks] == [0.25, 0.25]
    # Window entropy, token-weighted over both: (0.1 + 0.9 + 0.5 + 0.3 + 0.7 + 2 + 3) / 7 = 7.5 / 7 = 1.071429
    # (process 0 alone: 0.5); above the target 1.0, so the coefficient drops one step to 0.05, on both processes.
    for r in ranks:
        assert r["window_entropy"] == pytest.approx(7.5 / 7, abs=1e-6)
        assert r["coef"] == pytest.approx(0.05) and r["logged_coef"] == pytest.approx([0.05])
