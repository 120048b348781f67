"""Advantage estimators: rewards of a group of completions -> one advantage per completion.

Decisions (see docs/DESIGN.md, "Design decisions"):

1. Groups are contiguous blocks of `num_generations` (G) rewards: `[p0g0 .. p0g(G-1), p1g0 ..]`. Rewards are
   reshaped once to `(P, G)`; estimators work on that matrix.
2. Standard deviations are *sample* std (Bessel), as twinkle's and TRL's code compute them; `eps` is added to
   the std. The standalone classes default to twinkle's `eps=1e-8`; the trainer passes TRL's `1e-4`.
3. A reward that is `None` or NaN means "not applicable": it is left out of the group's mean and std, and its
   advantage is 0. A group whose rewards are all equal gets advantage 0, never NaN.
4. A single-sample group (G = 1) has no group baseline: `'group'` returns the raw rewards, `'none'` and
   `'batch'` use the batch mean as the baseline (twinkle's behaviour).
5. Every estimator has the same call signature, so the trainer, a registry name and a user callable are
   interchangeable: `fn(rewards, num_generations=G, scale=..., **kwargs) -> Tensor[B]`.
6. Several reward functions are combined before the estimator (`sum_then_normalize`, the default) or after it
   (`normalize_then_sum`, GDPO): `MULTI_OBJECTIVE_AGGREGATIONS`, each `fn(estimator, rewards [B, F], G, scale,
   reward_weights, eps)`, works with any estimator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

Scale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = ("group", "batch", "none")
RewardsLike = Tensor | Sequence[float | None] | Sequence[Sequence[float | None]]
AdvantageFn = Callable[..., Tensor]

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "Advantage",
    "DrGRPOAdvantage",
    "GRPOAdvantage",
    "RLOOAdvantage",
    "ReinforcePlusPlusBaselineAdvantage",
    "as_reward_vector",
    "get_advantage_estimator",
    "group_std",
    "nanstd",
    "normalize_then_sum",
    "register_advantage",
    "sum_then_normalize",
]


def as_reward_vector(rewards: RewardsLike, reward_weights: Sequence[float] | Tensor | None = None) -> Tensor:
    """Turn rewards into a float `[B]` tensor; `None` becomes NaN.

    An `[B, F]` matrix (one column per reward function) is combined as the weighted sum over the functions
    that scored that sample (NaN columns skipped, as TRL's `nansum`); a row where every function is NaN stays NaN.
    """
    values = _as_float(rewards)
    if values.dim() == 2:
        all_missing = torch.isnan(values).all(dim=1)
        values = torch.nansum(values * _weights(reward_weights, values), dim=1).masked_fill(all_missing, math.nan)
    elif values.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B] or 2-D [B, F]; got shape {tuple(values.shape)}.")
    elif reward_weights is not None:
        raise ValueError("reward_weights only applies to a 2-D [B, F] rewards matrix; got 1-D rewards.")
    return _finite(values)


def _as_float(rewards: RewardsLike) -> Tensor:
    """The rewards as a float tensor, `None` as NaN."""
    if isinstance(rewards, Tensor):
        return rewards.detach() if rewards.is_floating_point() else rewards.detach().to(torch.float32)
    return torch.tensor(_nones_to_nan(rewards), dtype=torch.float32)


def _nones_to_nan(rewards: Sequence) -> list:
    return [_nones_to_nan(r) if isinstance(r, (list, tuple)) else (math.nan if r is None else float(r))
            for r in rewards]


def _finite(values: Tensor) -> Tensor:
    if torch.isinf(values).any():
        raise ValueError("rewards contain +/-inf; rewards must be finite numbers, or None/NaN for 'not applicable'.")
    return values


def _weights(reward_weights: Sequence[float] | Tensor | None, values: Tensor) -> Tensor:
    """`[F]` weights of the columns of `values` `[B, F]` (all 1 when None), checked to be one per column."""
    weights = torch.ones(values.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights)
    if weights.numel() != values.shape[1]:
        raise ValueError(f"reward_weights has {weights.numel()} entries but rewards have {values.shape[1]} columns "
                         "(one per reward function); pass one weight per reward function.")
    return weights.to(values)


def _check(values: Tensor, num_generations: int, scale: str, min_generations: int) -> None:
    if not isinstance(num_generations, int) or num_generations < min_generations:
        raise ValueError(f"num_generations must be an integer >= {min_generations}; got {num_generations!r}.")
    if values.numel() % num_generations:
        raise ValueError(
            f"the number of rewards ({values.numel()}) must be a multiple of num_generations ({num_generations}): "
            "rewards come in contiguous groups of num_generations completions per prompt."
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}; got {scale!r}.")


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Sample (Bessel) std ignoring NaN, over all of `x` or along `dim` (kept); NaN where fewer than 2 values are
    present, as TRL's `nanstd`."""
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim=dim, keepdim=True)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(valid, (x - mean) ** 2, 0.0)
    total = sq.sum() if dim is None else sq.sum(dim=dim, keepdim=True)
    # count 1 -> 0/0 = NaN; count 0 would give sqrt(0/-1) = -0, so it is set to NaN explicitly
    return torch.where(count > 0, torch.sqrt(total / (count - 1)), math.nan)


def group_std(rewards: Tensor, num_generations: int) -> Tensor:
    """Sample std of each group's rewards. rewards `[B]` -> `[P]` (NaN where a group has < 2 valid rewards)."""
    return nanstd(rewards.view(-1, num_generations), dim=1).squeeze(1)


class Advantage:
    """Base class: validates and reshapes the rewards, then calls `compute` on the `(P, G)` matrix.

    Subclasses implement `compute(grouped, scale) -> (P, G)`; NaN outputs (missing rewards) become 0.
    """

    min_generations = 1

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps

    def __call__(
        self,
        rewards: RewardsLike,
        num_generations: int = 1,
        scale: Scale = "group",
        reward_weights: Sequence[float] | Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        """Return the advantage of each completion, `[B]`, in the rewards' order.

        Args:
            rewards: `[B]` list/tensor, or `[B, F]` per-reward-function matrix (weighted sum over F).
            num_generations: G, the size of each contiguous group.
            scale: `'group'` divides by the group's std, `'batch'` by the std of all rewards, `'none'` by nothing.
            reward_weights: `[F]` weights for a 2-D rewards matrix.
        """
        values = as_reward_vector(rewards, reward_weights)
        _check(values, num_generations, scale, self.min_generations)
        advantages = self.compute(values.view(-1, num_generations), scale).reshape(-1)
        return torch.nan_to_num(advantages, nan=0.0)

    def compute(self, grouped: Tensor, scale: str) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def _scale(self, centred: Tensor, grouped: Tensor, scale: str) -> Tensor:
        """Divide `(P, G)` centred advantages by the std that `scale` names (std of the *raw* rewards)."""
        if scale == "none":
            return centred
        std = nanstd(grouped, dim=1) if scale == "group" else nanstd(grouped)
        # All-equal group: 0 / (0 + eps) = 0. A lone valid reward has NaN std; its centred value is 0 anyway.
        return centred / (torch.nan_to_num(std, nan=0.0) + self.eps)


class GRPOAdvantage(Advantage):
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_group) / (std + eps)."""

    def compute(self, grouped: Tensor, scale: str) -> Tensor:
        if grouped.shape[1] == 1:  # no group baseline; see decision 4
            flat = grouped.reshape(-1)
            if scale == "group":
                return grouped
            centred = flat - torch.nanmean(flat)
            if scale == "none":
                return centred.view_as(grouped)
            std = nanstd(flat) if flat.numel() > 1 else torch.tensor(1.0)
            return (centred / (torch.nan_to_num(std, nan=1.0) + self.eps)).view_as(grouped)
        return self._scale(grouped - torch.nanmean(grouped, dim=1, keepdim=True), grouped, scale)


class RLOOAdvantage(Advantage):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j, scaled by the same std as GRPO.

    With n valid rewards in a group this equals n/(n-1) * (r_i - mean_group); a group with fewer than 2 valid
    rewards has no leave-one-out baseline and gets advantage 0.
    """

    min_generations = 2

    def compute(self, grouped: Tensor, scale: str) -> Tensor:
        valid = ~torch.isnan(grouped)
        n = valid.sum(dim=1, keepdim=True).to(grouped.dtype)
        total = torch.nansum(grouped, dim=1, keepdim=True)
        baseline = (total - grouped) / (n - 1)  # n == 1 -> x/0: inf or NaN, zeroed below
        centred = torch.where(n > 1, grouped - baseline, 0.0)
        return self._scale(centred, grouped, scale)


class DrGRPOAdvantage(GRPOAdvantage):
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): centre on the group mean, never divide by a std.

    Dividing by the group std up-weights prompts that are almost always solved or failed (a difficulty bias),
    so `scale` is ignored.
    """

    def compute(self, grouped: Tensor, scale: str) -> Tensor:
        return super().compute(grouped, "none")


class ReinforcePlusPlusBaselineAdvantage(Advantage):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): subtract the group mean, divide by the std of the
    centred values over the whole batch. `scale` is ignored: the batch std *is* this estimator's scale."""

    def compute(self, grouped: Tensor, scale: str) -> Tensor:
        centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
        return centred / (torch.nan_to_num(nanstd(centred), nan=0.0) + self.eps)


ADVANTAGE_ESTIMATORS: dict[str, type[Advantage] | AdvantageFn] = {
    "grpo": GRPOAdvantage,
    "rloo": RLOOAdvantage,
    "dr_grpo": DrGRPOAdvantage,
    "reinforce_pp_baseline": ReinforcePlusPlusBaselineAdvantage,
}


def register_advantage(name: str) -> Callable[[type[Advantage] | AdvantageFn], type[Advantage] | AdvantageFn]:
    """Decorator: make an `Advantage` subclass or a same-signature function selectable by `name`."""

    def add(estimator: type[Advantage] | AdvantageFn) -> type[Advantage] | AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not estimator:
            raise ValueError(f"an advantage estimator is already registered as {name!r}; choose another name.")
        ADVANTAGE_ESTIMATORS[name] = estimator
        return estimator

    return add


def get_advantage_estimator(estimator: str | Advantage | AdvantageFn, eps: float = 1e-8) -> AdvantageFn:
    """Resolve a registry name, an `Advantage` instance/class or a callable into a callable estimator."""
    if isinstance(estimator, str):
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"unknown advantage_estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)} "
                "or register your own with grpo_trainer.advantage.register_advantage."
            )
        estimator = ADVANTAGE_ESTIMATORS[estimator]
    if isinstance(estimator, type) and issubclass(estimator, Advantage):
        return estimator(eps=eps)
    if not callable(estimator):
        raise ValueError(
            f"advantage_estimator must be a name, an Advantage or a callable; got {type(estimator).__name__}."
        )
    return estimator


def sum_then_normalize(estimator: AdvantageFn, rewards: RewardsLike, num_generations: int, scale: Scale = "group",
                       reward_weights: Sequence[float] | Tensor | None = None, eps: float = 1e-4) -> Tensor:
    """The default: the weighted sum of the reward functions per completion (missing ones skipped), then the
    estimator on that single reward. Args: rewards `[B, F]` or `[B]`. Returns `[B]`."""
    return estimator(rewards, num_generations=num_generations, scale=scale, reward_weights=reward_weights)


def normalize_then_sum(estimator: AdvantageFn, rewards: RewardsLike, num_generations: int, scale: Scale = "group",
                       reward_weights: Sequence[float] | Tensor | None = None, eps: float = 1e-4) -> Tensor:
    """GDPO (arXiv:2601.05242): each reward function's rewards go through the estimator on their own, the weighted
    sum of these per-function advantages is taken, and that sum is standardised over the batch: (x - mean) /
    (std + eps), missing values left out. Summing raw rewards lets the function with the widest spread decide
    the ranking; normalising each first gives every function its own say, weighted by `reward_weights`.

    The per-function step is the group normalisation GDPO prescribes, so the estimator is called with
    `scale="group"` and `scale` is not used (as in TRL). With `grpo` this is GDPO exactly: each reward z-scored in
    its group, TRL's `normalize_then_sum` to the last digit. With another estimator each reward gets that
    estimator's advantage instead: `rloo` its leave-one-out baseline (scaled by the group std), `dr_grpo` its group
    centring without any std (so functions on a wider scale weigh more before the batch standardisation),
    `reinforce_pp_baseline` its group centring over the batch std of that function.

    A completion no function scored gets advantage 0 and is left out of the batch mean and std; a reward missing
    for one function adds nothing to that completion's sum.

    Args: rewards `[B, F]` (a `[B]` vector is one function), reward_weights `[F]`. Returns `[B]`.
    """
    values = _as_matrix(rewards)  # [B, F]
    weights = _weights(reward_weights, values)  # [F]
    per_function = torch.stack([torch.nan_to_num(estimator(values[:, k], num_generations=num_generations,
                                                           scale="group"), nan=0.0).to(values)
                                for k in range(values.shape[1])], dim=1)  # [B, F]
    combined = (per_function * weights).sum(dim=1)  # [B]
    combined = combined.masked_fill(torch.isnan(values).all(dim=1), math.nan)  # unscored: out of the batch stats
    std = torch.nan_to_num(nanstd(combined), nan=0.0)
    return torch.nan_to_num((combined - torch.nanmean(combined)) / (std + eps), nan=0.0)


def _as_matrix(rewards: RewardsLike) -> Tensor:
    """`[B, F]` float rewards (a `[B]` vector as one column), `None` as NaN; +-inf refused as in
    `as_reward_vector`."""
    values = _as_float(rewards)
    values = values.unsqueeze(1) if values.dim() == 1 else values
    if values.dim() != 2:
        raise ValueError(f"rewards must be 1-D [B] or 2-D [B, F]; got shape {tuple(values.shape)}.")
    return _finite(values)


MultiObjectiveAggregation = Callable[..., Tensor]

MULTI_OBJECTIVE_AGGREGATIONS: dict[str, MultiObjectiveAggregation] = {
    "sum_then_normalize": sum_then_normalize,
    "normalize_then_sum": normalize_then_sum,
}
