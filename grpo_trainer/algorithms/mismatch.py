"""Where a sampler and the trainer disagree: the differences of their log-probs of the sampled tokens, summarised by
completion position and by token, and the likely cause. Pure tensor functions and rules; `trainer.mismatch` gathers
them over processes, logs them and names the cause.

Every framework corrects sampler/trainer mismatch (TIS, MIS, IcePop; `engine_correction`); this says where it comes
from. The difference is delta = log pi_trainer - log pi_sampler per sampled token, both at the same weights; a
token neither scored (NaN: an engine gave no value) is left out.

Decisions:

1. Positions are bucketed by powers of four (`POSITION_BUCKETS`: 0-15, 16-63, 64-255, 256-1023, 1024+): a
   disagreement that grows along the completion (a cache or position-encoding difference) shows as a trend over
   the buckets, one that does not (rounding) stays flat.
2. Tokens are summarised by id (count, mean and max |delta|), and the worst single tokens are kept with their place
   (row, position), so the report can show each with the text before it.
3. The cause is the first rule of `CAUSES` that holds, each a same-signature predicate over `MismatchFacts`, in
   order of how surely the facts identify it:
   - truncated support: the sampler drew from a top-k / top-p / min-p truncated softmax, the trainer scored the
     full one, and the mass the truncation cut explains at least half the mean |delta| (the log-prob difference it
     alone causes is exactly -log p(kept), `algorithms.truncation`);
   - stale weights: the weights changed since the first measured round, and the mean |delta| grew past
     `STALE_FACTOR` times what that round showed (a sampler that does not get new weights agrees at first, then
     drifts with every update; rounding and kernels disagree from the start, growing only with the logits' scale).
     A sampler whose rounding already hides the first updates' drift is named by the next rules instead; the
     per-round files show the trend;
   - dtype: the sampler computes in another floating-point type than the trainer;
   - kernel difference: none of the above (the same weights and dtype through other kernels: attention, fused or
     reordered reductions).

Shapes: `B` completions, `T` completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CAUSES", "POSITION_BUCKETS", "STALE_FACTOR", "MismatchFacts", "bucket_name", "likely_cause",
           "position_buckets", "token_table", "worst_tokens"]

POSITION_BUCKETS = (0, 16, 64, 256, 1024)  # decision 1: the first completion position of each bucket
# decision 3: a sampler left on old weights drifts by what each update moves (orders of magnitude past float32
# kernel noise at once); rounding noise also grows with the logits' scale as training moves them (4x within three
# steps of a randomly initialised toy model at lr 0.05, tests/trainer/test_mismatch_report.py), so 10x, not less.
STALE_FACTOR = 10.0


def bucket_name(index: int) -> str:
    start = POSITION_BUCKETS[index]
    return f"{start}-{POSITION_BUCKETS[index + 1] - 1}" if index + 1 < len(POSITION_BUCKETS) else f"{start}+"


def scored(delta: Tensor, mask: Tensor) -> Tensor:
    """`[B, T]` bool: completion tokens whose difference is known."""
    return mask.bool() & ~torch.isnan(delta)


def position_buckets(delta: Tensor, mask: Tensor) -> Tensor:
    """`[K, 3]` per position bucket (decision 1): sum of |delta|, token count, max |delta| (0 where empty)."""
    known = scored(delta, mask)
    positions = torch.arange(delta.shape[1], device=delta.device)
    bucket = torch.bucketize(positions, torch.tensor(POSITION_BUCKETS[1:], device=delta.device), right=True)
    bucket = bucket.expand_as(delta)  # [B, T]
    size = torch.nan_to_num(delta.abs(), nan=0.0)
    rows = []
    for k in range(len(POSITION_BUCKETS)):
        inside = known & (bucket == k)
        values = size[inside]
        rows.append(torch.stack([values.sum(), inside.sum().to(values.dtype),
                                 values.max() if values.numel() else values.new_zeros(())]))
    return torch.stack(rows)


def token_table(delta: Tensor, mask: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per token id present (decision 2): ids `[U]`, counts `[U]`, sums and maxima of |delta| `[U]`."""
    known = scored(delta, mask)
    ids, inverse = torch.unique(tokens[known], return_inverse=True)
    size = delta.abs()[known]
    counts = torch.bincount(inverse, minlength=ids.numel())
    sums = torch.zeros(ids.numel(), dtype=size.dtype, device=size.device).index_add_(0, inverse, size)
    maxima = torch.zeros_like(sums).scatter_reduce_(0, inverse, size, "amax", include_self=False)
    return ids, counts, sums, maxima


def worst_tokens(delta: Tensor, mask: Tensor, k: int) -> list[tuple[int, int, float]]:
    """The `k` tokens with the largest |delta|: (row, position, delta), largest first (decision 2)."""
    size = torch.where(scored(delta, mask), delta.abs(), -1.0).flatten()
    top = torch.topk(size, min(k, int((size >= 0).sum()))).indices
    T = delta.shape[1]
    return [(int(i) // T, int(i) % T, float(delta.flatten()[i])) for i in top]


@dataclass(frozen=True)
class MismatchFacts:
    """What the cause rules read (decision 3)."""

    mean_delta: float  # mean |delta| over every process's tokens this round
    truncated_unmasked: bool  # the sampler truncated and the trainer scored the full softmax
    mean_cut: float  # mean -log p(kept) over the same tokens (0 without truncation)
    baseline: float | None  # mean |delta| of the first measured round
    weights_changed: bool  # an optimizer step happened since that round
    sampler_dtype: torch.dtype | None  # None: unknown
    trainer_dtype: torch.dtype


Cause = Callable[[MismatchFacts], bool]

CAUSES: dict[str, tuple[Cause, str]] = {
    "truncated support": (
        lambda f: f.truncated_unmasked and f.mean_cut >= 0.5 * f.mean_delta,
        "the sampler drew from a top-k / top-p / min-p truncated softmax and the trainer scored the full one (mean "
        "cut mass {mean_cut:.3g} nats of {mean_delta:.3g}); set keep_sampling_mask=True"),
    "stale weights": (
        lambda f: f.baseline is not None and f.weights_changed and f.mean_delta > STALE_FACTOR * max(f.baseline, 1e-6),
        "the disagreement grew from {baseline:.3g} at the first round to {mean_delta:.3g} after the weights changed: "
        "the sampler is likely still sampling with old weights (check the weight sync)"),
    "dtype": (
        lambda f: f.sampler_dtype is not None and f.sampler_dtype != f.trainer_dtype,
        "the sampler computes in {sampler_dtype} and the trainer in {trainer_dtype}: rounding differences"),
    "kernel difference": (
        lambda f: True,
        "the same weights and dtype computed by other kernels (attention, fused or reordered reductions)"),
}


def likely_cause(facts: MismatchFacts) -> tuple[str, str]:
    """The first cause of `CAUSES` whose rule holds, and its explanation (decision 3)."""
    for name, (holds, explanation) in CAUSES.items():
        if holds(facts):
            return name, explanation.format(**{k: getattr(facts, k) for k in facts.__dataclass_fields__})
    raise AssertionError("unreachable: the last cause always holds")
