"""`grpo-train doctor RUN_DIR`: the same diagnosis as the live run from this package's metrics.jsonl, the diagnosis of
a real TRL 1.16 run from its trainer_state.json, the recorded README demo judged healthy, and one clear error per
unreadable directory or file."""

import json
import shutil
from pathlib import Path

import pytest
import trl

from grpo_trainer.cli import command as cli
from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from grpo_trainer.reporting.run_log import RunLogCallback
from tests.helpers import REPO, make_trainer

RESULTS = Path(REPO) / "benchmarks" / "results"
DEMO_LOG = RESULTS / "demo_2026-11-28_metrics.jsonl"  # the README's 600-step demo, before the health checks
DEMO_LOG_CHECKED = RESULTS / "demo_2026-12-02_metrics.jsonl"  # ... with them on (their metrics, their summary)


def _doctor(capsys, *argv):
    cli.main(["doctor", *map(str, argv)])
    return capsys.readouterr().out


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main(["doctor", *map(str, argv)])
    assert stop.value.code == 2
    return capsys.readouterr().err


def _tokens(completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def test_doctor_repeats_the_live_diagnosis_from_metrics_jsonl(tmp_path, tokenizer, capsys):
    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[_tokens], per_device_train_batch_size=32,
                           num_generations=8, max_completion_length=4, learning_rate=0.03, max_steps=12,
                           callbacks=[RunLogCallback()])
    trainer.train()
    capsys.readouterr()
    out = _doctor(capsys, tmp_path)
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 'metrics.jsonl'}: 12 training log steps"
    live = trainer.health.summary.lines()
    assert "truncation" in live[1]
    assert lines[lines.index(live[0]):lines.index(live[0]) + len(live)] == live  # word for word, "finished" included
    assert any(line.startswith("health: completions cut at max_completion_length since step 2") for line in lines)
    assert any(line.strip().startswith("completions/clipped_ratio") and "▁" in line for line in lines)  # sparkline
    assert lines[-1] == f"plot: {tmp_path / 'health.png'}" and (tmp_path / "health.png").stat().st_size > 5_000


def _exact(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def test_doctor_reads_a_trl_run(tmp_path, tokenizer, capsys):
    """A real trl.GRPOTrainer (1.16) run on the same offline tiny model: an exact-answer reward with 2 completion
    tokens for a 3-digit answer (never right, every completion cut). The Trainer writes trainer_state.json into its
    checkpoint folder only."""
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=8,
                          max_completion_length=2, max_steps=6, logging_steps=1, save_strategy="steps", save_steps=6,
                          report_to="none", learning_rate=1e-3, use_cpu=True, bf16=False, disable_tqdm=True, seed=0)
    trl.GRPOTrainer(model=make_tiny_model(tokenizer), reward_funcs=_exact, args=args,
                    train_dataset=copy_digits_dataset(32), processing_class=tokenizer).train()
    state = tmp_path / "checkpoint-6" / "trainer_state.json"
    assert "completions/clipped_ratio" in json.loads(state.read_text())["log_history"][0]
    capsys.readouterr()
    out = _doctor(capsys, tmp_path)
    assert out.startswith(f"{state}: 6 training log steps")
    assert "Training health (steps 1-6, 6 log steps checked; log read at step 6): 3 diagnoses." in out
    assert "- zero_variance: groups with equal rewards (no gradient); from step 2, not cleared; worst " \
           "frac_reward_zero_std = 1 (threshold 0.75)" in out
    assert "- truncation: completions cut at max_completion_length; from step 2" in out
    assert "- reward_saturated (_exact)" in out
    # TRL's log has no run settings: the fixes name the fields without values
    assert "raise num_generations, make the reward denser" in out
    assert (tmp_path / "health.png").exists()


@pytest.mark.parametrize("log, stopped", [(DEMO_LOG, "log read at step 600"),
                                         (DEMO_LOG_CHECKED, "finished at step 600")])
def test_the_readme_demo_logs_are_healthy(tmp_path, capsys, log, stopped):
    """Both recorded 600-step demos (the second with the health checks on: their metrics and its summary record)."""
    shutil.copy(log, tmp_path / "metrics.jsonl")
    out = _doctor(capsys, tmp_path)
    assert f"Training health (steps 10-600, 60 log steps checked; {stopped}): no problem diagnosed." in out
    assert "plot:" not in out and not (tmp_path / "health.png").exists()


def test_doctor_options(tmp_path, capsys):
    """Threshold overrides on the command line (here: count groups of equal rewards from 40%, and never call the
    task learned), and --no_plot."""
    shutil.copy(DEMO_LOG, tmp_path / "metrics.jsonl")
    out = _doctor(capsys, tmp_path, "--health_thresholds", '{"zero_variance_fraction": 0.4, "learned_rise": 1000}',
                  "--no_plot")
    assert "- zero_variance: groups with equal rewards (no gradient); from step" in out
    assert "(threshold 0.4)" in out and not (tmp_path / "health.png").exists()
    assert "unknown threshold 'nope'" in _error(capsys, tmp_path, "--health_thresholds", '{"nope": 1}')
    assert "--health_thresholds is not JSON" in _error(capsys, tmp_path, "--health_thresholds", "{")


def test_unreadable_runs_are_named(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert f"grpo-train doctor: error: {str(missing)!r} is not a directory" in _error(capsys, missing)
    assert f"no metrics.jsonl or trainer_state.json in {str(tmp_path)!r}" in _error(capsys, tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n{"step": 2, "loss": \n')
    assert f"cannot read {str(tmp_path / 'metrics.jsonl')!r} line 2: not JSON" in _error(capsys, tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3}')
    assert "has no log_history list" in _error(capsys, tmp_path)
    (tmp_path / "trainer_state.json").write_text('{"log_history": [{"train_runtime": 1.0}]}')
    assert "has no training log step yet" in _error(capsys, tmp_path)
