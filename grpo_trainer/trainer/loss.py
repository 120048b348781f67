"""The loss side of `GRPOTrainer`: policy log-probs, `compute_loss` (surrogate, aggregation, KL, entropy terms), the
guarded `training_step`, and TRL's static helpers.

The math lives in `algorithms` (`losses.policy_loss`, `surrogates`, `masks`, `entropy`); this module wires it.

Shapes: `B` completions (local), `T` completion tokens.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from accelerate.utils import gather
from torch import Tensor, nn

from grpo_trainer.algorithms import losses, masks, surrogates
from grpo_trainer.algorithms.entropy import window_stats
from grpo_trainer.modeling import forwards
from grpo_trainer.modeling.logprobs import LogProbs
from grpo_trainer.rollout import multimodal
from grpo_trainer.trainer.round import Round

__all__ = ["LossMixin"]

_ENTROPY_PAD = -1e9  # pads entropies (always >= 0) to a common length for the cross-process gather


class LossMixin:
    """Loss and optimisation step. Reads `_surrogate_params`, `_entropy`, `_entropy_window`, `aux_loss_enabled`,
    `ref_model`, `_metrics` and the non-finite counters set up by `GRPOTrainer.__init__`."""

    def _logps(self, model: nn.Module, inputs: Round, with_entropy: bool = False, policy: bool = False) -> LogProbs:
        """Log-probs and entropies `[B, T]` of a trimmed micro-batch. `policy`: the model is the policy that sampled
        this round, on-policy, so the rollout's values stand in for the forward's (and its layer outputs, if kept,
        are replayed); the policy's forward also returns the MoE router's auxiliary loss when it is enabled."""
        input_ids = torch.cat([inputs.prompt_ids, inputs.completion_ids], dim=1)  # [B, S + T]
        attention_mask = torch.cat([inputs.prompt_mask, inputs.completion_mask], dim=1)
        width = inputs.completion_ids.shape[1]
        with_aux_loss = policy and self.aux_loss_enabled
        images = multimodal.forward_inputs(model, inputs.images, width)  # None for text prompts
        known = (inputs.sampling_logps, inputs.sampling_entropy, inputs.sampling_probs) if policy else (None,) * 3
        replayed = inputs.layer_outputs if policy and model.training else None
        args = self.args
        settings = forwards.ForwardSettings(args.padding_free, args.temperature, args.logprob_chunk_size,
                                           args.pad_to_multiple_of)
        return forwards.score(model, input_ids, attention_mask, width, settings, with_entropy, known,
                             with_aux_loss=with_aux_loss, model_inputs=images, layer_outputs=replayed)

    def compute_loss(self, model: nn.Module, inputs: Round, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Tensor:
        args = self.args
        mode = "train" if model.training else "eval"
        logps, entropy, measured, aux_loss = self._policy_logps(model, inputs, mode)  # [B, T] each; [] or None
        mask = inputs.loss_mask
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy.detach(), mask, 1.0 - args.top_entropy_quantile)
        bonus = self._entropy.enabled
        norm = losses.LossNorm(args.gradient_accumulation_steps if mode == "train" else 1,
                               inputs.window_tokens, args.max_completion_length)
        out = losses.policy_loss(logps, inputs.advantages, mask, norm, loss_type=args.loss_type,
                                 old_logps=inputs.old_logps, ref_logps=inputs.ref_logps, beta=args.beta,
                                 kl_bias_correction=args.use_bias_correction_kl, params=self._surrogate_params,
                                 importance_sampling_level=args.importance_sampling_level,
                                 off_policy_threshold=args.off_policy_mask_threshold,
                                 sampling_logps=inputs.engine_logps if inputs.engine_logps is not None
                                 else inputs.sampling_logps, entropy_mask=entropy_mask,
                                 entropy=entropy if bonus else None,
                                 entropy_coef=self._entropy.applied() if bonus else None,
                                 engine_ratio=inputs.engine_ratio)
        window = self._metrics[mode]
        for key, value in out.metrics.items():
            window[key].append(value)
        for key, values in out.per_sequence.items():  # extremes over every process's completions
            window[key].append(losses.SEQUENCE_METRICS[key][1](gather(values)))
        window["entropy"].append((entropy.detach() * measured).sum() / measured.sum().clamp(min=1))
        if bonus and mode == "train":
            self._control_entropy(entropy, mask if entropy_mask is None else mask * entropy_mask)
        loss = out.loss
        if aux_loss is not None:  # TRL: scaled for gradient accumulation like the policy loss (auto-scaling is off)
            loss = loss + self.router_aux_loss_coef * aux_loss / norm.accumulation_steps
            window["aux_loss"].append(aux_loss.detach())
        return (loss, None) if return_outputs else loss

    def _control_entropy(self, entropy: Tensor, mask: Tensor) -> None:
        """Adaptive entropy control: add this micro-batch's entropy to the window's; at the optimizer step, update
        the coefficient from the window's token-weighted entropy over every process. Logs `entropy_coef` once per
        optimizer step, as TRL."""
        if self._entropy.adaptive:
            stats = window_stats(entropy, mask)  # [2]
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window, reduction="sum")
                self._entropy.update((totals[0] / totals[1].clamp(min=1.0)).item())
                self._entropy_window = None
        if self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self._entropy.coef)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute; adaptive control changes it each step)."""
        return self._entropy.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self._entropy.coef = value

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """TRL's method: True for the completion tokens `[B, T]` whose entropy is at least the `threshold` quantile
        of the completion-token entropies of every process (`masks.high_entropy_mask`)."""
        local = entropies[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=_ENTROPY_PAD)
        gathered = self.accelerator.gather(padded)
        return masks.high_entropy_mask(entropies, mask, gathered[gathered != _ENTROPY_PAD], threshold)

    @staticmethod
    def get_off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor,
                            mask: Tensor, off_policy_threshold: float) -> Tensor:
        """TRL's static method: DeepSeek-V3.2's off-policy sequence mask `[B, 1]` (`masks.off_policy_mask`)."""
        return masks.off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                     off_policy_threshold)

    @staticmethod
    def get_gamma_weights(advantages: Tensor, log_ratio_per_token: Tensor, mask: Tensor,
                          importance_sampling_ratio: Tensor | None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                          k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
        """TRL's static method: VESPO's sequence weights phi(w) `[B, 1]` (`surrogates.gamma_weights`)."""
        return surrogates.gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos,
                                        lambda_pos, k_neg, lambda_neg)

    def _policy_logps(self, model: nn.Module, inputs: Round, mode: str
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Policy log-probs and entropies `[B, T]`, the mask of tokens whose entropy was computed, and the MoE
        router's auxiliary loss (None unless enabled). With beta == 0, no entropy mask, no entropy bonus and no
        auxiliary loss, a completion whose advantage is exactly 0 adds 0 to the loss and to its gradient whatever
        its log-probs, so only the other rows run forward and backward; skipped rows keep their place in every loss
        normaliser, with log-probs equal to the old ones (a ratio of exactly 1)."""
        args = self.args
        advantages, mask = inputs.advantages, inputs.loss_mask  # [B] or [B, T]; [B, T]
        nonzero = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(1)  # [B]
        if mode != "train" or args.beta != 0.0 or args.top_entropy_quantile < 1.0 or self._entropy.enabled \
                or self.aux_loss_enabled or bool(nonzero.all()):
            out = self._logps(model, inputs, with_entropy=True, policy=True)
            return out.logps, out.entropy, mask, out.aux_loss
        keep = nonzero.nonzero().squeeze(1)
        keep = keep if keep.numel() else keep.new_zeros(1)  # one row keeps the graph (and DDP's hooks) alive
        part = self._logps(model, inputs.select(keep).trimmed(), True, policy=True)
        part_logps, part_entropy = part.logps, part.entropy
        B, T = mask.shape
        width = part_logps.shape[1]
        logps = inputs.old_logps.clone() if inputs.old_logps is not None else part_logps.new_zeros(B, T)
        logps[keep, :width] = part_logps
        entropy = part_logps.new_zeros(B, T)
        entropy[keep, :width] = part_entropy
        measured = torch.zeros_like(mask)
        measured[keep] = mask[keep]
        return logps, entropy, measured, None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        """The Trainer's step, then a guard: a non-finite loss or gradient drops this window's gradients."""
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)  # left unscaled: loss_is_scaled_for_ga
        self._record_step_time(time.perf_counter() - started)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = torch.isfinite(loss) and (not grads or torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))
        if finite:
            self._nonfinite_in_a_row = 0
            return loss
        self._nonfinite_in_a_row += 1
        self._nonfinite_since_log += 1
        warnings.warn(f"non-finite loss or gradient at step {self.state.global_step}; its gradients are dropped.")
        if self._nonfinite_in_a_row > self.args.max_nonfinite_steps:
            raise RuntimeError(
                f"{self._nonfinite_in_a_row} micro-steps in a row had a non-finite loss or gradient. Check the "
                "rewards for huge values, lower learning_rate, set max_grad_norm, or use fp32 instead of fp16.")
        for p in model.parameters():
            p.grad = None  # an optimizer skips parameters without a gradient
        return loss.new_zeros(())

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.mean().detach(), None, None

    def _record_step_time(self, seconds: float) -> None:
        """TRL's `step_time`: seconds spent in `training_step` over the micro-steps of one optimizer step."""
        self._step_time += seconds
        self._micro_steps_timed += 1
        if self._micro_steps_timed >= self.current_gradient_accumulation_steps:
            self._metrics["train"]["step_time"].append(self._step_time)
            self._step_time, self._micro_steps_timed = 0.0, 0
