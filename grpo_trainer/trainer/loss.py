"""The loss of one micro-batch (surrogate, aggregation, KL, entropy terms, the router's auxiliary loss), the
adaptive entropy coefficient, and the guard that drops a non-finite step.

The math lives in `algorithms` (`losses.objective_loss`, `surrogates`, `masks`, `entropy`); the log-probs come from
`trainer.scoring`. This module wires them and records the metrics under TRL's names.

Shapes: `B` completions (local), `T` completion tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather
from torch import Tensor, nn

from grpo_trainer.algorithms import losses, masks
from grpo_trainer.algorithms.entropy import EntropyControl, window_stats
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.scoring import PolicyScorer

__all__ = ["GRPOLoss", "LossPartSettings", "NonFiniteGuard", "pooled_high_entropy_mask"]

_ENTROPY_PAD = -1e9  # pads entropies (always >= 0) to a common length for the cross-process gather


@dataclass(frozen=True)
class LossPartSettings:
    objective: losses.LossSettings
    accumulation_steps: int = 1  # `gradient_accumulation_steps`
    max_completion_length: int = 512  # `dr_grpo`'s constant
    top_entropy_quantile: float = 1.0
    router_aux_loss_coef: float = 0.0
    # `zero_variance_groups='skip'`: zero-advantage rows skip the policy forward (the config refuses the settings
    # that would give them a gradient; `scoring`, decision 3)
    skip_zero_advantages: bool = False


class GRPOLoss:
    """`loss(model, inputs, mode, sync_gradients)`: the differentiable loss of one prepared micro-batch, already
    scaled for gradient accumulation (`loss_is_scaled_for_ga`)."""

    def __init__(self, settings: LossPartSettings, scorer: PolicyScorer, entropy: EntropyControl,
                 accelerator: Accelerator, metrics_window: MetricsWindow) -> None:
        self.settings, self.scorer, self.entropy = settings, scorer, entropy
        self.accelerator, self.metrics = accelerator, metrics_window
        self._entropy_window: Tensor | None = None  # [sum, tokens] of the current accumulation window

    @property
    def aux_loss_enabled(self) -> bool:
        return self.settings.router_aux_loss_coef != 0.0

    def __call__(self, model: nn.Module, inputs: Round, mode: str, sync_gradients: bool = True) -> Tensor:
        settings, objective = self.settings, self.settings.objective
        # The forward of zero-advantage rows is skipped only where they add nothing (`scoring`, decision 3): the
        # config refuses 'skip' otherwise; the conditions are re-checked so no setting changed later can slip by.
        skip = settings.skip_zero_advantages and mode == "train" and objective.beta == 0.0 \
            and settings.top_entropy_quantile >= 1.0 and not self.entropy.enabled and not self.aux_loss_enabled
        logps, entropy, measured, aux_loss, masses = self.scorer.policy_logps(model, inputs, skip,
                                                                              self.aux_loss_enabled)
        mask = inputs.loss_mask
        entropy_mask = None
        if settings.top_entropy_quantile < 1.0:
            entropy_mask = self.high_entropy_mask(entropy.detach(), mask, 1.0 - settings.top_entropy_quantile)
        bonus = self.entropy.enabled
        norm = losses.LossNorm(settings.accumulation_steps if mode == "train" else 1, inputs.window_tokens,
                               settings.max_completion_length)
        # the off-policy mask compares with the sampler's log-probs where the record has them (`trainer.off_policy`)
        batch = losses.LossBatch(inputs.advantages, mask, inputs.old_logps, inputs.ref_logps,
                                 sampling_logps=inputs.sampler.logps, engine_ratio=inputs.token_weights,
                                 entropy_mask=entropy_mask, entropy=entropy if bonus else None,
                                 entropy_coef=self.entropy.applied() if bonus else None)
        out = losses.objective_loss(logps, batch, objective, norm)
        for key, value in out.metrics.items():
            self.metrics.add(mode, key, value)
        for key, values in out.per_sequence.items():  # extremes over every process's completions
            self.metrics.add(mode, key, losses.SEQUENCE_METRICS[key][1](gather(values)))
        self.metrics.add(mode, "entropy", (entropy.detach() * measured).sum() / measured.sum().clamp(min=1))
        masses = masses if masses is not None else inputs.sampler.kept.log_mass  # the forward's, else the sampler's
        if masses is not None:  # truncated sampling: the bias a full-softmax ratio would carry, always shown
            mean_mass = (masses * measured).sum() / measured.sum().clamp(min=1)
            self.metrics.add(mode, "sampling/log_kept_mass/mean", mean_mass)
        if bonus and mode == "train":
            self.control_entropy(entropy, mask if entropy_mask is None else mask * entropy_mask, sync_gradients)
        loss = out.loss
        if aux_loss is not None:  # TRL: scaled for gradient accumulation like the policy loss (auto-scaling is off)
            loss = loss + settings.router_aux_loss_coef * aux_loss / norm.accumulation_steps
            self.metrics.add(mode, "aux_loss", aux_loss.detach())
        return loss

    def control_entropy(self, entropy: Tensor, mask: Tensor, sync_gradients: bool) -> None:
        """Adaptive entropy control: add this micro-batch's entropy to the window's; at the optimizer step, update
        the coefficient from the window's token-weighted entropy over every process. Logs `entropy_coef` once per
        optimizer step, as TRL."""
        if self.entropy.adaptive:
            stats = window_stats(entropy, mask)  # [2]
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window, reduction="sum")
                self.entropy.update((totals[0] / totals[1].clamp(min=1.0)).item())
                self._entropy_window = None
        if sync_gradients:
            self.metrics.add("train", "entropy_coef", self.entropy.coef)

    def high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        return pooled_high_entropy_mask(self.accelerator, entropies, mask, threshold)


def pooled_high_entropy_mask(accelerator: Any, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """True for the completion tokens `[B, T]` whose entropy is at least the `threshold` quantile of the
    completion-token entropies of every process (`masks.high_entropy_mask`): each process's are padded to a common
    length, gathered, and the padding dropped. `accelerator`: what does the padding and the gather."""
    local = entropies[mask.bool()].float()
    padded = accelerator.pad_across_processes(local, dim=0, pad_index=_ENTROPY_PAD)
    gathered = accelerator.gather(padded)
    return masks.high_entropy_mask(entropies, mask, gathered[gathered != _ENTROPY_PAD], threshold)


class NonFiniteGuard:
    """A non-finite loss or gradient drops its micro-step's gradients; too many in a row stop the run with the
    likely causes."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = self.since_log = 0

    def check(self, loss: Tensor, model: nn.Module, step: int) -> bool:
        """Whether the micro-step is finite; if not, its gradients are dropped (the optimizer then skips them)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = torch.isfinite(loss) and (not grads or torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.since_log += 1
        warnings.warn(f"non-finite loss or gradient at step {step}; its gradients are dropped.")
        if self.in_a_row > self.max_in_a_row:
            raise RuntimeError(
                f"{self.in_a_row} micro-steps in a row had a non-finite loss or gradient. Check the "
                "rewards for huge values, lower learning_rate, set max_grad_norm, or use fp32 instead of fp16.")
        for p in model.parameters():
            p.grad = None  # an optimizer skips parameters without a gradient
        return False

    def take_count(self) -> int:
        """Micro-steps dropped since the last call (for the `nonfinite_steps` metric)."""
        count, self.since_log = self.since_log, 0
        return count
