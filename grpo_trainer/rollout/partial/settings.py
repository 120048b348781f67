"""Partial rollouts' options (`GRPOConfig.partial_rollouts`, `partial_rollout_max_parks`,
`partial_rollout_stale_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PartialSettings"]


@dataclass(frozen=True)
class PartialSettings:
    # A round starts the groups of (1 + alpha) x the prompts it trains: its own prompts, the parked groups, and extra
    # prompts from a seeded stream of the training set where fewer than alpha x its prompts are parked.
    alpha: float
    # A group parked this many times is required to complete before its next round may end (APRIL's
    # `partial_rollout_max_aborted_count`): no group waits forever.
    max_parks: int = 2
    # Tokens an earlier policy sampled: "weight" (per-token importance weights against their recorded log-probs,
    # truncated to the engine correction's bounds) or "mask" (kept in the context, out of the loss; APRIL's
    # `mask_offpolicy_in_partial_rollout`).
    stale_tokens: Literal["weight", "mask"] = "weight"
