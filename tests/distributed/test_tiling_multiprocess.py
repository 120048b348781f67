"""modeling/tiling.py's memory levers under every launch the memory planner may propose them under: the
sequence-tiled MLP and norms (`mlp_tile_tokens`) and the recomputed attention (`recompute_attention`), both on in one
launch per mode (DDP, ZeRO-2, ZeRO-3, FSDP2: conftest.py's `*_tiling` modes), trained with SGD (lr 0.1, where a
gradient's size shows in the weights; Adam would turn float noise in near-zero gradients into full-size steps).

Each launch is checked three ways:

1. Both levers really ran on every process: counted tiled backwards (and tiles that split every micro-batch), the
   attention's calls one row each (ZeRO-3: whole, by tiling.py's decision 7) and recomputed in the backward.
2. The same run as the 1-process run without either lever over the same global batch (`run_reference(False,
   sgd=True)`): the logged loss per step, every row's log-probs (policy and reference) at each step,
   and the weights after the 3 SGD steps, within float32 rounding, while training moved them far more than that.
3. The same forward as the same mode's untiled launch (conftest.py's MODES, AdamW) before its first optimizer step,
   where the optimizer does not matter yet: each process's log-probs and the first logged entropy.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import EXTRA_MODES, MLP_TILE

pytestmark = pytest.mark.distributed

TILING_MODES = [name for name in EXTRA_MODES if name.endswith("_tiling")]
LAYERS = 2  # the tiny policy's decoder layers
# Float32 rounding, with room: seen (every mode, against the 1-process run) <= 9.6e-7 for log-probs of about -5,
# 6e-8 for losses of 0.09-0.19, 7.5e-9 for the weights after 3 SGD steps (which moved the MLP's by 7.5e-4).
# LOGP_TOL also bounds the logged entropy (about 4.6).
LOGP_TOL = 1e-5
LOSS_TOL = 1e-6
PARAM_TOL = 1e-6


def _params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "params.pt")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _logprobs(result: dict, kind: str, step: int | None = None) -> dict[str, list[float]]:
    """Every process's recorded log-probs of `kind` ("policy" or "no_grad"), keyed by step and tokens (harness.py's
    `_recording_logprobs`); with `step`: only those scored at that optimizer step."""
    rows = {k: v for rank in result["ranks"] for k, v in rank["logprobs"][kind].items()}
    return {k: v for k, v in rows.items() if step is None or k.split(":")[0] == str(step)}


def _assert_logprobs_match(rows: dict, reference: dict) -> None:
    assert rows.keys() == reference.keys()
    worst = max(abs(a - b) for k in rows for a, b in zip(rows[k], reference[k], strict=True))
    assert worst < LOGP_TOL, worst


def _logged(result: dict, key: str) -> list[float]:
    """`key` as the main process logged it at each of the 3 steps."""
    return [h[key] for h in result["log_history"] if "reward" in h]


@pytest.mark.parametrize("name", TILING_MODES)
def test_both_levers_ran_on_every_process(name, run_mode, run_reference):
    """Per process, over 3 steps x 2 micro-steps of 3 rows: each policy backward of the tiled modules (each layer's
    MLP and its two norms, and the final norm; ZeRO-3 partitions the norms' weights, so there the MLPs only)
    recomputed them over more tiles than a micro-batch has rows (>= 30 tokens: >= 8 tiles of MLP_TILE); the
    attention ran a row per call (ZeRO-3: whole micro-batches) and, under activation checkpointing, ran again twice
    in the backward (the layer's recomputation, then the attention's own). The 1-process reference ran neither."""
    result, _ = run_mode(name)
    mode = EXTRA_MODES[name]
    assert result["num_processes"] == 2 and result["distributed_type"] == mode.distributed_type
    assert mode.wrapper in result["wrapped_mro"], result["wrapped_mro"]
    assert result["zero3"] == name.startswith("zero3")
    rank0, rank1 = result["ranks"]
    assert rank0["digest"] == rank1["digest"], "the processes ended with different parameters"
    for rank in result["ranks"]:
        rows = rank["logprobs"]["policy_rows"]
        assert rank["checkpointing"] and rows == [3] * 3 * 2, rows
        tiled, attention = rank["tiled_mlp"], rank["recomputed_attention"]
        assert tiled["backwards"] == len(rows) * (LAYERS if result["zero3"] else 3 * LAYERS + 1), tiled
        assert tiled["tiles"] >= math.ceil(3 * 10 / MLP_TILE) * tiled["backwards"], tiled
        per_call = max(rows) if result["zero3"] else 1
        assert attention["forward_calls"] == LAYERS * sum(rows) // per_call, attention
        assert attention["forward_rows"] == LAYERS * sum(rows), attention
        assert attention["forward_max_rows"] == attention["backward_max_rows"] == per_call, attention
        assert attention["backward_calls"] == 2 * attention["forward_calls"], attention
    reference, _ = run_reference(False, sgd=True)
    untouched = reference["ranks"][0]
    assert untouched["tiled_mlp"]["backwards"] == 0 and not any(untouched["recomputed_attention"].values())


@pytest.mark.parametrize("name", TILING_MODES)
def test_loss_logprobs_and_weights_match_the_single_process_run_without_them(name, run_mode, run_reference,
                                                                             model_dir):
    """The loss logged at each of the 3 steps, each row's log-probs at each step (the policy's, with a graph, and
    the reference model's) and every parameter after the 3 SGD steps equal the untiled 1-process run's; training
    moved the MLP's and the attention's weights by more than 100 x the tolerance, so the match is not vacuous.
    On-policy the loss's value is -mean advantage + beta x KL whatever the forward computed (its ratio is
    exp(logp - logp.detach())); the log-probs are the forward's own values (the harness's sampler stands in for
    none). The logged entropy and KL are means of the processes' own means, not the 1-process run's."""
    from safetensors.torch import load_file

    result, out = run_mode(name)
    reference, ref_out = run_reference(False, sgd=True)
    losses, expected = _logged(result, "loss"), _logged(reference, "loss")
    assert len(losses) == len(expected) == 3
    assert losses == pytest.approx(expected, abs=LOSS_TOL)
    for kind in ("policy", "no_grad"):
        _assert_logprobs_match(_logprobs(result, kind), _logprobs(reference, kind))
    params, ref = _params(out), _params(ref_out)
    assert _max_diff(params, ref) < PARAM_TOL
    initial = load_file(model_dir / "policy" / "model.safetensors")
    for part in (".mlp.", ".self_attn."):
        trained = [k for k in initial if part in k]
        assert trained and max((ref[k] - initial[k]).abs().max().item() for k in trained) > 100 * PARAM_TOL, part


@pytest.mark.parametrize("name", TILING_MODES)
def test_the_first_forwards_match_the_untiled_launch_of_the_mode(name, run_mode):
    """Before the first optimizer step (SGD here, AdamW there: not yet a difference) the untiled launch of the same
    mode scored the same rows on the same processes: equal log-probs, policy and reference, and the first logged
    entropy (the mean of the two processes' own means)."""
    result, _ = run_mode(name)
    untiled, _ = run_mode(name.removesuffix("_tiling"))
    for kind in ("policy", "no_grad"):
        rows = _logprobs(result, kind, step=0)
        assert len(rows) == 12  # the first round's rows, over both processes
        _assert_logprobs_match(rows, _logprobs(untiled, kind, step=0))
    assert _logged(result, "entropy")[0] == pytest.approx(_logged(untiled, "entropy")[0], abs=LOGP_TOL)
