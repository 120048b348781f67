"""The health checks' math and state machine on values worked out by hand (`diagnosis.signals`, `diagnosis.monitor`,
`diagnosis.settings`); the real runs that produce each condition are in tests/trainer/test_health.py."""

import math

import pytest
import torch

from grpo_trainer.diagnosis.monitor import HealthMonitor
from grpo_trainer.diagnosis.rules import RULES, TITLES
from grpo_trainer.diagnosis.settings import HealthSettings, RunFacts, threshold_problems
from grpo_trainer.diagnosis.signals import ess_metrics, round_signals, weight_totals


def test_effective_sample_size_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # equal weights: ESS = N = 5 (the masked token's weight 9 is left out)
    equal = weight_totals(torch.tensor([[2.0, 2.0, 9.0], [2.0, 2.0, 2.0]]), mask)
    assert ess_metrics(equal, "p") == {"p_ess": pytest.approx(5.0), "p_ess_fraction": pytest.approx(1.0)}
    # one token carries everything: (4)^2 / 16 = 1 of 5 tokens
    one = weight_totals(torch.tensor([[4.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), mask)
    assert ess_metrics(one, "p") == {"p_ess": pytest.approx(1.0), "p_ess_fraction": pytest.approx(0.2)}
    # one weight per sequence [B, 1], counted once per token: sums 2*1 + 3*3 = 11, squares 2*1 + 3*9 = 29
    per_sequence = weight_totals(torch.tensor([[1.0], [3.0]]), mask)
    assert ess_metrics(per_sequence, "p")["p_ess"] == pytest.approx(121 / 29)
    # summed over two processes before the ratio
    assert ess_metrics(equal + one, "p")["p_ess"] == pytest.approx((10 + 4) ** 2 / (20 + 16))
    assert math.isnan(ess_metrics(torch.zeros(3), "p")["p_ess_fraction"])


def test_round_signals_by_hand():
    rewards = torch.tensor([[1.0, math.nan], [0.0, math.nan], [1.0, 1.0], [0.5, 0.0]])  # [B=4, F=2]
    total = torch.tensor([1.0, 0.0, 2.0, 0.5])  # the weighted sums over the functions that scored (weights 1)
    out = round_signals(rewards, total, torch.tensor([0, 1, 1, 0]), ["a", "b"])
    assert float(out["rewards/a/missing"]) == 0.0 and float(out["rewards/b/missing"]) == 0.5
    # finished rows 0 and 3 score (1 + 0.5) / 2 = 0.75; cut rows 1 and 2 score (0 + 2) / 2 = 1: the gap is -0.25
    assert float(out["completions/clipped_reward_gap"]) == pytest.approx(-0.25)
    all_cut = round_signals(rewards, total, torch.ones(4), ["a", "b"])
    assert math.isnan(float(all_cut["completions/clipped_reward_gap"]))


def _rows(key, values, **other):
    return [{key: v, "loss": 0.0, **other} for v in values]


def test_one_warning_per_onset_and_one_note_when_it_clears():
    """patience 2, recovery 3, hysteresis 0.8: the clip threshold 0.2 clears below 0.16; 0.18 holds."""
    monitor = HealthMonitor(HealthSettings(patience=2, recovery=3), RunFacts())
    values = [0.3, 0.1, 0.3, 0.3, 0.3, 0.18, 0.3, 0.19, 0.3, 0.18, 0.1, 0.1, 0.1, 0.1]
    notes = {}
    for step, row in enumerate(_rows("clip_ratio/region_mean", values), 1):
        for note in monitor.observe(step, row):
            notes[step] = note
    # step 1 alone is not sustained; steps 3-4 are; 0.18/0.19 sit in the band (no clearing, no new warning);
    # three log steps below 0.16 (11, 12, 13) clear it
    assert sorted(notes) == [4, 13]
    assert notes[4].onset and "clip_ratio/region_mean = 0.3 >= 0.2" in notes[4].text and "Fix: lower learning_rate" \
        in notes[4].text
    assert not notes[13].onset and "cleared at step 13" in notes[13].text
    (episode,) = monitor.summary().episodes
    assert (episode.start_step, episode.end_step, episode.worst) == (4, 13, 0.3)


def test_events_are_diagnosed_at_once():
    monitor = HealthMonitor(HealthSettings(recovery=2), RunFacts(max_grad_norm=1.0))
    norms = [0.5, 0.6, 0.4, 0.5, 0.5, 60.0, 0.5, 0.5, 0.5]
    onsets = [step for step, row in enumerate(_rows("grad_norm", norms), 1) for n in monitor.observe(step, row)
              if n.onset]
    # 60 >= 10 x max(median 0.5, max_grad_norm 1.0) = 10 at step 6; cleared after two normal log steps
    assert onsets == [6]
    assert [(e.start_step, e.end_step) for e in monitor.episodes] == [(6, 8)]
    # a spike the clip holds (5 < 10 x max_grad_norm) is not one
    quiet = HealthMonitor(HealthSettings(), RunFacts(max_grad_norm=1.0))
    for step, row in enumerate(_rows("grad_norm", [0.01] * 5 + [5.0]), 1):
        quiet.observe(step, row)
    assert quiet.episodes == []


def test_summary_lines_and_record():
    monitor = HealthMonitor(HealthSettings(patience=1), RunFacts(num_generations=8))
    for step, row in enumerate(_rows("frac_reward_zero_std", [0.9, 0.9]), 1):
        monitor.observe(step, row)
    summary = monitor.summary("finished at step 2")
    lines = summary.lines()
    assert lines[0] == "Training health (steps 1-2, 2 log steps checked; finished at step 2): 1 diagnosis."
    assert lines[1].startswith("- zero_variance: groups with equal rewards (no gradient); from step 1, not cleared; "
                               "worst frac_reward_zero_std = 0.9 (threshold 0.75). Fix: raise num_generations=8")
    record = summary.record()
    assert record["diagnoses"][0]["cleared"] is False and record["facts"]["num_generations"] == 8
    assert HealthMonitor().summary().lines() == [
        "Training health (0 log steps checked; finished): no problem diagnosed."]


def test_a_reward_weight_that_drowns_a_function():
    """weights (10, 1), stds (0.5, 0.5): shares 10 x 0.5 / (5 + 0.5) = 91%; equal weights never count."""
    row = {"loss": 0.0, "rewards/a/std": 0.5, "rewards/b/std": 0.5, "rewards/a/mean": 0.0, "rewards/b/mean": 0.0}
    facts = RunFacts(reward_names=("a", "b"), reward_weights=(10.0, 1.0))
    (reading,) = RULES["reward_dominance"](row, (), HealthSettings(), facts)
    assert reading.state == "on" and reading.finding.subject == "a"
    assert reading.finding.value == pytest.approx(5 / 5.5)
    assert "a: 2, b: 2" in reading.finding.fix  # 1 / std each
    assert RULES["reward_dominance"](row, (), HealthSettings(), RunFacts(reward_names=("a", "b"))) == []


def test_every_rule_has_a_title_and_the_settings_are_checked():
    assert set(RULES) == set(TITLES)
    assert threshold_problems(None) == [] and threshold_problems({"patience": 3, "ess_fraction": 0.3}) == []
    assert "unknown threshold 'patiense'" in threshold_problems({"patiense": 3})[0]
    assert "whole number >= 1" in threshold_problems({"recovery": 0.5})[0]
    assert "in (0, 1]" in threshold_problems({"truncated_fraction": 1.5})[0]
    assert "finite number" in threshold_problems({"entropy_floor": "low"})[0]
    assert "must be a dict" in threshold_problems([1])[0]
    assert HealthSettings.of({"patience": 4}).patience == 4
