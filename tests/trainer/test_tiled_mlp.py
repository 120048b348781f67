"""`mlp_tile_tokens` and `recompute_attention` in a real run: one SGD step with the sequence-tiled MLP and norms, and
with each attention block recomputed, moves the weights as the plain run's (float32 rounding), with activation
checkpointing (the tiles and the attention recomputed in the backward); a bad value is refused by name before
anything is loaded."""

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from tests.helpers import sgd_step_args, sgd_step_deltas


def test_a_tiled_step_equals_the_untiled_one(tmp_path, tokenizer, monkeypatch):
    from grpo_trainer.modeling import tiling

    tiles = []
    backward = tiling.TiledMLP.backward
    monkeypatch.setattr(tiling.TiledMLP, "backward", staticmethod(lambda ctx, grad: tiles.append(ctx.tokens)
                                                                  or backward(ctx, grad)))
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    untiled = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "untiled"))
    assert tiles == []
    # tiles of 5 tokens: many, uneven
    tiled = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "tiled", mlp_tile_tokens=5))
    assert tiles and set(tiles) == {5}  # the tiled MLP's backward ran (each layer, each micro-batch)
    mlp = [n for n in untiled if "mlp" in n]
    assert mlp and max(untiled[n].abs().max().item() for n in mlp) > 1e-4  # the MLP's weights moved
    for name in untiled:
        torch.testing.assert_close(tiled[name], untiled[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("value", [-1, 2.5])
def test_a_bad_tile_is_refused_by_name(tmp_path, value):
    with pytest.raises(ValueError, match="mlp_tile_tokens must be an integer >= 0"):
        sgd_step_args(tmp_path, mlp_tile_tokens=value)


def test_a_step_with_recomputed_attention_equals_the_plain_one(tmp_path, tokenizer, monkeypatch):
    """recompute_attention=True, with and without the tiles: the attention's checkpoint recomputed it in the backward
    (its forward ran twice per layer and micro-batch in the loss forward's backward), the weights moved as the
    plain run's."""
    import torch.utils.checkpoint

    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda function, *args, **kwargs: calls.append(function.__name__) or
                        checkpoint(function, *args, **kwargs))
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    plain = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "plain"))
    assert "checkpointed_attention" not in calls
    for name, options in (("recomputed", {}), ("recomputed_tiled", {"mlp_tile_tokens": 5})):
        moved = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / name, recompute_attention=True, **options))
        assert calls.count("checkpointed_attention") > 0  # the attention ran under its own checkpoint
        calls.clear()
        attention = [n for n in plain if "self_attn" in n]
        assert attention and max(plain[n].abs().max().item() for n in attention) > 1e-4
        for key in plain:
            torch.testing.assert_close(moved[key], plain[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
