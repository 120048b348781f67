"""An inference engine's importance-sampling correction, applied to a generation round (TRL 1.16's
`vllm_importance_sampling_correction`, math in `algorithms.engine_correction`).

Decisions:

1. The correction needs the trainer's log-probs at the sampling weights, pi_old. As in TRL, they are computed for
   the whole round right after it is sampled (one no-grad forward). Off-policy they are the round's old log-probs,
   so no micro-batch computes them again; on-policy they are dropped after use, since the loss's own detached
   values equal them.
2. The weight is stored per token `[B, T]` (a sequence mode's one weight per completion repeated over its tokens),
   so it travels, trims and shuffles with the round like every completion column.
3. The metrics are this process's values; the trainer reduces them across processes with `CROSS_PROCESS`.

Shapes: `B` rows, `T` completion tokens.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from grpo_trainer.algorithms.engine_correction import (
    EngineCorrection,
    engine_importance_ratio,
    engine_mismatch_metrics,
)
from grpo_trainer.trainer.round import Round

__all__ = ["apply_engine_correction"]


def apply_engine_correction(round_: Round, old_logps: Tensor, correction: EngineCorrection, on_policy: bool
                            ) -> tuple[Round, dict[str, Tensor]]:
    """`round_` with its engine importance weights (and, off-policy, `old_logps` `[B, T]` kept as its old
    log-probs), and this process's `sampling/*` metric values."""
    mode, mask = correction.mode, round_.loss_mask.float()  # TRL: completion x tool mask
    engine = round_.engine_logps
    ratio = engine_importance_ratio(old_logps, engine, mask, mode, correction.clip_min, correction.clip_max)
    values = engine_mismatch_metrics(old_logps, engine, ratio, mask, mode)
    corrected = dataclasses.replace(round_, engine_ratio=ratio.expand_as(mask).contiguous(),
                                    old_logps=None if on_policy else old_logps)
    return corrected, values
