"""Log-probs of a micro-batch under a model: the policy's forward of the loss, and the no-grad forwards that prepare
a micro-batch (old and reference log-probs).

Decisions:

1. A micro-batch is trimmed once and carries the old and reference log-probs its loss needs: old ones only when the
   round outlives an optimizer step (off-policy; then the rollout's own values are dropped: they are no stand-ins
   for the current ones after an update), reference ones only when beta != 0 (under PEFT: the policy with its
   adapter disabled).
2. On-policy the rollout's values stand in for the policy forward's (`modeling.logprobs`, `known`), and its layer
   outputs, when kept, replace the checkpointed layers' forward (`modeling.replay`). Every forward of this class goes
   through `modeling.forwards.score`, which runs it packed (`padding_free`) where the model allows, else padded;
   under sequence parallelism the group's subclass (`trainer.sequence_group.ShardedScorer`) runs the policy's and,
   within `prepare`, the no-grad forwards through `modeling.sequence_parallel.sharded_scores` instead, with the same
   forward modifications installed (`modeling.forwards.installed`).
3. With beta == 0, no entropy mask, no entropy bonus and no auxiliary loss, a completion whose advantage is exactly 0
   adds 0 to the loss and to its gradient whatever its log-probs. With `zero_variance_groups='skip'` only the other
   rows run forward and backward (`policy_logps`), and off-policy only they get old log-probs (`prepare`); skipped
   rows keep their place in every loss normaliser, with log-probs equal to the old ones (a ratio of exactly 1; 0
   and 0 where no old forward ran for them).

4. Under truncated sampling (top-k / top-p / min-p) every forward scores over the sampler's kept supports
   (`modeling.support`; a softmax over them with `keep_sampling_mask`, else the full softmax with the kept mass
   measured): the round's own (its sampler record's `KeptSupports.mask`) where it has them, else the truncation
   rules on the forward's logits. A no-grad forward at the sampling weights (`sampling_scores`: the engine
   correction's, the old log-probs') keeps the supports it used, so that later forwards (after an update, the
   reference model's) score over the same supports.
5. A Mixture-of-Experts round with the sampler's routing (its sampler record's `routes`, `routing_replay`) replays
   it in every forward here: the policy's, the old and the reference log-probs, and the trainer's side of the engine
   correction and the mismatch report (`modeling.routing`); the report's forward also counts the routes the
   trainer's own routers would have changed.

Shapes: `B` completions, `T` completion tokens, `W = ceil(V / 8)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from grpo_trainer.algorithms.truncation import Truncation
from grpo_trainer.modeling import forwards
from grpo_trainer.modeling.logprobs import LogProbs
from grpo_trainer.modeling.routing import ReplayStats
from grpo_trainer.modeling.support import KeptSupport
from grpo_trainer.rollout import multimodal
from grpo_trainer.runtime import models
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.schedule import Schedule

__all__ = ["PolicyLogProbs", "PolicyScorer", "ScoringSettings"]


@dataclass(frozen=True)
class ScoringSettings:
    # the training forward's options (packing, LM-head chunks, temperature, tiling, ...): the one object the memory
    # plan holds too (`config.settings.forward_settings`)
    forward: forwards.ForwardSettings = forwards.ForwardSettings(padding_free=True)
    rows_per_forward: int = 8  # `per_device_train_batch_size`: rows per no-grad forward
    beta: float = 0.0
    skip_zero_advantages: bool = False  # decision 3
    truncation: Truncation = Truncation()  # the sampler's (decision 4)
    keep_sampling_mask: bool = True  # decision 4


class PolicyLogProbs(NamedTuple):
    logps: Tensor  # [B, T]
    entropy: Tensor  # [B, T]
    measured: Tensor  # [B, T] the tokens whose entropy was computed
    aux_loss: Tensor | None  # [] the router's auxiliary loss, when asked for
    log_kept_mass: Tensor | None = None  # [B, T] under truncated sampling, where the forward measured it


class PolicyScorer:
    """Decisions 1-3, for one policy and its reference model (None: none, or the adapter-disabled policy)."""

    def __init__(self, settings: ScoringSettings, schedule: Schedule, ref_model: nn.Module | None) -> None:
        self.settings, self.schedule, self.ref_model = settings, schedule, ref_model
        self.forward = settings.forward

    def support(self, part: Round, collect: bool = False) -> KeptSupport | None:
        """How a forward over the trimmed `part` scores under the sampler's truncation (decision 4); None without
        one. The round's own supports count even where the config truncates nothing (a logits processor of the
        model's, e.g. one that bans or forces tokens, truncated them): the rollout's values were taken over them, so
        every forward must be. `collect`: return the supports used, when the round has none of its own."""
        kept = part.sampler.kept.mask
        if not self.settings.truncation.active and kept is None:
            return None
        packed = None if kept is None else kept.reshape(-1, kept.shape[-1])
        return KeptSupport(self.settings.truncation, packed, self.settings.keep_sampling_mask,
                           collect=collect and packed is None)

    def logps(self, model: nn.Module, inputs: Round, with_entropy: bool = False, policy: bool = False,
              with_aux_loss: bool = False, collect: bool = False, routing_stats: ReplayStats | None = None
              ) -> LogProbs:
        """Log-probs and entropies `[B, T]` of a trimmed micro-batch. `policy`: the model is the policy that sampled
        this round, on-policy (decision 2). `with_aux_loss`: also the MoE router's auxiliary loss. `collect`: keep
        the kept supports used (decision 4). `routing_stats`: counts the routes replay changed (decision 5)."""
        input_ids, attention_mask, width = inputs.sequences()
        images = multimodal.forward_inputs(model, inputs.images, width)  # None for text prompts
        known = inputs.sampler.stand_ins if policy else (None,) * 3
        replayed = inputs.sampler.replay.layer_outputs if policy and model.training else None
        return forwards.score(model, input_ids, attention_mask, width, self.forward, with_entropy, known,
                              with_aux_loss=with_aux_loss, model_inputs=images, layer_outputs=replayed,
                              support=self.support(inputs, collect), routes=inputs.sampler.routes,
                              routing_stats=routing_stats)

    def no_grad_logps(self, model: nn.Module, part: Round) -> Tensor:
        """Log-probs `[B, T]` of a (trimmed) round, `rows_per_forward` rows per forward."""
        return self.sampling_scores(model, part, collect=False).logps

    def sampling_scores(self, model: nn.Module, part: Round, collect: bool = True,
                        routing_stats: ReplayStats | None = None) -> LogProbs:
        """Log-probs `[B, T]` of a (trimmed) round, `rows_per_forward` rows per forward, and under truncated
        sampling the log kept masses and (`collect`, when the round has none) the kept supports used, `[B, T, W]`
        (decision 4); `routing_stats` counts the routes replay changed (decision 5)."""
        size, width = self.settings.rows_per_forward, part.completion_ids.shape[1]
        pieces = [self.logps(model, part.select(slice(i, i + size)).trimmed(), collect=collect,
                             routing_stats=routing_stats)
                  for i in range(0, part.rows, size)]

        def joined(values: list[Tensor | None]) -> Tensor | None:
            if any(v is None for v in values):
                return None
            pad = [(0, 0, 0, width - v.shape[1]) if v.dim() == 3 else (0, width - v.shape[1]) for v in values]
            return torch.cat([nn.functional.pad(v, p) for v, p in zip(values, pad)])

        return LogProbs(joined([p.logps for p in pieces]), log_kept_mass=joined([p.log_kept_mass for p in pieces]),
                        sampling_mask=joined([p.sampling_mask for p in pieces]))

    def prepare(self, part: Round, mode: str, model: nn.Module) -> Round:
        """`part` trimmed once, with the old and reference log-probs its loss needs (decision 1)."""
        return self._prepare(part.trimmed(), mode, model)

    def _prepare(self, part: Round, mode: str, model: nn.Module) -> Round:
        old = ref = None
        with torch.no_grad():
            if not self.schedule.on_policy(mode):
                record = part.sampler
                old = part.old_logps
                if old is None and record.exact:  # the sampler's become the old ones (no second copy is kept)
                    old, record = record.logps, dataclasses.replace(record, logps=None)
                if old is None:
                    old, mask = self._old_logps(model, part)
                    if mask is not None:
                        record = dataclasses.replace(record, kept=dataclasses.replace(record.kept, mask=mask))
                part = dataclasses.replace(part, sampler=record.without_stand_ins())
            if self.settings.beta != 0.0:
                if self.ref_model is not None:
                    ref = self.no_grad_logps(self.ref_model, part)
                else:
                    with models.reference_context(model):
                        ref = self.no_grad_logps(model, part)
        return dataclasses.replace(part, old_logps=old, ref_logps=ref)

    def _old_logps(self, model: nn.Module, part: Round) -> tuple[Tensor, Tensor | None]:
        """Old log-probs `[B, T]` by a no-grad forward, and the kept supports it collected (decision 4); with
        `skip_zero_advantages` only of the rows with a non-zero advantage, the others 0 (decision 3: their loss
        terms are 0 whatever the values; their supports are left to be recomputed)."""
        if not self.settings.skip_zero_advantages:
            scores = self.sampling_scores(model, part)
            return scores.logps, scores.sampling_mask
        advantages = part.advantages
        nonzero = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(1)  # [B]
        old = torch.zeros(part.completion_ids.shape, device=part.completion_ids.device)
        keep = nonzero.nonzero().squeeze(1)
        if keep.numel():
            values = self.no_grad_logps(model, part.select(keep).trimmed())
            old[keep, :values.shape[1]] = values
        return old, None

    def policy_logps(self, model: nn.Module, inputs: Round, skip_zero_advantages: bool, with_aux_loss: bool = False
                     ) -> PolicyLogProbs:
        """The policy's log-probs and entropies `[B, T]` for the loss, and with `with_aux_loss` the router's auxiliary
        loss; with `skip_zero_advantages` (decision 3's conditions, which the caller knows) only rows with a non-zero
        advantage run."""
        advantages, mask = inputs.advantages, inputs.loss_mask  # [B] or [B, T]; [B, T]
        nonzero = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(1)  # [B]
        if not skip_zero_advantages or bool(nonzero.all()):
            out = self.logps(model, inputs, with_entropy=True, policy=True, with_aux_loss=with_aux_loss)
            return PolicyLogProbs(out.logps, out.entropy, mask, out.aux_loss, out.log_kept_mass)
        keep = nonzero.nonzero().squeeze(1)
        keep = keep if keep.numel() else keep.new_zeros(1)  # one row keeps the graph (and DDP's hooks) alive
        part = self.logps(model, inputs.select(keep).trimmed(), True, policy=True)
        B, T = mask.shape
        width = part.logps.shape[1]
        logps = inputs.old_logps.clone() if inputs.old_logps is not None else part.logps.new_zeros(B, T)
        logps[keep, :width] = part.logps
        entropy = part.logps.new_zeros(B, T)
        entropy[keep, :width] = part.entropy
        measured = torch.zeros_like(mask)
        measured[keep] = mask[keep]
        masses = None
        if part.log_kept_mass is not None:
            masses = part.logps.new_zeros(B, T)
            masses[keep, :width] = part.log_kept_mass
        return PolicyLogProbs(logps, entropy, measured, None, masses)
