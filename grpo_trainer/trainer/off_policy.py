"""Off-policy corrections: a round's old log-probs and per-token weights, decided from its sampler record
(`rollout.types.SamplerRecord`) and the trainer's scores, and the mismatch report fed from the same scores.
`RoundBuilder` stops at advantages. This module decides every weight, and the old log-probs of decision 1's rows 2,
4 and 5 (an engine's round under the correction, off-policy; every round sampled ahead); a round it leaves without
old log-probs gets them, off-policy, from `PolicyScorer.prepare` (rows 1 and 3: the exact sampler's own, else a
forward).

Decisions (docs/ASYNC.md and docs/VLLM.md explain them to users):

1. Each kind of round, by what its record holds and where it was sampled:
   - sampled with the weights it starts from, its sampler's log-probs `exact` (the fast decoder): no old
     log-probs on-policy (the loss's own, detached); off-policy the sampler's (`PolicyScorer.prepare`); no weights.
   - ... its sampler's log-probs an engine's (vLLM, a `rollout_func`) with the engine correction on: the trainer's
     log-probs at the sampling weights by one no-grad forward, the old ones off-policy (on-policy they are dropped
     after use); rho = pi_old / pi_engine per token, bounded (`algorithms.engine_correction`).
   - ... otherwise: old log-probs off-policy by `PolicyScorer.prepare` (a forward per micro-batch); no weights.
   - sampled ahead (`ahead`, `async_rollouts`), `'behaviour'`: the sampler's log-probs (pi_b) are the old ones;
     no weights.
   - sampled ahead, `'recompute'`: old log-probs by one no-grad forward at the round's start weights; rho =
     pi_old / pi_b with the engine correction on, else no weights.
   The off-policy mask (DeepSeek-V3.2's, `algorithms.masks`) always compares with the sampler's log-probs where the
   record has them (`SamplerRecord.logps`), else with the old ones.
2. A no-grad forward at the sampling weights under truncated sampling collects the kept supports it used into the
   record (`KeptSupports.mask`) when the sampler gave none, so that every later forward scores over them.
3. The mismatch report (`trainer.mismatch`) compares the sampler's log-probs with the trainer's at the weights that
   sampled the round: where decision 1's forward computes them anyway, and with `sampling_mismatch_report` by one
   more no-grad forward. A round sampled ahead in-process is reported from the trainer's scores its producer job
   computed at the sampling weights (`trainer.producer`); one sampled ahead by an engine cannot be (its sampling
   weights are gone when the round is trained), so `trainer.producer.AsyncRounds.check` refuses the report there
   by name.
4. A partial round (`rollout.partial`) holds tokens sampled over several rounds, each stamped with the optimizer
   step of its weights (`SamplerRecord.versions`). The tokens an earlier policy sampled (stale) are either weighted
   (`'weight'`): rho = pi_old / pi_behaviour per token against their recorded log-probs, pi_old from one no-grad
   forward at the round's start weights, truncated per token to the engine correction's bounds, the tokens the
   current weights sampled given exactly 1; or masked (`'mask'`): kept in the context, out of the loss and its
   normaliser. The staleness is logged per token (`partial/*`), in optimizer steps behind.

Shapes: `B` completions (local), `T` completion tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from accelerate import Accelerator
from accelerate.utils import gather
from torch import Tensor, nn

from grpo_trainer.algorithms.engine_correction import (
    CROSS_PROCESS,
    EngineCorrection,
    engine_importance_ratio,
    engine_mismatch_metrics,
)
from grpo_trainer.diagnosis.signals import ess_metrics, weight_totals
from grpo_trainer.modeling import routing
from grpo_trainer.modeling.logprobs import LogProbs
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.trainer.mismatch import MismatchReport, sampler_logps
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.schedule import Schedule, window_tokens

__all__ = ["OffPolicy", "OffPolicySettings", "engine_weighted"]


@dataclass(frozen=True)
class OffPolicySettings:
    engine_correction: EngineCorrection | None = None  # `vllm_importance_sampling_*`; None: off
    # Training rounds are sampled ahead of the weights they start from (`async_rollouts`), corrected by
    # `async_correction`; None: every round is sampled with the weights it starts from.
    ahead: Literal["behaviour", "recompute"] | None = None
    # Partial rollouts' stale tokens (decision 4): "weight" (bounded as `partial_correction` says) or "mask"; None:
    # partial rollouts are off.
    partial: Literal["weight", "mask"] | None = None
    partial_correction: EngineCorrection | None = None


def engine_weighted(round_: Round, old_logps: Tensor, correction: EngineCorrection, on_policy: bool
                    ) -> tuple[Round, dict[str, Tensor]]:
    """`round_` with its importance weights against its sampler's log-probs (stored per token `[B, T]`: a sequence
    mode's one weight per completion repeated over its tokens, so it trims and shuffles with the round) and, off
    policy, `old_logps` `[B, T]` kept as its old log-probs; and this process's `sampling/*` metric values (reduce
    them with `CROSS_PROCESS`)."""
    mode, mask = correction.mode, round_.loss_mask.float()  # TRL: completion x tool mask
    sampler = round_.sampler.logps
    ratio = engine_importance_ratio(old_logps, sampler, mask, mode, correction.clip_min, correction.clip_max)
    values = engine_mismatch_metrics(old_logps, sampler, ratio, mask, mode)
    corrected = dataclasses.replace(round_, token_weights=ratio.expand_as(mask).contiguous(),
                                    old_logps=None if on_policy else old_logps)
    return corrected, values


class OffPolicy:
    """Decisions 1-3 for one run. `score(model, round_)`: the trainer's log-probs of a trimmed round `[B, T']`
    (`PolicyScorer.sampling_scores`); `sampler_dtype(model)`: the dtype the rollout backend samples in (the report's
    cause rules)."""

    def __init__(self, settings: OffPolicySettings, schedule: Schedule, score: Callable[..., LogProbs],
                 accelerator: Accelerator, metrics_window: MetricsWindow, mismatch: MismatchReport | None = None,
                 sampler_dtype: Callable[[nn.Module], torch.dtype | None] = lambda model: None) -> None:
        self.settings, self.schedule, self.score = settings, schedule, score
        self.accelerator, self.metrics, self.mismatch, self.sampler_dtype = (accelerator, metrics_window, mismatch,
                                                                             sampler_dtype)

    def correct(self, round_: Round, mode: str, model: nn.Module, version: int,
                sampled_scores: LogProbs | None = None) -> tuple[Round, dict[str, list]]:
        """`round_` (with its advantages) with its old log-probs and token weights (decision 1), trained from
        `model`'s weights at optimizer step `version`; and this process's completions-table columns of the mismatch
        report (decision 3). `sampled_scores`: the trainer's log-probs at the sampling weights, computed where the
        round was sampled ahead (in-process)."""
        ahead = self.settings.ahead if mode == "train" else None
        if round_.sampler.versions is not None and mode == "train":
            return self._partial(round_, model, version), {}
        if ahead is not None:
            return self._ahead(round_, ahead, model, sampled_scores)
        record, scores = round_.sampler, None
        if record.logps is not None and not record.exact and self.settings.engine_correction is not None:
            round_, scores = self._scored(round_, model)
            round_ = self._weighted(round_, self._old(round_, scores), mode, self.schedule.on_policy(mode))
        return round_, self._report(round_, scores, mode, model, version, logged_ratio=scores is not None)

    def _ahead(self, round_: Round, correction: str, model: nn.Module, sampled_scores: LogProbs | None
               ) -> tuple[Round, dict[str, list]]:
        """A training round sampled ahead: decision 1's last two rows; reported from `sampled_scores`."""
        record = round_.sampler
        # with 'recompute' and the correction on, TRL's `sampling_logp_difference/{mean,max}` are the correction's
        weighted = correction == "recompute" and self.settings.engine_correction is not None
        columns = {} if sampled_scores is None else self._report(round_, sampled_scores, "train", model,
                                                                 record.version, logged_ratio=weighted)
        round_ = dataclasses.replace(round_, sampler=record.without_stand_ins())
        if correction == "behaviour":
            return dataclasses.replace(round_, old_logps=record.logps, token_weights=None), columns
        round_, scores = self._scored(round_, model)
        old = self._old(round_, scores)
        mask = round_.loss_mask.bool()
        raw = torch.exp(old - record.logps.nan_to_num())[mask]  # pi_old / pi_behaviour per token
        empty = raw.numel() == 0  # every process records every key (they are reduced together)
        self.metrics.add("train", "async/importance_ratio_raw_mean", math.nan if empty else raw.mean())
        self.metrics.add_min("train", "async/importance_ratio_raw_min", math.inf if empty else float(raw.min()))
        self.metrics.add_max("train", "async/importance_ratio_raw_max", -math.inf if empty else float(raw.max()))
        self._effective_sample_size(torch.exp(old - record.logps.nan_to_num()), mask, "train", "async/importance_ratio")
        if self.settings.engine_correction is None:
            return dataclasses.replace(round_, old_logps=old), columns
        return self._weighted(round_, old, "train", on_policy=False), columns

    def _partial(self, round_: Round, model: nn.Module, version: int) -> Round:
        """Decision 4 for a partial round trained from the weights of optimizer step `version`."""
        record, mask = round_.sampler, round_.loss_mask.bool()
        behind = (version - record.versions).clamp(min=0)  # [B, T] optimizer steps behind
        stale = (behind > 0) & mask
        self._staleness(behind, stale, mask)
        round_ = dataclasses.replace(round_, sampler=dataclasses.replace(record, versions=None))
        if not bool(gather(stale.any().reshape(1).int()).any()):  # every process takes the same branch
            return round_
        if self.settings.partial == "mask":
            fresh = (~stale).int()
            env = fresh if round_.env_mask is None else round_.env_mask * fresh
            round_ = dataclasses.replace(round_, env_mask=env)
            return dataclasses.replace(round_, window_tokens=window_tokens(round_.loss_mask, "train", self.schedule,
                                                                           self.accelerator))
        round_, scores = self._scored(round_, model)
        old = self._old(round_, scores)
        behaviour = torch.where(stale, record.logps, old)  # the current weights' own tokens: rho = 1 exactly
        corrected, values = engine_weighted(dataclasses.replace(round_, sampler=dataclasses.replace(
            round_.sampler, logps=behaviour)), old, self.settings.partial_correction, self.schedule.on_policy("train"))
        for key, value in values.items():
            self.metrics.add("train", key.replace("sampling/", "partial/"), CROSS_PROCESS[key](gather(
                value.reshape(1).float())))
        self._effective_sample_size(corrected.token_weights, corrected.loss_mask, "train", "partial/importance")
        return dataclasses.replace(corrected, sampler=round_.sampler)

    def _staleness(self, behind: Tensor, stale: Tensor, mask: Tensor) -> None:
        """Decision 4's `partial/*` staleness metrics over every process's trained tokens."""
        totals = gather(torch.stack([stale.sum(), mask.sum(), (behind * stale).sum()]).float()[None]).sum(0)
        most = gather((behind * stale).max().reshape(1).float()).max()
        self.metrics.add("train", "partial/stale_token_share", float(totals[0] / totals[1].clamp(min=1)))
        self.metrics.add("train", "partial/staleness_mean", float(totals[2] / totals[0].clamp(min=1)))
        self.metrics.add_max("train", "partial/staleness_max", float(most))

    def _scored(self, round_: Round, model: nn.Module) -> tuple[Round, LogProbs]:
        """The trainer's log-probs of `round_` under `model` (no grad), and the round with the kept supports that
        forward collected (decision 2)."""
        with torch.no_grad():
            scores = self.score(model, round_.trimmed())
        if scores.sampling_mask is None:
            return round_, scores
        width = round_.completion_ids.shape[1]
        kept = nn.functional.pad(scores.sampling_mask, (0, 0, 0, width - scores.sampling_mask.shape[1]))
        record = round_.sampler
        return dataclasses.replace(round_, sampler=dataclasses.replace(
            record, kept=dataclasses.replace(record.kept, mask=kept))), scores

    @staticmethod
    def _old(round_: Round, scores: LogProbs) -> Tensor:
        return nn.functional.pad(scores.logps, (0, round_.completion_ids.shape[1] - scores.logps.shape[1]))  # [B, T]

    def _weighted(self, round_: Round, old: Tensor, mode: str, on_policy: bool) -> Round:
        round_, values = engine_weighted(round_, old, self.settings.engine_correction, on_policy)
        for key, value in values.items():
            self.metrics.add(mode, key, CROSS_PROCESS[key](gather(value.reshape(1).float())))
        self._effective_sample_size(round_.token_weights, round_.loss_mask, mode, "sampling/importance_sampling")
        return round_

    def _effective_sample_size(self, weights: Tensor, mask: Tensor, mode: str, prefix: str) -> None:
        """The weights' effective sample size over every process's tokens (`diagnosis.signals`; docs/HEALTH.md)."""
        totals = gather(weight_totals(weights, mask)[None]).sum(0)
        for key, value in ess_metrics(totals, prefix).items():
            self.metrics.add(mode, key, value)

    def _report(self, round_: Round, scores: LogProbs | None, mode: str, model: nn.Module, version: int,
                logged_ratio: bool) -> dict[str, list]:
        """Decision 3 for a training round: with the trainer's `scores` at the sampling weights (optimizer step
        `version`) where a forward computed them, else from one more no-grad forward when asked for. This process's
        completions-table columns."""
        if self.mismatch is None or mode != "train" or sampler_logps(round_) is None:
            return {}
        corrected = scores is not None
        if not corrected:
            if not self.mismatch.settings.enabled:
                return {}
            stats = routing.ReplayStats() if round_.sampler.routes is not None else None
            with torch.no_grad():  # a routed round's forward also counts what replay changed (`modeling.routing`)
                scores = self.score(model, round_.trimmed(), **({} if stats is None else {"routing_stats": stats}))
            if stats is not None:
                self.mismatch.report_routing(stats.flipped, stats.tokens)
        # a rollout_func samples with whatever it likes: its dtype is unknown here
        dtype = None if round_.sampler.kind == "rollout_func" else self.sampler_dtype(model)
        return self.mismatch.report(round_, scores.logps, scores.log_kept_mass, version, dtype, logged_ratio)
