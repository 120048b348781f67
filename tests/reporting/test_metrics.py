"""Round metrics and window means with TRL 1.16's semantics, on inputs small enough to check by hand."""

import math

import pytest
import torch

from grpo_trainer.reporting.metrics import (
    completion_length_metrics,
    pass_at_k,
    reward_metrics,
    window_means,
    window_totals,
    zero_std_fraction,
)

NAN = math.nan


def floats(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def test_completion_lengths_and_terminated_lengths():
    out = floats(completion_length_metrics(torch.tensor([3, 5, 2, 4]), torch.tensor([0, 1, 0, 0])))
    # all: mean (3+5+2+4)/4 = 3.5, min 2, max 5; 1 of 4 truncated; terminated {3, 2, 4}: mean 3, min 2, max 4
    assert out == {"completions/mean_length": 3.5, "completions/min_length": 2.0, "completions/max_length": 5.0,
                   "completions/clipped_ratio": 0.25, "completions/mean_terminated_length": 3.0,
                   "completions/min_terminated_length": 2.0, "completions/max_terminated_length": 4.0}


def test_terminated_lengths_are_zero_when_every_completion_was_truncated():
    out = floats(completion_length_metrics(torch.tensor([4, 4]), torch.tensor([True, True])))
    assert out["completions/clipped_ratio"] == 1.0
    assert [out[f"completions/{s}_terminated_length"] for s in ("mean", "min", "max")] == [0.0, 0.0, 0.0]


def test_reward_metrics_by_hand():
    # Two groups of G=2, two functions weighted (1, 2); the second function abstains (None) on row 3.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, NAN]])
    out = floats(reward_metrics(rewards, torch.tensor([1.0, 2.0]), ["a", "b"], 2, "group"))
    # weighted nansum per row: 1, 2, 3, 1 -> reward = 7/4
    assert out["reward"] == pytest.approx(1.75, abs=1e-7)
    # reward_std over the round (not per group): deviations -0.75, 0.25, 1.25, -0.75; squares sum to 2.75;
    # sample variance 2.75/3 -> std sqrt(11/12)
    assert out["reward_std"] == pytest.approx(math.sqrt(11 / 12), abs=1e-6)
    # groups (1, 2) and (3, 1) both vary
    assert out["frac_reward_zero_std"] == 0.0
    # a: 1, 0, 1, 1 -> mean 0.75; deviations .25, -.75, .25, .25 -> squares .75 / 3 -> std 0.5
    assert out["rewards/a/mean"] == pytest.approx(0.75) and out["rewards/a/std"] == pytest.approx(0.5, abs=1e-7)
    # b leaves out its None: 0, 1, 1 -> mean 2/3; squares 4/9 + 1/9 + 1/9 = 6/9 over 2 -> std sqrt(1/3)
    assert out["rewards/b/mean"] == pytest.approx(2 / 3) and out["rewards/b/std"] == pytest.approx(
        math.sqrt(1 / 3), abs=1e-6)


def test_reward_leaves_out_completions_no_function_scored():
    # issue 20: one function, None on 2 of 4 completions. The advantage step leaves them out of the baselines, so the
    # logged reward must too: mean(1, 1) = 1, not (1 + 0 + 1 + 0) / 4 = 0.5.
    out = floats(reward_metrics(torch.tensor([[1.0], [NAN], [1.0], [NAN]]), torch.tensor([1.0]), ["f"], 2, "group"))
    assert out["reward"] == 1.0 and out["reward_std"] == 0.0 and out["rewards/f/mean"] == 1.0
    # each group holds one scored completion: its std is NaN (undefined), which is not "zero std"
    assert out["frac_reward_zero_std"] == 0.0


def test_a_row_is_left_out_only_when_every_function_abstained():
    # weights (1, 2): rows 1 + 0 (None) = 1, all None, 1 + 2*0.5 = 2, all None -> reward mean(1, 2) = 1.5;
    # std: deviations -0.5, 0.5 -> 0.5 / 1 -> sqrt(0.5). f2 has one value: its std is NaN.
    rewards = torch.tensor([[1.0, NAN], [NAN, NAN], [1.0, 0.5], [NAN, NAN]])
    out = floats(reward_metrics(rewards, torch.tensor([1.0, 2.0]), ["f1", "f2"], 2, "group"))
    assert out["reward"] == 1.5 and out["reward_std"] == pytest.approx(math.sqrt(0.5), abs=1e-7)
    assert out["rewards/f2/mean"] == 0.5 and math.isnan(out["rewards/f2/std"])


def test_no_reward_at_all_is_nan():
    out = floats(reward_metrics(torch.full((2, 1), NAN), torch.tensor([1.0]), ["f"], 2, "group"))
    assert math.isnan(out["reward"]) and math.isnan(out["reward_std"]) and math.isnan(out["rewards/f/mean"])


def test_reward_metrics_add_pass_at_k_for_binary_rewards_when_asked():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    assert "pass@1" not in reward_metrics(rewards, torch.tensor([1.0]), ["f"], 2, "group")
    out = reward_metrics(rewards, torch.tensor([1.0]), ["f"], 2, "group", with_pass_at_k=True)
    # groups c = 1 and c = 0 of n = 2: pass@1 = (1/2 + 0) / 2, pass@2 = (1 + 0) / 2
    assert (out["pass@1"], out["pass@2"]) == pytest.approx((0.25, 0.5))


@pytest.mark.parametrize(("total", "G", "scale", "expected"), [
    ([1.0, 1.0, 2.0, 3.0, 5.0, 5.0], 2, "group", 2 / 3),  # groups (1,1) and (5,5) have std 0, (2,3) does not
    ([1.0, 1.0, 2.0, 3.0, 5.0, 5.0], 2, "none", 2 / 3),  # 'none' scales nothing but reports the group stds
    ([1.0, 1.0, 2.0, 3.0, 5.0, 5.0], 2, "batch", 0.0),  # one std over the round: not 0
    ([2.0, 2.0, 2.0, 2.0], 2, "batch", 1.0),
    ([1.0, NAN, 2.0, 2.0], 2, "group", 0.5),  # (1, None): std NaN, not zero; (2, 2): zero
    ([1.0, 2.0, 3.0], 1, "group", 1.0),  # a group of one has std 0 by convention
])
def test_zero_std_fraction(total, G, scale, expected):
    assert zero_std_fraction(torch.tensor(total), G, scale).item() == pytest.approx(expected)


def test_window_mean_skips_nan_and_logs_none_when_nothing_is_left():
    window = {"b": [NAN, NAN], "a": [1.0, NAN, torch.tensor(3.0)], "c": [torch.tensor(2.0)]}
    keys, totals = window_totals(window)
    assert keys == ["a", "b", "c"]
    assert totals.tolist() == [[4.0, 2.0], [0.0, 0.0], [2.0, 1.0]]  # (sum, count) of the non-NaN values
    assert window_means(keys, totals) == {"a": 2.0, "b": None, "c": 2.0}


def test_window_means_pool_the_processes_values():
    # process 0 logged a = 1, 3 and process 1 a = 5: summing (sum, count) gives (9, 3) -> 3, the mean of all values
    keys, p0 = window_totals({"a": [1.0, 3.0]})
    _, p1 = window_totals({"a": [5.0]})
    assert window_means(keys, p0 + p1) == {"a": 3.0}


def test_an_empty_window_has_no_keys():
    keys, totals = window_totals({})
    assert keys == [] and totals.shape == (0, 2) and window_means(keys, totals) == {}


def test_pass_at_k_by_hand():
    # one group, n = 4, c = 1 correct: pass@k = 1 - C(n-c, k) / C(n, k)
    #   pass@1 = 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25
    #   pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    #   pass@4 = 1 - C(3,4)/C(4,4) = 1 - 0/1 = 1
    assert pass_at_k(torch.tensor([0.0, 1.0, 0.0, 0.0]), 4) == pytest.approx(
        {"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0}, abs=1e-12)
    # two groups (c = 1 and c = 0) are averaged: pass@1 = (0.25 + 0) / 2, pass@2 = 0.25, pass@4 = 0.5
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert pass_at_k(rewards, 4) == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5}, abs=1e-12)


def test_pass_at_k_ks_include_g():
    # G = 6: k = 1, 2, 4 and 6; c = 2: pass@4 = 1 - C(4,4)/C(6,4) = 1 - 1/15, pass@6 = 1 - C(4,6)/1 = 1
    out = pass_at_k(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 6)
    assert out == pytest.approx({"pass@1": 2 / 6, "pass@2": 1 - 6 / 15, "pass@4": 1 - 1 / 15, "pass@6": 1.0})


def test_pass_at_k_non_binary_rewards():
    assert pass_at_k(torch.tensor([0.0, 0.5, 1.0, 0.0]), 4) == {}
    assert pass_at_k(torch.tensor([0.0, math.nan, 1.0, 0.0]), 4) == {}
