"""Which groups carry no policy-gradient signal: pure tensor functions.

A group whose G rewards are all equal gets advantage 0 on every completion under every built-in estimator (GRPO,
RLOO, Dr. GRPO, REINFORCE++-baseline: each subtracts a group baseline equal to that reward), so its tokens cost a
forward and backward and teach nothing. `zero_variance_groups` is that predicate, the one DAPO's dynamic sampling
filters with (arXiv:2503.14476, eq. 11: 0 < |{correct}| < G, i.e. rewards not all equal).

Decisions:

1. Equal means exactly equal (max == min over the group), not a std below a tolerance: a group the estimator gives
   a non-zero advantage, however small, is informative.
2. A missing reward (NaN: no reward function scored that completion) is left out, as the estimators leave it out of
   their baselines: a group whose scored rewards are all equal, or that has fewer than two scored rewards, is
   zero-variance.
3. What "the reward" is follows the multi-objective aggregation (`ZERO_VARIANCE`, the same keys as
   `advantage.MULTI_OBJECTIVE_AGGREGATIONS`): `sum_then_normalize` compares the weighted sums (two functions that
   trade off exactly leave the sum, and so the advantage, equal); `normalize_then_sum` compares every function on
   its own, since each is normalised within the group before the sum. (Its final batch standardisation then gives
   such a group one shared, possibly non-zero, advantage: a shift of the whole group, not a ranking inside it.)

Shapes: `B` completions in contiguous groups of `G`, `P = B / G` groups, `F` reward functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_trainer.algorithms.advantage import as_reward_vector

__all__ = ["ZERO_VARIANCE", "equal_within_groups", "zero_variance_groups"]


def equal_within_groups(values: Tensor, num_generations: int) -> Tensor:
    """`[P]` True where the scored values of a group `[B]` (NaN: unscored) are all equal, or fewer than two
    (decisions 1-2)."""
    grouped = values.reshape(-1, num_generations)  # [P, G]
    scored = ~torch.isnan(grouped)
    high = torch.where(scored, grouped, -torch.inf).amax(dim=1)
    low = torch.where(scored, grouped, torch.inf).amin(dim=1)
    return (high == low) | (scored.sum(dim=1) < 2)


def _equal_sums(rewards: Tensor, num_generations: int, weights: Tensor) -> Tensor:
    return equal_within_groups(as_reward_vector(rewards, weights), num_generations)


def _each_function_equal(rewards: Tensor, num_generations: int, weights: Tensor) -> Tensor:
    columns = rewards if rewards.dim() == 2 else rewards[:, None]  # [B, F]
    per_function = [equal_within_groups(columns[:, k].float(), num_generations) for k in range(columns.shape[1])]
    return torch.stack(per_function, dim=1).all(dim=1)


# multi_objective_aggregation -> fn(rewards [B, F], G, weights [F]) -> [P] bool (decision 3)
ZERO_VARIANCE: dict[str, Callable[[Tensor, int, Tensor], Tensor]] = {
    "sum_then_normalize": _equal_sums,
    "normalize_then_sum": _each_function_equal,
}


def zero_variance_groups(rewards: Tensor, num_generations: int, weights: Tensor,
                         aggregation: str = "sum_then_normalize") -> Tensor:
    """`[P]` True for the groups of `rewards` `[B, F]` (NaN: None) that no reward function's ranking distinguishes,
    so their advantages carry no signal (module docstring)."""
    if aggregation not in ZERO_VARIANCE:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}; choose one of {sorted(ZERO_VARIANCE)}.")
    if rewards.shape[0] % num_generations:
        raise ValueError(f"{rewards.shape[0]} rewards do not form groups of num_generations ({num_generations}).")
    return ZERO_VARIANCE[aggregation](rewards.detach().float(), num_generations, weights)
