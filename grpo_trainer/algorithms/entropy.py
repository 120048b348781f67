"""The entropy bonus and its coefficient: loss -= c * mean per-token entropy, with c constant or adapted after
every optimizer step (Skywork-OR1's adaptive entropy control, arXiv:2505.22312, section 4).

Decisions:

1. The bonus is the mean entropy per token over the tokens the policy term trains on (the completion mask times
   the high-entropy mask), whatever the loss type: `entropy_coef` means the same for every aggregation, and only
   gradient accumulation scales it (as TRL).
2. Adaptive control, as TRL: the coefficient a window uses is the one fixed at the previous optimizer step, and it
   applies only if that step's entropy was at or below the target; after each optimizer step the window's entropy
   (token-weighted over every micro-batch and process) moves it by one step towards keeping the entropy at the
   target, within [min, max]. The first window has no measurement, so no bonus.
3. `EntropyControl` holds plain floats: the trainer measures, reduces across processes and saves the state with
   each checkpoint (`state_dict`, TRL's keys, so TRL's `entropy_ctrl_state.json` and ours are interchangeable).

Shapes: `B` completions, `T` completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["EntropyControl", "entropy_bonus", "window_stats"]


def entropy_bonus(entropy: Tensor, mask: Tensor, accumulation_steps: int = 1) -> Tensor:
    """Mean entropy per token over `mask` (differentiable), divided by the gradient-accumulation steps.
    Args: entropy, mask `[B, T]`. Returns a scalar; subtract c times it from the loss."""
    mask = mask.to(entropy.dtype)
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0) / accumulation_steps


def window_stats(entropy: Tensor, mask: Tensor) -> Tensor:
    """`[2]` = (sum of entropies over `mask`, number of tokens in `mask`), detached: summed over a window's
    micro-batches and the processes, their ratio is the window's token-weighted mean entropy."""
    mask = mask.to(entropy.dtype)
    return torch.stack([(entropy * mask).sum(), mask.sum()]).detach()


@dataclass
class EntropyControl:
    """The entropy-bonus coefficient: `coef` constant, or adapted (`adaptive`) towards `target` nats."""

    coef: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    step: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_entropy: float = math.inf  # the window entropy measured at the last optimizer step (inf: none yet)

    @property
    def enabled(self) -> bool:
        """Whether the loss carries the bonus: a non-zero coefficient, or adaptive control (which may raise it)."""
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient for this window: adaptive, 0 unless the last measured entropy is at or below target."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def update(self, window_entropy: float) -> None:
        """After an optimizer step: one step up if the window's entropy is at or below the target, else one down."""
        if window_entropy <= self.target:
            self.coef = min(self.coef + self.step, self.coef_max)
        else:
            self.coef = max(self.coef - self.step, self.coef_min)
        self.last_entropy = window_entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
