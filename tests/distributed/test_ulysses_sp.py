"""DeepSpeed's Ulysses sequence parallelism (ALST) runs on CPU over gloo and is exact (see ulysses_run.py).

This is the engine, on a tiny Qwen2, and GRPO's sequence-parallel layout over it
(grpo_trainer/modeling/sequence_parallel.py); the trainer's runs with sp_size=2 are in test_multiprocess.py (modes
ddp_sp, ddp_sp_grpo); docs/DISTRIBUTED.md, "Sequence parallelism (DeepSpeed Ulysses)".
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.distributed.conftest import accelerate_launch, launch_env

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_ulysses_attention_on_two_cpu_processes_equals_the_unsharded_model(tmp_path):
    script = Path(__file__).with_name("ulysses_run.py")
    log = tmp_path / "launch.log"
    code, _ = accelerate_launch("ddp.yaml", ["--out", str(tmp_path)], launch_env({"ACCELERATE_USE_CPU": "true"}), log,
                                script=script)
    assert code == 0, log.read_text(errors="replace")[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for r in ranks:
        assert (r["num_processes"], r["sp_world_size"], r["local_positions"]) == (2, 2, 6)
        # Per-token log-probs of the 12 positions, 6 per process, gathered: equal to the unsharded model's
        # (magnitudes up to ~5 nats) within float32 rounding.
        assert r["logp_max_diff"] <= 1e-5 and r["logp_scale"] > 1.0
        # The gradient of the group's weighted token sum (each process's half summed over the group) equals the
        # unsharded one for every parameter (largest entry ~3), and every parameter gets one.
        assert r["grad_max_diff"] <= 1e-5 and r["grad_scale"] > 0.1 and r["grads_nonzero"]
    # The control: positions 6..11 scored alone (no exchange) miss positions 0..5 and differ clearly; so the
    # equality above comes from Ulysses' all-to-all, not from each half being enough on its own. Positions 0..5
    # alone are exact (causal attention never looks ahead).
    assert ranks[1]["alone_logp_diff"] > 1e-2
    assert ranks[0]["alone_logp_diff"] <= 1e-5
    # Padding, the reason GRPO refuses sp_size > 1: row 0 with 3 left pads (GRPO left-pads prompts). Ulysses drops
    # the attention mask, so its real tokens attend to the pads and their log-probs move (seen: 0.38 nats); the
    # same row left-aligned (pads trailing, never attended to under causal attention) is exact.
    for r in ranks:
        assert r["padded_logp_diff"]["left_padded"] > 1e-2
        assert r["padded_logp_diff"]["left_aligned"] <= 1e-5
    # GRPO's layout through grpo_trainer.modeling.sequence_parallel: a left-padded 11-column micro-batch (5 prompt,
    # 6 completion columns) left-aligned and padded to 12, 6 positions per process, gathered back differentiably:
    # the 12 completion log-probs equal the padded, masked forward's and the group's gradient of a weighted sum of
    # them (each process's, summed) equals the unsharded one.
    for r in ranks:
        layout = r["grpo_layout"]
        assert (layout["width"], layout["real_tokens"]) == (12, 12)
        assert layout["logp_diff"] <= 1e-5 and layout["logp_scale"] > 1.0
        assert layout["grad_diff"] <= 1e-5 and layout["grad_scale"] > 0.1
    # The scoring call the trainer uses (sharded_scores: Ulysses only around the forward) gives the same for the
    # 2-row micro-batch, and for a 1-row one after it (an instance per row count); the plain attention is back
    # afterwards (the 1-row reference was computed between the calls, with the mask). Through the chunked LM head
    # (one forward), in several chunks too, from the model's own logits when one process's head check fails (both
    # processes then ran a second forward, else the group would hang), and with the sequence-tiled MLP.
    for r in ranks:
        scorer = r["scorer"]
        for case in ("two_rows", "chunked", "own_logits", "tiled"):
            assert scorer[case]["logp_diff"] <= 1e-5 and scorer[case]["grad_diff"] <= 1e-5, case
        assert scorer["one_row"]["logp_diff"] <= 1e-5
        assert [scorer[case]["forwards"] for case in ("two_rows", "chunked", "own_logits")] == [1, 1, 2]
        # the MLP saw the slice's 6 positions of each row at once ([2, 6, I]), and tiled: the 12 tokens 4 at a time
        assert scorer["two_rows"]["mlp_rows"] == [6] and scorer["tiled"]["mlp_rows"] == [4]
