"""The sampler/trainer mismatch report of a generation round (`sampling_mismatch_report`; math and cause rules in
`algorithms.mismatch`).

Decisions:

1. A round is reported when the trainer has its own log-probs of the round at the sampling weights: always where
   a forward computes them anyway (an inference engine's importance-sampling correction), and with
   `sampling_mismatch_report` by one more no-grad forward otherwise (the fast decoder on-policy, whose own values
   otherwise stand in for the trainer's). The sampler's side is what it drew from: its processed log-probs
   (`KeptSupports.drawn_logps`), else its own (`SamplerRecord.logps`). `trainer.off_policy` decides when a round is
   reported and with which scores.
2. Everything logged is reduced over processes, so every process records the same metrics: TRL's
   `sampling/sampling_logp_difference/{mean,max}` (unless the engine correction already logged them this round),
   the quantiles of |delta| (`/p50`, `/p90`, `/p99`) and its mean per completion-position bucket
   (`/position_<first>-<last>/mean`).
3. With `sampling_mismatch_report`, the per-token table (count, mean and max |delta| of the tokens that disagree
   most in total) and the worst tokens with the text before them are written by the main process to
   `output_dir/sampling_mismatch/step_<N>.json` (a run that did not ask for the report gets no files); with
   `log_completions`, each completion's mean and max |delta| and its worst token are columns of the completions
   table.
4. Above `threshold` (mean |delta|, nats per token) a warning names the likely cause (`algorithms.mismatch`), once
   per cause per run; the cause of every reported round is in its file. The first reported round is the baseline
   the stale-weights rule compares with.

Shapes: `B` completions (local), `T` completion tokens.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather, gather_object
from torch import Tensor

from grpo_trainer.algorithms.mismatch import (
    POSITION_BUCKETS,
    MismatchFacts,
    bucket_name,
    likely_cause,
    position_buckets,
    scored,
    token_table,
    worst_tokens,
)
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.trainer.round import Round

__all__ = ["MismatchReport", "MismatchSettings", "sampler_logps"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")  # the trainer's one logger (as TRL's is)

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


@dataclass(frozen=True)
class MismatchSettings:
    enabled: bool = False  # `sampling_mismatch_report`: a forward for rounds that have none (decision 1)
    threshold: float = 0.05  # `sampling_mismatch_threshold`
    truncated_unmasked: bool = False  # the sampler truncates and the trainer scores the full softmax
    trainer_dtype: torch.dtype = torch.float32
    output_dir: str | None = None
    worst: int = 10  # worst tokens kept in the file
    tokens: int = 20  # rows of the per-token table in the file
    context: int = 8  # tokens of text shown before a worst token


def sampler_logps(round_: Round) -> Tensor | None:
    """The sampler's log-probs of the round's tokens `[B, T]`, what it drew from (decision 1)."""
    record = round_.sampler
    return record.kept.drawn_logps if record.kept.drawn_logps is not None else record.logps


class MismatchReport:
    """Decisions 1-4 for one run."""

    def __init__(self, settings: MismatchSettings, tokenizer: Any, accelerator: Accelerator,
                 metrics_window: MetricsWindow) -> None:
        self.settings, self.tokenizer, self.accelerator, self.metrics = (settings, tokenizer, accelerator,
                                                                         metrics_window)
        self.baseline: tuple[float, int] | None = None  # (mean |delta|, optimizer step) of the first round
        self.warned: set[str] = set()
        self.last: dict[str, Any] | None = None  # the latest report (what the file holds)

    def report(self, round_: Round, trainer_logps: Tensor, trainer_masses: Tensor | None, version: int,
               sampler_dtype: torch.dtype | None, logged_ratio_metrics: bool) -> dict[str, list]:
        """Report one training round; `trainer_logps` `[B, T']` (T' <= T) the trainer's at the sampling weights at
        optimizer step `version`, `trainer_masses` its log kept masses. Returns this process's completions-table
        columns (one value per row)."""
        sampler = sampler_logps(round_)
        width = trainer_logps.shape[1]
        mask = round_.loss_mask[:, :width]
        delta = (trainer_logps - sampler[:, :width]).float()  # [B, T']
        known = scored(delta, mask)
        size = torch.where(known, delta.abs(), 0.0)
        values = self._gathered_sizes(size[known])
        mean_delta = float(values.mean()) if values.numel() else 0.0
        kept_mass = round_.sampler.kept.log_mass
        masses = kept_mass[:, :width] if kept_mass is not None else trainer_masses
        cut = torch.zeros(2, device=delta.device)
        if masses is not None:
            cut = torch.stack([-(masses * known).sum(), known.sum().float()])
        cut = gather(cut[None]).sum(0)
        metrics = self._metrics(values, delta, mask, logged_ratio_metrics)
        for key, value in metrics.items():
            self.metrics.add("train", key, value)
        if self.baseline is None:
            self.baseline = (mean_delta, version)
        facts = MismatchFacts(mean_delta, self.settings.truncated_unmasked, float(cut[0] / cut[1].clamp(min=1)),
                              self.baseline[0], version > self.baseline[1], sampler_dtype, self.settings.trainer_dtype)
        cause, why = likely_cause(facts)
        if mean_delta > self.settings.threshold and cause not in self.warned:
            self.warned.add(cause)
            logger.warning(f"The sampler's and the trainer's log-probs of the sampled tokens differ by "
                           f"{mean_delta:.3g} nats per token on average (sampling_mismatch_threshold="
                           f"{self.settings.threshold}). Likely cause: {cause}: {why}. " + (
                               "Details by position and token: "
                               f"{os.path.join(self.settings.output_dir or '.', 'sampling_mismatch')}."
                               if self.settings.enabled else "sampling_mismatch_report=True writes the details by "
                               "position and token."))
        self._write(version, round_, delta, mask, metrics, cause, why, mean_delta)
        return self._completion_columns(round_, delta, known)

    def _gathered_sizes(self, local: Tensor) -> Tensor:
        """Every process's |delta| values, concatenated."""
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
        everything = self.accelerator.gather(padded)
        return everything[everything >= 0]

    def _metrics(self, values: Tensor, delta: Tensor, mask: Tensor, logged_ratio_metrics: bool) -> dict[str, Tensor]:
        """Decision 2."""
        zero = values.new_zeros(())
        out: dict[str, Tensor] = {}
        if not logged_ratio_metrics:
            out["sampling/sampling_logp_difference/mean"] = values.mean() if values.numel() else zero
            out["sampling/sampling_logp_difference/max"] = values.max() if values.numel() else zero
        for name, q in QUANTILES.items():
            out[f"sampling/sampling_logp_difference/{name}"] = torch.quantile(values, q) if values.numel() else zero
        buckets = gather(position_buckets(delta, mask)[None])  # [N, K, 3]
        sums, counts = buckets[..., 0].sum(0), buckets[..., 1].sum(0)
        for k in range(len(POSITION_BUCKETS)):
            if counts[k] > 0:
                out[f"sampling/sampling_logp_difference/position_{bucket_name(k)}/mean"] = sums[k] / counts[k]
        return out

    def _write(self, version: int, round_: Round, delta: Tensor, mask: Tensor, metrics: dict[str, Tensor],
               cause: str, why: str, mean_delta: float) -> None:
        """Decision 3: the per-token table and the worst tokens of every process, in one file."""
        ids, counts, sums, maxima = token_table(delta, mask, round_.completion_ids[:, :delta.shape[1]])
        worst = [self._worst_entry(round_, row, position, value)
                 for row, position, value in worst_tokens(delta, mask, self.settings.worst)]
        tables = gather_object([(ids.tolist(), counts.tolist(), sums.tolist(), maxima.tolist())])
        worst = sorted(gather_object(worst), key=lambda entry: -abs(entry["delta"]))[:self.settings.worst]
        if not self.accelerator.is_main_process:
            return
        merged: dict[int, list[float]] = {}
        for table in tables:
            for token, count, total, largest in zip(*table):
                entry = merged.setdefault(token, [0, 0.0, 0.0])
                entry[0], entry[1], entry[2] = entry[0] + count, entry[1] + total, max(entry[2], largest)
        by_token = sorted(merged.items(), key=lambda item: -item[1][1])[:self.settings.tokens]
        self.last = {
            "step": version, "cause": cause, "explanation": why, "mean_abs_difference": mean_delta,
            "metrics": {k: float(v) for k, v in metrics.items()},
            "by_token": [{"token": self.tokenizer.decode([token]), "token_id": token, "count": count,
                          "mean_abs_difference": total / count, "max_abs_difference": largest}
                         for token, (count, total, largest) in by_token],
            "worst_tokens": worst,
        }
        if self.settings.enabled and self.settings.output_dir is not None:
            folder = os.path.join(self.settings.output_dir, "sampling_mismatch")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"step_{version:06d}.json"), "w") as f:
                json.dump(self.last, f, indent=1)

    def _worst_entry(self, round_: Round, row: int, position: int, value: float) -> dict[str, Any]:
        start = max(0, position - self.settings.context)
        before = round_.completion_ids[row, start:position].tolist()
        if position < self.settings.context:  # the prompt's end makes up the rest of the context
            prompt = round_.prompt_ids[row][round_.prompt_mask[row].bool()].tolist()
            before = prompt[len(prompt) - (self.settings.context - position):] + before
        token = int(round_.completion_ids[row, position])
        return {"process": self.accelerator.process_index, "row": row, "position": position, "delta": value,
                "token": self.tokenizer.decode([token]), "context": self.tokenizer.decode(before)}

    def _completion_columns(self, round_: Round, delta: Tensor, known: Tensor) -> dict[str, list]:
        """Decision 3: each completion's mean and max |delta| and its worst token (with its position)."""
        size = torch.where(known, delta.abs(), 0.0)
        count = known.sum(1)
        means = (size.sum(1) / count.clamp(min=1)).tolist()
        largest, where = size.max(1) if size.shape[1] else (size.new_zeros(size.shape[0]),) * 2
        worst = [f"{self.tokenizer.decode([int(round_.completion_ids[r, p])])!r} @ {int(p)}" if count[r] else None
                 for r, p in enumerate(where.tolist())]
        return {"logp_difference_mean": [m if c else None for m, c in zip(means, count.tolist())],
                "logp_difference_max": [m if c else None for m, c in zip(largest.tolist(), count.tolist())],
                "logp_difference_worst_token": worst}
