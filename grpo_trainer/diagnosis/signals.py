"""The metrics the health rules need that TRL does not log, computed where the trainer already holds the values (no
extra forward): a reward function's share of missing rewards and the reward gap between finished and cut
completions (per round, `round_signals`), and the effective sample size of importance weights (per corrected
round, `weight_totals` then `ess_metrics`).

Values stay tensors until the logging step, as every other round metric (`reporting.metrics`, decision 5).

Shapes: `B` completions, `T` completion tokens, `F` reward functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["CLIPPED_REWARD_GAP", "ess_metrics", "missing_key", "round_signals", "weight_totals"]

CLIPPED_REWARD_GAP = "completions/clipped_reward_gap"


def missing_key(name: str) -> str:
    """The metric of reward function `name`'s missing rewards (None, or a failure under reward_error_policy='none')."""
    return f"rewards/{name}/missing"


def round_signals(rewards: Tensor, total: Tensor, truncated: Tensor, reward_names: Sequence[str]) -> dict[str, Tensor]:
    """One round's health signals. rewards `[B, F]` (NaN: missing), total `[B]` the combined reward (NaN: no function
    scored the completion), truncated `[B]` (nonzero: cut at max_completion_length without EOS).

    `rewards/<f>/missing`: the share of completions `f` gave no reward. `completions/clipped_reward_gap`: the mean
    combined reward of the finished completions minus that of the cut ones (NaN when either set is empty), > 0 when
    cutting costs reward."""
    out = {missing_key(name): torch.isnan(rewards[:, i]).float().mean() for i, name in enumerate(reward_names)}
    cut = truncated != 0
    out[CLIPPED_REWARD_GAP] = _mean_where(total, ~cut) - _mean_where(total, cut)
    return out


def _mean_where(values: Tensor, where: Tensor) -> Tensor:
    """The mean of the non-NaN `values` where `where` holds; NaN (0 / 0) where there is none. No host sync."""
    kept = where & ~torch.isnan(values)
    return torch.where(kept, values, 0.0).sum() / kept.sum()


def weight_totals(weights: Tensor, mask: Tensor) -> Tensor:
    """`[3]` float32 (MPS has no float64): the sum of the importance weights over the mask's tokens, the sum of their
    squares, and the number of tokens. weights `[B, T]` or `[B, 1]` (one per sequence, counted once per token), mask
    `[B, T]`. Sum them over processes before `ess_metrics`."""
    mask = mask.to(torch.float32)
    w = weights.to(torch.float32).expand_as(mask).nan_to_num() * mask
    return torch.stack([w.sum(), (w * w).sum(), mask.sum()])


def ess_metrics(totals: Tensor, prefix: str) -> dict[str, float]:
    """Kish's effective sample size of the weights, ESS = (sum w)^2 / sum w^2, and ESS / tokens (1: equal weights; 1/N:
    one token carries the whole update), under `prefix` (`sampling/importance_sampling` or `async/importance_ratio`).
    NaN for no tokens or all-zero weights."""
    total, squares, tokens = (float(v) for v in totals.tolist())
    ess = total * total / squares if squares > 0 else float("nan")
    return {f"{prefix}_ess": ess, f"{prefix}_ess_fraction": ess / tokens if tokens > 0 else float("nan")}
