"""RunLogCallback: one JSONL line per log step on the main process, a fresh file per run, and the PNG."""

import json
import math
from types import SimpleNamespace

from grpo_trainer.reporting.run_log import RunLogCallback, plot_metrics, read_metrics, reward_rise


def _state(step: int, main: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, is_world_process_zero=main)


def test_appends_one_line_per_log_on_the_main_process_only(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    callback = RunLogCallback()
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "reward": 5.0}\n')  # a previous run's file
    callback.on_train_begin(args, _state(0), None)
    callback.on_log(args, _state(1), None, logs={"reward": 0.25, "kl": 0.0})
    callback.on_log(args, _state(1, main=False), None, logs={"reward": 99.0})
    callback.on_log(args, _state(2), None, logs={"reward": 0.75, "kl": 0.5})
    callback.on_log(args, _state(2), None, logs={"train_runtime": 3.0})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "reward": 0.25, "kl": 0.0}, {"step": 2, "reward": 0.75, "kl": 0.5},
                     {"step": 2, "train_runtime": 3.0}]
    assert [row["step"] for row in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    callback.on_train_begin(args, _state(2), None)  # resumed from a checkpoint: keep the history
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_reward_rise_averages_the_first_and_last_tenth():
    rows = [{"reward": r} for r in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5,
                                    1.6, 1.7, 1.8, 1.9]]
    # 20 steps -> 2 per tenth: (0.0 + 0.1) / 2 = 0.05 and (1.8 + 1.9) / 2 = 1.85
    first, last = reward_rise(rows)
    assert math.isclose(first, 0.05) and math.isclose(last, 1.85)
    assert reward_rise([{"reward": 0.5}]) == (0.5, 0.5)


def test_plot_draws_every_panel_and_skips_an_empty_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10, "reward_std": 0.1, "kl": s / 100,
                                        "completions/mean_length": 3.0}) + "\n" for s in range(1, 11)))
    png = plot_metrics(str(path), str(tmp_path / "metrics.png"))
    assert png and (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.jsonl").write_text('{"step": 0, "train_runtime": 1.0}\n')
    assert plot_metrics(str(tmp_path / "empty.jsonl"), str(tmp_path / "none.png")) is None
    assert not (tmp_path / "none.png").exists()
