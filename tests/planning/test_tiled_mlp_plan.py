"""The planner's sequence tiling (`mlp_tile_tokens`), by hand on the small shape: E 64, I 128, float32, 4 rows of
16 tokens, full training.

Per token and layer the MLP keeps (`activation_bytes_per_token`) its input, the norm's output shared by gate and up
(64 x 4 = 256 B), and gate, up, act(gate) x up and down's input ((3 + 1) x 128 x 4 = 2,048 B): 2,304 B. Tiled it keeps
the norm's input instead of its own (the norm keeps it already), rebuilding its input per tile: 2,304 B less; each
of the 2 norms keeps its input and not its normalised input (64 x 4 = 256 B): 512 B less; 2,816 B less per token,
4 x 16 = 64 tokens: 180,224 B less per layer. The MLP's backward holds one
tile's 2,304 B per token (8 tokens: 18,432 B) and the sums of gate/up/down's gradients (3 x 64 x 128 x 4 = 98,304 B)."""

import dataclasses

from grpo_trainer.planning import estimate, plan_memory
from tests.planning.shapes import SETTINGS, SHAPE, rollout

TILED = SETTINGS.with_forward(mlp_tile_tokens=8)


def test_the_saving_and_the_transient_by_hand():
    assert estimate.tiling_saving_per_token(SETTINGS, SHAPE) == 0  # off
    assert estimate.tiling_saving_per_token(TILED, SHAPE) == 2_816
    # ZeRO-3 partitions the norms' weights: they are not tiled (`modeling.tiling._is_norm`), the MLP is and keeps
    # its input
    assert estimate.tiling_saving_per_token(dataclasses.replace(TILED, zero_stage=3), SHAPE) == 2_048
    # frozen norms (an adapter) keep no normalised input untiled: the MLP's 2,304 B alone
    assert estimate.tiling_saving_per_token(TILED, dataclasses.replace(SHAPE, norms_trained=False)) == 2_304
    assert estimate.tiled_mlp_transient(TILED, SHAPE, rows=4) == 8 * 2_304 + 98_304
    lora = dataclasses.replace(SHAPE, adapter_parameters=1_000)  # adapter gradients are not counted
    assert estimate.tiled_mlp_transient(TILED, lora, rows=4) == 8 * 2_304
    # a tile larger than the micro-batch holds the micro-batch: 64 tokens
    assert estimate.tiled_mlp_transient(SETTINGS.with_forward(mlp_tile_tokens=1000), SHAPE, 4) \
        == 64 * 2_304 + 98_304


def test_checkpointed_recomputation_holds_one_tile_of_the_mlp():
    """Checkpointing: the recomputed layer keeps 180,224 B less, its untiled MLP backward's intermediate gradient
    (64 tokens x 128 x 4 B = 32,768 B) is gone, and the tile's 116,736 B are there: 96,256 B less; the checkpointed
    inputs are unchanged."""
    saved, recompute, *_ = estimate._saved_activations(SETTINGS, SHAPE)
    tiled_saved, tiled_recompute, *_ = estimate._saved_activations(TILED, SHAPE)
    assert tiled_saved == saved and recompute - tiled_recompute == 180_224 + 32_768 - 116_736


def test_without_checkpointing_every_layer_keeps_less():
    """2 layers x 180,224 B less saved; the backward's transient is the tile (116,736 B), not the untiled MLP's
    intermediate gradient (32,768 B)."""
    plain = dataclasses.replace(SETTINGS, checkpointing=False)
    saved, recompute, *_ = estimate._saved_activations(plain, SHAPE)
    tiled_saved, tiled_recompute, *_ = estimate._saved_activations(plain.with_forward(mlp_tile_tokens=8),
                                                                    SHAPE)
    assert saved - tiled_saved == 2 * 180_224 and recompute == 32_768 and tiled_recompute == 116_736


def test_the_scoring_forward_holds_one_tile_of_gate_up_and_product():
    """beta 0.04 (a reference forward): gate, up and their product for 8 tokens instead of 64: (64 - 8) x 3 x 128 x
    4 = 86,016 B less; the rollout's prefill (not a log-prob forward) is untiled."""
    beta, tiled_beta = (dataclasses.replace(s, beta=0.04, rollout=rollout("generate")) for s in (SETTINGS, TILED))
    items = {i.name: i for i in plan_memory(beta, SHAPE).items}
    tiled_items = {i.name: i for i in plan_memory(tiled_beta, SHAPE).items}
    scoring = estimate.INSTANTS.index("scoring")
    assert items["scoring forward"].bytes[scoring] - tiled_items["scoring forward"].bytes[scoring] == 86_016
    assert items["generation working set"].bytes == tiled_items["generation working set"].bytes


def test_recomputed_attention_by_hand():
    """recompute_attention: a layer keeps none of its attention's queries, keys and values at 4 heads x 16 (3 x 64 x
    4 B), log-sum-exp (4 x 4 B) and o_proj's input (64 x 4 B): 1,040 B per token. Checkpointed, 4 x 16 tokens: the
    recomputed layer holds 64 x 1,040 = 66,560 B less; the attention's own recomputation (one row at a time: its
    1,040 B per token of one row of 16, and the norm's output it reads, 256 B per token of all 4 rows: 16 x 1,040 +
    64 x 256 = 33,024 B) is smaller than the rest of the layer. Without checkpointing each of the 2 layers keeps
    66,560 B less, and the backward rebuilds one row's attention: 33,024 B, more than the MLP backward's
    intermediate gradient (64 x 128 x 4 B = 32,768 B)."""
    on = SETTINGS.with_forward(recompute_attention=True)
    assert SHAPE.output_input_kept
    saved, recompute, *_ = estimate._saved_activations(SETTINGS, SHAPE)
    on_saved, on_recompute, *_ = estimate._saved_activations(on, SHAPE)
    assert on_saved == saved and recompute - on_recompute == 66_560
    plain, plain_on = (dataclasses.replace(s, checkpointing=False) for s in (SETTINGS, on))
    saved, recompute, *_ = estimate._saved_activations(plain, SHAPE)
    on_saved, on_recompute, *_ = estimate._saved_activations(plain_on, SHAPE)
    assert saved - on_saved == 2 * 66_560 and recompute == 32_768 and on_recompute == 33_024
