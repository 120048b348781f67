"""Settings that fit a device and train the same objective: what the over-budget error lists and what
`auto_find_batch_size=True` applies.

Decisions:

1. The same objective means the same global batch, the same generation rounds and the same algorithm: a micro-batch
   of `micro_batch / k` rows with `k` times the gradient-accumulation steps and `k` times the micro-steps per round
   (so `generation_batch_size` is unchanged and a round is generated exactly as before), activation checkpointing
   (which recomputes, never changes, a value), the sequence-tiled MLP (`mlp_tile_tokens`: the same values, gradients
   within float32 rounding), the recomputed attention (`recompute_attention`, likewise), on a GPU activation
   offloading (the same tensors back from host memory), and a smaller vLLM memory fraction (which only bounds its KV
   cache: a round that does not fit at once is queued). Splitting micro-batches changes nothing only where the loss's
   aggregation sums micro-batches to the whole window's value (`SPLIT_EXACT`): every aggregation but `bnpo` (a token
   mean per micro-batch), and not with `top_entropy_quantile < 1` (a quantile per micro-batch).
2. LoRA fits where full training does not, but trains other parameters: it is listed, never applied.
3. The candidates are every combination of the levers of `planning.levers` that `fits` (each lever pulled at most
   once), tried cheapest first by the product of their pulls' step-time costs; the first that fits is
   `auto_find_batch_size`'s choice. A lever the levers' rules hold back (not run on a GPU at its current code, or
   not launched under this launch in a CPU test: `levers.allowed`) is not tried.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from grpo_trainer.algorithms.losses import LOSS_TYPES
from grpo_trainer.planning import levers
from grpo_trainer.planning.estimate import MemoryPlan, plan_memory
from grpo_trainer.planning.settings import DeviceMemory, ModelShape, PlanSettings

__all__ = ["SPLIT_EXACT", "Fit", "fitting", "split_is_exact"]

# aggregation -> whether summing a window's micro-batches gives the same loss however the rows are split
# (tests/planning/test_fit.py checks that every aggregation in `losses.AGGREGATIONS` is classified here)
SPLIT_EXACT: dict[str, bool] = {"grpo": True, "luspo": True, "dr_grpo": True, "dapo": True, "bnpo": False}


def split_is_exact(loss_type: str, top_entropy_quantile: float) -> bool:
    """Whether smaller micro-batches with more accumulation train the same objective (decision 1)."""
    return SPLIT_EXACT[LOSS_TYPES[loss_type][1]] and top_entropy_quantile >= 1.0


@dataclass(frozen=True)
class Fit:
    """A setting that fits, with its plan. `changes`: GRPOConfig field -> new value."""

    changes: dict
    plan: MemoryPlan
    same_objective: bool = True

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.changes.items())


def fitting(settings: PlanSettings, shape: ModelShape, device: DeviceMemory, split_exact: bool,
            lora_shape: ModelShape | None = None, limit: int = 3) -> list[Fit]:
    """Up to `limit` settings that fit `device` with the same objective, cheapest first (decision 3), then LoRA
    (with `lora_shape`, the model with a default adapter) if it fits."""
    found = []
    for candidate in _candidates(settings, split_exact):
        plan = plan_memory(candidate, shape)
        if plan.device_bytes <= device.total_bytes:
            found.append(Fit(_changes(settings, candidate), plan))
            if len(found) == limit:
                break
    if lora_shape is not None and not shape.adapter_parameters:
        for candidate in [settings, *_candidates(settings, split_exact)]:
            plan = plan_memory(candidate, lora_shape)
            if plan.device_bytes <= device.total_bytes:
                found.append(Fit({"use_peft": True, **_changes(settings, candidate)}, plan, same_objective=False))
                break
    return found


def _candidates(settings: PlanSettings, split_exact: bool) -> list[PlanSettings]:
    """Decision 3: every combination of at most one pull of each lever, cheapest first (ties: table order)."""
    options = [[(None, 1.0), *((pull, lever.cost(settings, pull)) for pull in lever.pulls(settings, split_exact))]
               for lever in levers.LEVERS if lever.fits and levers.allowed(lever, settings)]
    scored = []
    for combination in itertools.product(*options):
        pulls = [pull for pull, _ in combination if pull is not None]
        if pulls:
            cost = math.prod(cost for _, cost in combination)
            scored.append((cost, len(scored), levers.apply(settings, {k: v for p in pulls for k, v in p.items()})))
    return [candidate for _, _, candidate in sorted(scored, key=lambda entry: entry[:2])]


def _changes(settings: PlanSettings, candidate: PlanSettings) -> dict:
    """The GRPOConfig fields that turn `settings` into `candidate`."""
    return levers.config_changes({name: levers.value_of(candidate, name) for name in levers.FIELDS
                                  if levers.value_of(candidate, name) != levers.value_of(settings, name)})
