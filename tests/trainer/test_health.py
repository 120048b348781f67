"""The training-health checks (docs/HEALTH.md) on real tiny runs: each condition is produced by a run of the toy task
that has it, is diagnosed once, and clears when its cause goes (mid-run, or in a second run without it); the summary
reaches the run log, metrics.jsonl and the model card, also when the run is interrupted; the README's demo gives no
warning; and the checks cost well under 1% of a step."""

import json
import logging
import math
import os
import signal
import time

import pytest
import torch
from transformers import TrainerCallback

from grpo_trainer.cli import command as cli
from grpo_trainer.cli.toy import copy_digits_reward
from grpo_trainer.diagnosis import signals
from grpo_trainer.reporting.run_log import RunLogCallback
from tests.helpers import make_trainer

WIDE = dict(per_device_train_batch_size=32, num_generations=8)  # 4 groups of 8 a step: steadier metrics
LOGGER = "grpo_trainer.trainer.grpo_trainer"


def _train(tmp_path, tokenizer, caplog, **settings):
    """A trained run's trainer and its health warnings (one per onset) as the run log shows them."""
    trainer = make_trainer(tmp_path, tokenizer, **{**WIDE, **settings})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("health:")
                and r.levelno == logging.WARNING]
    caplog.clear()
    return trainer, warnings


def _episodes(trainer, name):
    return [e for e in trainer.health.summary.episodes if e.finding.diagnosis == name]


def _diagnosed_once_and_cleared(trainer, warnings, name):
    (episode,) = _episodes(trainer, name)
    assert episode.end_step is not None, f"{name} did not clear: {trainer.health.summary.lines()}"
    _warning(warnings, name)
    return episode


def _warning(warnings, name):
    """The one onset warning of diagnosis `name`."""
    (warning,) = [w for w in warnings if w.startswith(f"health: {_title(name)}")]
    return warning


def _title(name):
    from grpo_trainer.diagnosis.rules import TITLES

    return TITLES[name]


class LowerLearningRate(TrainerCallback):
    """The cause of a too-large step removed mid-run: the learning rate drops to `lr` after optimizer step `at`."""

    def __init__(self, at: int, lr: float = 1e-6):
        self.at, self.lr = at, lr

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == self.at:
            for group in optimizer.param_groups:
                group["lr"] = self.lr
            lr_scheduler.base_lrs = [self.lr] * len(lr_scheduler.base_lrs)


def _tokens(completion_ids, **kwargs):
    """Shorter is better, counted in tokens (EOS included): a cut completion always scores lowest."""
    return [-float(len(ids)) for ids in completion_ids]


def test_completions_cut_at_a_few_tokens_then_cleared_once_they_stop(tmp_path, tokenizer, caplog):
    """max_completion_length=4: the random policy runs past it (9 in 10 completions cut, scoring below the finished
    ones); as the reward teaches it to stop, the cut share falls and the diagnosis clears."""
    trainer, warnings = _train(tmp_path, tokenizer, caplog, reward_funcs=[_tokens], max_completion_length=4,
                               learning_rate=0.03, max_steps=12)
    episode = _diagnosed_once_and_cleared(trainer, warnings, "truncation")
    assert episode.start_step <= 3 and episode.worst >= 0.85
    warning = _warning(warnings, "truncation")
    assert "completions/clipped_ratio = " in warning and ">= 0.5" in warning and "max_completion_length=4" in warning
    assert "raise max_completion_length" in warning


def _constant_then_copy(completions, answer, trainer_state=None, **kwargs):
    """1.0 for every completion for 6 steps (no group differs), then the copy task's partial credit."""
    if trainer_state.global_step < 6:
        return [1.0] * len(completions)
    return copy_digits_reward(completions, answer)


def test_a_constant_reward_gives_zero_variance_groups_until_it_varies(tmp_path, tokenizer, caplog):
    trainer, warnings = _train(tmp_path, tokenizer, caplog, reward_funcs=[_constant_then_copy], learning_rate=1e-3,
                               max_steps=12, max_completion_length=4)
    episode = _diagnosed_once_and_cleared(trainer, warnings, "zero_variance")
    assert episode.start_step == 2 and episode.worst == 1.0 and 6 < episode.end_step <= 10
    (saturated,) = _episodes(trainer, "reward_saturated")  # the function itself, named
    assert saturated.finding.subject == "_constant_then_copy" and saturated.end_step is not None
    warning = _warning(warnings, "zero_variance")
    assert "frac_reward_zero_std = 1 >= 0.75" in warning and "num_generations=8" in warning
    assert "zero_variance_groups='resample'" in warning


def test_a_huge_learning_rate_gives_clipping_and_kl_growth_until_it_is_lowered(tmp_path, tokenizer, caplog):
    """lr 0.03 with 4 micro-steps per round (the ratio moves off 1 after the first) and beta 0.04: the clip holds a
    third of the ratios and the KL quadruples within a few steps; lowered to 1e-6 at step 12, both clear."""
    trainer, warnings = _train(tmp_path, tokenizer, caplog, learning_rate=0.03, steps_per_generation=4, beta=0.04,
                               lr_scheduler_type="constant", max_steps=28, callbacks=[LowerLearningRate(12)])
    clipping = _diagnosed_once_and_cleared(trainer, warnings, "clipping")
    kl = _diagnosed_once_and_cleared(trainer, warnings, "kl_growth")
    assert clipping.start_step <= 8 and clipping.worst >= 0.3 and clipping.end_step > 12
    assert kl.start_step <= 12 < kl.end_step
    warning = _warning(warnings, "kl_growth")
    assert "learning_rate=0.03" in warning and "beta=0.04" in warning and "raise beta" in warning


def test_entropy_collapse_at_a_huge_learning_rate_and_not_at_a_sane_one(tmp_path, tokenizer, caplog):
    """lr 0.3: within a few steps the policy writes one completion (entropy ~1e-5 nats), every group equal and the
    reward at its worst; the same run at lr 1e-3 keeps exploring."""
    collapsed, warnings = _train(tmp_path / "huge", tokenizer, caplog, learning_rate=0.3, max_steps=10, beta=0.04)
    (episode,) = _episodes(collapsed, "entropy_collapse")
    assert episode.worst < 1e-3 and any("raise epsilon_high" in w for w in warnings)
    sane, _ = _train(tmp_path / "sane", tokenizer, caplog, learning_rate=1e-3, max_steps=10, beta=0.04)
    assert _episodes(sane, "entropy_collapse") == []


class _HalfBroken:
    """A reward function that raises (or returns None) for every other completion until step `fixed_at`."""

    def __init__(self, mode: str, fixed_at: int = 6):
        self.mode, self.fixed_at, self.__name__ = mode, fixed_at, f"parser_{mode}"

    def __call__(self, completions, answer, trainer_state=None, **kwargs):
        scores = copy_digits_reward(completions, answer)
        if trainer_state.global_step >= self.fixed_at:
            return scores
        if self.mode == "none":
            return [None if i % 2 else s for i, s in enumerate(scores)]
        if len(completions) > 1 or int(answer[0][-1]) % 2:  # the batch fails; alone, the odd answers' rows do
            raise ValueError("cannot parse the answer")
        return scores


@pytest.mark.parametrize("mode", ["raise", "none"])
def test_a_reward_function_failing_for_half_the_rows_is_named_until_fixed(tmp_path, tokenizer, caplog, mode):
    """reward_error_policy='none' keeps the run going on a function that raises: each failing sample's reward is
    missing, as it is for a function returning None; a second function scores every row."""
    broken = _HalfBroken(mode)
    trainer, warnings = _train(tmp_path, tokenizer, caplog, reward_funcs=[copy_digits_reward, broken],
                               reward_error_policy="none", learning_rate=1e-3, max_steps=12, max_completion_length=4)
    episode = _diagnosed_once_and_cleared(trainer, warnings, "reward_missing")
    assert episode.finding.subject == broken.__name__ and 0.4 <= episode.worst <= 0.8
    warning = _warning(warnings, "reward_missing")
    assert f"rewards/{broken.__name__}/missing" in warning and f"fix {broken.__name__}" in warning
    if mode == "raise":
        assert "reward_error_policy='none' turns its errors into missing rewards" in warning


def _length(completions, **kwargs):
    """Completion length in characters: varies within every group."""
    return [float(len(c)) for c in completions]


def test_a_reward_weight_that_drowns_another_function(tmp_path, tokenizer, caplog):
    """weights (1, 0.001): the length reward's spread (about 1 character) x 0.001 is drowned by copy_digits' (about
    0.05); weights (1, 1) do not drown it (the second run, the weight removed)."""
    funcs = [copy_digits_reward, _length]
    heavy, warnings = _train(tmp_path / "heavy", tokenizer, caplog, reward_funcs=funcs, reward_weights=[1.0, 0.001],
                             learning_rate=1e-3, max_steps=4)
    (episode,) = _episodes(heavy, "reward_dominance")
    assert episode.finding.subject == "copy_digits_reward" and episode.worst >= 0.9
    assert any("rebalance reward_weights" in w for w in warnings)
    even, _ = _train(tmp_path / "even", tokenizer, caplog, reward_funcs=funcs, learning_rate=1e-3, max_steps=4)
    assert _episodes(even, "reward_dominance") == []


def test_stale_asynchronous_rounds_collapse_the_importance_weights(tmp_path, tokenizer, caplog):
    """async_rollouts=1 with async_correction='recompute' logs the effective sample size of pi_old / pi_behaviour;
    at lr 0.05 one step of staleness leaves a fifth of the tokens' worth of weight; lowered at step 6, it recovers."""
    trainer, warnings = _train(tmp_path, tokenizer, caplog, learning_rate=0.05, async_rollouts=1,
                               async_correction="recompute", lr_scheduler_type="constant", max_steps=14,
                               callbacks=[LowerLearningRate(6)])
    ess = [e["async/importance_ratio_ess"] for e in trainer.state.log_history if "async/importance_ratio_ess" in e]
    assert ess and all(v > 0 for v in ess)
    # both weights: the raw pi_old / pi_behaviour, and the bounded ones the loss uses (the engine correction's)
    episodes = {e.finding.subject: e for e in _episodes(trainer, "ess_collapse")}
    assert set(episodes) == {"async/importance_ratio", "sampling/importance_sampling"}
    for prefix, episode in episodes.items():
        fractions = [e[f"{prefix}_ess_fraction"] for e in trainer.state.log_history if f"{prefix}_ess_fraction" in e]
        assert fractions[0] == pytest.approx(1.0)  # the first round is sampled with the weights it trains
        assert episode.worst <= 0.5 and min(fractions) == pytest.approx(episode.worst) and episode.end_step is not None
    onsets = [w for w in warnings if w.startswith(f"health: {_title('ess_collapse')}")]
    assert len(onsets) == 2 and all("_ess_fraction = " in w and "async_rollouts" in w for w in onsets)


def _outliers(completions, answer, trainer_state=None, **kwargs):
    """The copy reward, x 1e4 at steps 8-9 (outlier rewards) and x 3e37 at step 14 (an overflowing loss)."""
    scale = {8: 1e4, 9: 1e4, 14: 3e37}.get(trainer_state.global_step, 1.0)
    return [r * scale for r in copy_digits_reward(completions, answer)]


def test_outlier_rewards_give_a_gradient_spike_and_a_non_finite_step(tmp_path, tokenizer, caplog):
    """scale_rewards='none' passes the outliers through to the advantages."""
    trainer, warnings = _train(tmp_path, tokenizer, caplog, reward_funcs=[_outliers], scale_rewards="none",
                               learning_rate=1e-3, max_steps=20)
    spike = _diagnosed_once_and_cleared(trainer, warnings, "grad_spike")
    nonfinite = _diagnosed_once_and_cleared(trainer, warnings, "nonfinite")
    assert spike.start_step == 9 and spike.worst > 100
    assert nonfinite.start_step == 15 and nonfinite.end_step == 18


def test_the_summary_reaches_the_run_log_metrics_jsonl_and_the_model_card(tmp_path, tokenizer, caplog):
    trainer, _ = _train(tmp_path, tokenizer, caplog, reward_funcs=[_tokens], max_completion_length=4,
                        learning_rate=0.03, max_steps=6, callbacks=[RunLogCallback()])
    summary = trainer.health.summary
    assert summary.stopped == "finished at step 6" and summary.episodes[0].finding.diagnosis == "truncation"
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 6 and last["health"] == json.loads(json.dumps(summary.record()))
    assert last["health"]["facts"]["max_completion_length"] == 4
    trainer.save_model(str(tmp_path))
    card = (tmp_path / "README.md").read_text()
    assert "## Training health" in card and summary.lines()[1] in card


class _SigtermAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # what a job scheduler sends; the trainer saves and stops


def test_the_summary_on_interruption(tmp_path, tokenizer, caplog):
    with pytest.warns(UserWarning, match="SIGTERM received"):
        trainer, _ = _train(tmp_path, tokenizer, caplog, reward_funcs=[_tokens], max_completion_length=4,
                            learning_rate=0.03, max_steps=30, save_strategy="no", callbacks=[_SigtermAt(4)])
    assert trainer.state.global_step < 30
    assert trainer.health.summary.stopped == f"interrupted by SIGTERM at step {trainer.state.global_step}"


def test_health_checks_off(tmp_path, tokenizer, caplog):
    trainer, warnings = _train(tmp_path, tokenizer, caplog, reward_funcs=[_tokens], max_completion_length=4,
                               max_steps=3, health_checks=False)
    assert trainer.health.monitor is None and trainer.health.summary is None and warnings == []
    assert trainer._run_card().health == ()


def test_the_demo_gives_no_warning_and_prints_its_summary(tmp_path, capsys, caplog):
    """The README's main job with its own settings, 60 of its 600 steps (its logging every 10 steps); the whole run's
    log is replayed in tests/cli/test_doctor.py. Also measures what the checks cost against the steps they watch."""
    spent = []
    from grpo_trainer.diagnosis.monitor import HealthMonitor

    observe = HealthMonitor.observe

    def timed(self, step, logs):
        started = time.perf_counter()
        try:
            return observe(self, step, logs)
        finally:
            spent.append(time.perf_counter() - started)

    HealthMonitor.observe = timed
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            cli.main(["--demo", "--output_dir", str(tmp_path), "--max_steps", "60", "--log_completions", "false",
                      "--save_strategy", "no", "--disable_tqdm", "true"])
    finally:
        HealthMonitor.observe = observe
    assert not [r for r in caplog.records if r.getMessage().startswith("health:")]
    out = capsys.readouterr().out
    assert "Training health (steps 10-60, 6 log steps checked; finished at step 60): no problem diagnosed." in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_time = sum(r["step_time"] * 10 for r in rows if "step_time" in r)  # the mean over each window of 10 steps
    # the metrics it adds, at the demo's round shape (128 completions of 3 tokens, one reward function): the round
    # signals every step; the importance weights' effective sample size where a run has weights (not the demo)
    rewards, truncated, weights = torch.rand(128, 1), torch.rand(128) < 0.5, torch.rand(128, 3)
    started = time.perf_counter()
    for _ in range(60):
        signals.round_signals(rewards, rewards[:, 0], truncated, ["copy_digits_reward"])
        signals.ess_metrics(signals.weight_totals(weights, torch.ones(128, 3)), "sampling/importance_sampling")
    added = sum(spent) + time.perf_counter() - started
    print(f"health checks: {added * 1e3:.2f} ms over 60 steps of {step_time:.2f} s ({added / step_time:.3%})")
    assert added < 0.01 * step_time and not math.isnan(step_time)
