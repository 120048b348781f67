"""Every reward source of a run as one object: reward functions, reward models (already wrapped as callables),
environment-owned rewards; their names, weights and tokenizers; how they are called and how their scores become
advantages.

Decisions:

1. One reward function contract for every source (TRL's, `scoring.RewardFunc`): keyword arguments in, one value
   (or None) per completion out. Calling them, with the error policy and the time limit, is `scoring`'s.
2. Advantages come from the whole round's rewards `[B_global, F]` (a group may span processes): the configured
   multi-objective aggregation (`algorithms.advantage.MULTI_OBJECTIVE_AGGREGATIONS`) around the advantage estimator.

Shapes: `B` completions (this process), `B_global` completions (every process), `F` reward sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_trainer.algorithms.advantage import MULTI_OBJECTIVE_AGGREGATIONS
from grpo_trainer.rewards.scoring import score_completions

__all__ = ["ADVANTAGE_EPS", "RewardSettings", "RewardSources"]

ADVANTAGE_EPS = 1e-4  # TRL's: keeps a group whose rewards barely differ from being amplified 1e8-fold


@dataclass(frozen=True)
class RewardSettings:
    """The config's reward fields."""

    error_policy: str = "raise"  # `reward_error_policy`
    timeout: float | None = None  # `reward_timeout`, seconds per function per batch
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str = "group"


class RewardSources:
    """The reward sources of a run (decision 1), in order: `funcs[i]` is logged as `names[i]`, weighted by
    `weights[i]`, and `processing_classes[i]` is its tokenizer (None for a reward function), as TRL lists them."""

    def __init__(self, funcs: Sequence[Callable], names: Sequence[str], weights: Sequence[float],
                 processing_classes: Sequence[Any], settings: RewardSettings) -> None:
        if not len(funcs) == len(names) == len(weights) == len(processing_classes):
            raise ValueError(f"{len(funcs)} reward sources but {len(names)} names, {len(weights)} weights and "
                             f"{len(processing_classes)} processing classes; reward_weights needs one weight per "
                             "reward function.")
        self.funcs, self.names = list(funcs), list(names)
        self.weights = torch.tensor(list(weights), dtype=torch.float32)  # [F]
        self.processing_classes = list(processing_classes)
        self.settings = settings

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              **extra: Any) -> Tensor:
        """`[B, F]` float32 scores, NaN where a source returned None (`scoring.score_completions`)."""
        return score_completions(self.funcs, self.names, prompts, completions, completion_ids, columns,
                                 self.settings.error_policy, self.settings.timeout, **extra)

    def advantages(self, estimator: Callable, rewards: Tensor, num_generations: int) -> Tensor:
        """`[B_global]` advantages of the whole round's `rewards` `[B_global, F]` (decision 2)."""
        aggregate = MULTI_OBJECTIVE_AGGREGATIONS[self.settings.multi_objective_aggregation]
        return aggregate(estimator, rewards, num_generations, self.settings.scale_rewards, self.weights,
                         ADVANTAGE_EPS)
