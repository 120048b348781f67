"""The weight-sync self-check: does the vLLM engine sample with the policy's weights?

A broken weight sync fails silently: the engine keeps sampling with old (or placeholder) weights, the importance
weights quietly correct what they can, and the run "trains on nothing". This check makes it loud.

Decisions:

1. When (`SyncSchedule`): after the first push, then every `interval` pushes, and after any push that left engine
   parameters unreached (`inspection`, decision 1). One check costs a forward of a few rows on the trainer and a
   prefill of the same rows in the engine, which scores them as prompts (`prompt_logprobs`: the raw log-probs at
   temperature 1, untouched by the sampling settings, so top-k/top-p/penalties cannot cause a difference).
2. What: the mean |log p_engine - log p_trainer| over the completion tokens of the first `rows` rows the engine has
   just sampled, against a tolerance for the lower-precision dtype of the two sides (`LOGP_TOLERANCE`). The mean,
   not the max: a bf16 engine's kernels put a few tokens much further off than the typical one, while a stale or
   missing weight moves all of them.
3. On failure, before raising, the diagnosis reads the engine's weights back under their checkpoint names
   (`inspection`) and compares them by digest with the policy's: the parameter groups that differ, the names that
   mapped onto no engine parameter, the engine parameters the push did not reach. When every compared weight
   agrees, the difference is in the inputs (a vision-language model's image processing), and the error says so.
4. Every process reaches the same verdict (the largest gap of all processes decides) and raises, so none is left
   waiting in a collective.

Shapes: `k` probed rows, `T` completion tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpo_trainer.rollout.types import Rollout
from grpo_trainer.rollout.vllm.inspection import digests_agree

__all__ = ["LOGP_TOLERANCE", "PROBE_ROWS", "Diagnosis", "SyncSchedule", "WeightSyncError", "differing_weights",
           "engine_completion_logps", "failure_message", "logp_gap", "logp_tolerance", "probe_rows",
           "probe_sequences"]

# Mean |log p_engine - log p_trainer| (nats) over the probed tokens that two correctly synced sides stay under, for
# the lower-precision dtype of the two. float32: measured ~5e-7 on CPU (docs/VLLM.md); bf16/fp16 kernels differ by
# ~1e-2 on typical tokens. A placeholder or stale weight is off by far more (the first push replaces random weights).
LOGP_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}
_LIST_AT_MOST = 8  # names shown per category in the error
PROBE_ROWS = 2  # rows of the round each check scores (per process)


class WeightSyncError(RuntimeError):
    """The vLLM engine does not sample with the policy's weights."""


def logp_tolerance(*dtypes: torch.dtype) -> float:
    """The tolerance of the least precise of `dtypes` (decision 2)."""
    return max(LOGP_TOLERANCE.get(dtype, LOGP_TOLERANCE[torch.bfloat16]) for dtype in dtypes)


@dataclass
class SyncSchedule:
    """Which pushes are checked (decision 1). `interval` 0: none."""

    interval: int
    pushes: int = 0
    due: bool = False
    checks: int = 0  # checks run so far
    gaps: list[tuple[float, int]] = field(default_factory=list)  # each check's (mean gap, tokens), worst process
    unreached: list[str] = field(default_factory=list)  # engine parameters the last push did not reach

    def pushed(self, unreached: Sequence[str] | None) -> None:
        self.pushes += 1
        self.unreached = list(unreached or [])
        if self.interval and ((self.pushes - 1) % self.interval == 0 or self.unreached):
            self.due = True


def probe_rows(rollout: Rollout, rows: int) -> Tensor:
    """Indices `[k]` of the first `rows` rows holding at least one completion token."""
    return (rollout.completion_mask.sum(1) > 0).nonzero().squeeze(1)[:rows]


def probe_sequences(rollout: Rollout, rows: Tensor) -> list[list[int]]:
    """Each probed row's prompt and completion tokens, without padding."""
    return [rollout.prompt_ids[r][rollout.prompt_mask[r].bool()].tolist()
            + rollout.completion_ids[r][rollout.completion_mask[r].bool()].tolist() for r in rows.tolist()]


def engine_completion_logps(scores: Sequence[Sequence[float | None]], lengths: Sequence[int], width: int) -> Tensor:
    """`[k, width]` the engine's log-probs of each row's last `lengths[i]` tokens (its completion), from its
    prompt log-probs (one per token after the first); NaN where it gave none or past the completion."""
    out = torch.full((len(lengths), width), float("nan"))
    for row, (values, length) in enumerate(zip(scores, lengths)):
        tail = list(values)[len(values) - length:]
        out[row, :length] = torch.tensor([float("nan") if v is None else float(v) for v in tail])
    return out


def logp_gap(engine: Tensor, trainer: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean |engine - trainer| over the `[k, T]` positions `mask` marks where both are finite, and how many such
    positions there are (decision 2)."""
    diff = (engine - trainer).abs()
    valid = mask.bool() & torch.isfinite(diff)
    count = valid.sum()
    return torch.where(count > 0, diff.where(valid, 0.0).sum() / count.clamp(min=1), 0.0), count


def differing_weights(expected: dict[str, list[float]], engine: dict[str, list[float]]) -> list[str]:
    """The checkpoint names whose engine digest is not the policy's."""
    return [name for name, ours in expected.items() if not digests_agree(ours, engine[name])]


@dataclass(frozen=True)
class Diagnosis:
    """What the engine's weights say after a failed check (decision 3); `available` False when the engine cannot
    be inspected (a server started without `grpo-train vllm-serve`), with `reason`."""

    available: bool
    compared: int = 0
    differing: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    uncompared: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    reason: str = ""


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LIST_AT_MOST])
    return shown + (f" and {len(names) - _LIST_AT_MOST} more" if len(names) > _LIST_AT_MOST else "")


def failure_message(gap: float, tolerance: float, tokens: int, push: int, step: int, dtype: str,
                    diagnosis: Diagnosis) -> str:
    """The error of a failed check: the measured gap, then what the diagnosis found (decision 3)."""
    lines = [f"vLLM's weights are not the policy's after weight push {push} (optimizer step {step}): the mean "
             f"|log p_vllm - log p_trainer| over {tokens} sampled tokens is {gap:.3g}, above the {tolerance:g} a "
             f"correct sync stays under in {dtype}. Training on would sample from another policy than the one "
             "being trained."]
    if not diagnosis.available:
        lines.append(f"The engine's weights could not be read back: {diagnosis.reason}")
    else:
        if diagnosis.unmapped:
            lines.append(f"Names that failed to map onto any vLLM parameter: {_listed(diagnosis.unmapped)}.")
        if diagnosis.unreached:
            lines.append(f"vLLM parameters the push did not reach: {_listed(diagnosis.unreached)}.")
        if diagnosis.differing:
            everything = len(diagnosis.differing) == diagnosis.compared
            lines.append(f"Parameter groups whose vLLM values differ from the policy's ({len(diagnosis.differing)} "
                         f"of {diagnosis.compared} compared): {_listed(diagnosis.differing)}."
                         + (" Every weight differs: the push did not reach the engine." if everything else ""))
        elif diagnosis.uncompared and not (diagnosis.unmapped or diagnosis.unreached):
            # MoE experts are the usual case: vLLM repacks them, and its CPU build's in-place reload leaves them
            # wrong (docs/MOE.md, "vLLM"); the comparable weights then all agree.
            lines.append(f"Every one of the {diagnosis.compared} weights compared equals the policy's, so the "
                         "difference is in the weights that could not be compared (listed below; for a "
                         "Mixture-of-Experts model its experts: vLLM's CPU build does not reload them correctly) "
                         "or in what the engine is given.")
        elif not (diagnosis.unmapped or diagnosis.unreached):
            lines.append(f"Every one of the {diagnosis.compared} weights compared equals the policy's, so the "
                         "difference is in what the engine is given: for a vision-language model, vLLM's image "
                         "processing differs from the processor's.")
        if diagnosis.uncompared:
            lines.append(f"Not compared (a layout vLLM splits differently): {_listed(diagnosis.uncompared)}.")
    lines.append("Set vllm_sync_check_interval=0 to skip this check (not recommended).")
    return " ".join(lines)
