"""The zero-variance predicate: exactly the groups whose advantages are 0 under every built-in estimator."""

import math

import pytest
import torch

from grpo_trainer.algorithms.advantage import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    get_advantage_estimator,
)
from grpo_trainer.algorithms.zero_variance import equal_within_groups, zero_variance_groups

NAN = math.nan


def test_equal_within_groups_ignores_unscored_rewards():
    values = torch.tensor([1.0, 1.0, 1.0,  # all equal
                           0.0, 1.0, 0.0,  # spread
                           0.5, NAN, 0.5,  # equal where scored
                           NAN, NAN, 2.0,  # one scored reward: no baseline, advantage 0
                           NAN, NAN, NAN,  # nothing scored
                           0.1, 0.1, 0.1 + 1e-7])  # differ in the 7th digit: the estimator ranks them
    assert equal_within_groups(values, 3).tolist() == [True, False, True, True, True, False]


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_zero_variance_groups_are_the_groups_every_estimator_gives_advantage_zero(estimator):
    rewards = torch.tensor([[1.0], [1.0], [1.0], [1.0],
                            [0.0], [1.0], [0.0], [0.0],
                            [0.3], [NAN], [0.3], [0.3],
                            [2.0], [2.0], [2.0], [-1.0]])  # [B=16, F=1], G = 4
    zero = zero_variance_groups(rewards, 4, torch.ones(1))
    assert zero.tolist() == [True, False, True, False]
    advantages = MULTI_OBJECTIVE_AGGREGATIONS["sum_then_normalize"](
        get_advantage_estimator(estimator, 1e-4), rewards, 4, "group", torch.ones(1)).view(4, 4)
    assert (advantages[zero] == 0).all()
    assert (advantages[~zero] != 0).any(dim=1).all()


def test_sum_then_normalize_compares_weighted_sums_normalize_then_sum_each_function():
    # Two functions that trade off exactly: 1 + 0 = 0 + 1, so the weighted sum (weights 1, 1) is equal within the
    # group and sum_then_normalize's advantages are 0; normalize_then_sum ranks each function on its own.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # [B=4, F=2], G = 4
    weights = torch.ones(2)
    assert zero_variance_groups(rewards, 4, weights, "sum_then_normalize").tolist() == [True]
    assert zero_variance_groups(rewards, 4, weights, "normalize_then_sum").tolist() == [False]
    # weights 2 and 1: sums 2, 1, 2, 1 differ
    assert zero_variance_groups(rewards, 4, torch.tensor([2.0, 1.0]), "sum_then_normalize").tolist() == [False]


def test_zero_variance_groups_refuses_rewards_that_do_not_form_groups():
    with pytest.raises(ValueError, match="do not form groups of num_generations"):
        zero_variance_groups(torch.zeros(5, 1), 2, torch.ones(1))
    with pytest.raises(ValueError, match="unknown multi_objective_aggregation"):
        zero_variance_groups(torch.zeros(4, 1), 2, torch.ones(1), "mean")
