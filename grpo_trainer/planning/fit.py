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
3. Candidates are tried cheapest first by their step-time costs (`CHECKPOINTING_COST`, `TILED_MLP_COST`,
   `RECOMPUTED_ATTENTION_COST`, `OFFLOADING_COST`, multiplied, times the micro-steps; a lower vLLM fraction adds a
   constant); the first that fits is `auto_find_batch_size`'s choice.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from grpo_trainer.algorithms.losses import LOSS_TYPES
from grpo_trainer.planning.estimate import MemoryPlan, plan_memory
from grpo_trainer.planning.longest import LONGER_MLP_TILE
from grpo_trainer.planning.settings import DeviceMemory, ModelShape, PlanSettings

__all__ = ["SPLIT_EXACT", "Fit", "fitting", "split_is_exact"]

# Decision 3's costs, in step time relative to the run as asked (only their order matters). Checkpointing: one more
# forward of every layer. The tiled MLP: 1.24x / 1.42x the layers' forward and backward at 2k / 4k tokens (benchmarks/
# RESULTS.md, "The sequence-tiled MLP's price"). Offloading: its copies run on a side stream beside the
# compute; not measured (no GPU yet), ranked after checkpointing and before a 2-way split.
CHECKPOINTING_COST = 1.33
TILED_MLP_COST = 1.4
# The recomputed attention: one more attention forward per layer, where checkpointing runs 4 units of attention work
# (forward, recomputation, a backward of 2): at most +25% of the layers' time, less the MLP's share.
RECOMPUTED_ATTENTION_COST = 1.25
OFFLOADING_COST = 1.5

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
    splits = [k for k in range(1, settings.micro_batch + 1) if settings.micro_batch % k == 0] if split_exact else [1]
    checkpointing = [settings.checkpointing] + ([] if settings.checkpointing else [True])
    fractions = [settings.vllm_memory_fraction] + _lower_fractions(settings)
    tiles = [settings.mlp_tile_tokens] + ([] if settings.mlp_tile_tokens else [LONGER_MLP_TILE])
    offloading = [settings.activation_offloading] + \
        ([True] if settings.device == "cuda" and not settings.activation_offloading else [])
    recomputes = [settings.recompute_attention] + \
        ([True] if not settings.recompute_attention and settings.sequence_parallel == 1 else [])
    scored = []
    for k, ckpt, fraction, tile, offload, recompute in itertools.product(splits, checkpointing, fractions, tiles,
                                                                          offloading, recomputes):
        cost = k * (CHECKPOINTING_COST if ckpt != settings.checkpointing else 1.0) \
            * (TILED_MLP_COST if tile != settings.mlp_tile_tokens else 1.0) \
            * (RECOMPUTED_ATTENTION_COST if recompute != settings.recompute_attention else 1.0) \
            * (OFFLOADING_COST if offload != settings.activation_offloading else 1.0) \
            + (fraction != settings.vllm_memory_fraction) * 0.5
        candidate = dataclasses.replace(
            settings, micro_batch=settings.micro_batch // k, accumulation_steps=settings.accumulation_steps * k,
            steps_per_generation=settings.steps_per_generation * k, checkpointing=ckpt,
            vllm_memory_fraction=fraction, mlp_tile_tokens=tile, activation_offloading=offload,
            recompute_attention=recompute)
        if candidate != settings:
            scored.append((cost, len(scored), candidate))
    return [candidate for _, _, candidate in sorted(scored)]


def _lower_fractions(settings: PlanSettings) -> list[float]:
    """Smaller engine fractions, in steps of 0.05 down to 0.1 (an engine in the process, on a GPU only)."""
    if settings.rollout.cache != "engine" or settings.device != "cuda":
        return []
    steps = int(round(settings.vllm_memory_fraction * 20))
    return [step / 20 for step in range(steps - 1, 1, -1)]


def _changes(settings: PlanSettings, candidate: PlanSettings) -> dict:
    """The GRPOConfig fields that turn `settings` into `candidate`."""
    names = {"micro_batch": "per_device_train_batch_size", "accumulation_steps": "gradient_accumulation_steps",
             "steps_per_generation": "steps_per_generation", "checkpointing": "gradient_checkpointing",
             "vllm_memory_fraction": "vllm_gpu_memory_utilization", "mlp_tile_tokens": "mlp_tile_tokens",
             "activation_offloading": "activation_offloading", "recompute_attention": "recompute_attention"}
    return {field: getattr(candidate, name) for name, field in names.items()
            if getattr(candidate, name) != getattr(settings, name)}
