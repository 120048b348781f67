"""The inference engine's importance-sampling correction against hand-derived numbers (TRL 1.16's four modes and its
`sampling/*` metrics).

Inputs shared by the tests (B = 2 completions, T = 3 tokens; the second completion has 2 tokens):
    old    = [[-1.0, -2.0, -0.5], [-0.1, -0.7, -1.2]]      trainer log-probs at the sampling weights
    engine = [[-1.5, -1.0,  NaN], [-0.3, -0.2, -3.0]]      the engine's (NaN: a token it could not score)
    mask   = [[1, 1, 1], [1, 1, 0]]
    log rho = (old - engine) * mask, NaN -> 0 = [[0.5, -1.0, 0.0], [0.2, -0.5, 0.0]]
    rho     = [[e^0.5, e^-1, 1], [e^0.2, e^-0.5, 1]] = [[1.648721, 0.367879, 1], [1.221403, 0.606531, 1]]
    per completion: sum log rho = [-0.5, -0.3] -> rho = [0.606531, 0.740818]
"""

import math

import pytest
import torch

from grpo_trainer.algorithms.engine_correction import (
    CROSS_PROCESS,
    IS_MODES,
    engine_importance_ratio,
    engine_log_ratio,
    engine_mismatch_metrics,
)
from tests.algorithms.numeric import F64, close

NAN = math.nan
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.7, -1.2]], dtype=F64)
ENGINE = torch.tensor([[-1.5, -1.0, NAN], [-0.3, -0.2, -3.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)




def test_log_ratio_per_token_and_per_sequence():
    close(engine_log_ratio(OLD, ENGINE, MASK, "token_mask"), [[0.5, -1.0, 0.0], [0.2, -0.5, 0.0]])
    close(engine_log_ratio(OLD, ENGINE, MASK, "sequence_truncate"), [[-0.5], [-0.3]])


def test_token_truncate_clamps_each_token():
    # [0.5, 1.5]: 1.648721 -> 1.5, 0.367879 -> 0.5; the rest inside
    ratio = engine_importance_ratio(OLD, ENGINE, MASK, "token_truncate", 0.5, 1.5)
    close(ratio, [[1.5, 0.5, 1.0], [1.221403, 0.606531, 1.0]])


def test_token_truncate_with_one_bound():
    # clip_min None: only the upper bound 1.2 applies (1.648721 -> 1.2, 1.221403 -> 1.2)
    ratio = engine_importance_ratio(OLD, ENGINE, MASK, "token_truncate", None, 1.2)
    close(ratio, [[1.2, 0.367879, 1.0], [1.2, 0.606531, 1.0]])


def test_token_mask_zeroes_tokens_outside_the_band():
    # [0.5, 1.5]: 1.648721 and 0.367879 are outside -> 0
    ratio = engine_importance_ratio(OLD, ENGINE, MASK, "token_mask", 0.5, 1.5)
    close(ratio, [[0.0, 0.0, 1.0], [1.221403, 0.606531, 1.0]])


def test_sequence_modes_weigh_whole_completions():
    # per-completion rho [0.606531, 0.740818]; truncate to [0.7, 3.0] -> [0.7, 0.740818]; mask below 0.7 -> [0, ...]
    close(engine_importance_ratio(OLD, ENGINE, MASK, "sequence_truncate", 0.7, 3.0), [[0.7], [0.740818]])
    close(engine_importance_ratio(OLD, ENGINE, MASK, "sequence_mask", 0.7, None), [[0.0], [0.740818]])


def test_the_ratio_is_not_differentiated():
    old = OLD.clone().requires_grad_(True)
    assert not engine_importance_ratio(old, ENGINE, MASK, "token_truncate", None, 3.0).requires_grad


def test_unknown_mode_is_refused_by_name():
    assert IS_MODES == ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    with pytest.raises(ValueError, match="unknown vllm_importance_sampling_mode 'tokens'"):
        engine_log_ratio(OLD, ENGINE, MASK, "tokens")


def test_metrics_token_mode():
    # |old - engine| on scored tokens (mask 1, not NaN): [0.5, 1.0] and [0.2, 0.5] -> mean 2.2 / 4 = 0.55, max 1.0
    # rho (token_truncate [0.5, 1.5]) on completion tokens: [1.5, 0.5, 1.0, 1.221403, 0.606531]
    #   min 0.5, max 1.5, mean 4.827934 / 5 = 0.965587 (the NaN token counts with rho 1, as in TRL)
    ratio = engine_importance_ratio(OLD, ENGINE, MASK, "token_truncate", 0.5, 1.5)
    metrics = engine_mismatch_metrics(OLD, ENGINE, ratio, MASK, "token_truncate")
    close(metrics["sampling/sampling_logp_difference/mean"], 0.55)
    close(metrics["sampling/sampling_logp_difference/max"], 1.0)
    close(metrics["sampling/importance_sampling_ratio/min"], 0.5)
    close(metrics["sampling/importance_sampling_ratio/mean"], 0.965587)
    close(metrics["sampling/importance_sampling_ratio/max"], 1.5)


def test_metrics_sequence_mode_count_completions():
    # sequence_mask, clip_min 0.7: rho per completion [0, 0.740818] -> min 0, mean 0.370409, max 0.740818
    ratio = engine_importance_ratio(OLD, ENGINE, MASK, "sequence_mask", 0.7, None)
    metrics = engine_mismatch_metrics(OLD, ENGINE, ratio, MASK, "sequence_mask")
    close(metrics["sampling/importance_sampling_ratio/min"], 0.0)
    close(metrics["sampling/importance_sampling_ratio/mean"], 0.370409)
    close(metrics["sampling/importance_sampling_ratio/max"], 0.740818)


def test_metrics_with_nothing_to_measure_are_zero():
    mask = torch.zeros_like(MASK)
    ratio = engine_importance_ratio(OLD, ENGINE, mask, "token_mask", None, 3.0)
    metrics = engine_mismatch_metrics(OLD, ENGINE, ratio, mask, "token_mask")
    assert all(float(v) == 0.0 for v in metrics.values())


def test_cross_process_reductions():
    # three processes' values [NaN, 0.5, 2.0]: the ratio statistics skip NaN -> min 0.5, mean 1.25, max 2.0;
    # the differences are a plain mean / max of [0.25, 0.5, 0.75] -> 0.5 and 0.75
    values = torch.tensor([NAN, 0.5, 2.0], dtype=F64)
    close(CROSS_PROCESS["sampling/importance_sampling_ratio/min"](values), 0.5)
    close(CROSS_PROCESS["sampling/importance_sampling_ratio/mean"](values), 1.25)
    close(CROSS_PROCESS["sampling/importance_sampling_ratio/max"](values), 2.0)
    diffs = torch.tensor([0.25, 0.5, 0.75], dtype=F64)
    close(CROSS_PROCESS["sampling/sampling_logp_difference/mean"](diffs), 0.5)
    close(CROSS_PROCESS["sampling/sampling_logp_difference/max"](diffs), 0.75)
    assert math.isnan(float(CROSS_PROCESS["sampling/importance_sampling_ratio/min"](torch.full((2,), NAN))))
