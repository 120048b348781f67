"""The sequence-tiled MLP: log-probs and gradients equal the untiled ones (float32 rounding), padded and packed,
full and LoRA, with and without activation checkpointing; what autograd keeps shrinks by the MLP's intermediates;
the model is as before once the forward is done."""

import dataclasses

import pytest
import torch

from grpo_trainer.modeling import forwards, tiling
from grpo_trainer.runtime import compat
from tests.helpers import model_of_kind

ATOL = 1e-5


def _batch(tokenizer, T: int = 40, B: int = 3):
    """Prompts of 5, 3, 6 tokens (S = 6), completions of T, T - 11, T - 3."""
    prompts, completions = torch.tensor([5, 3, 6][:B]), torch.tensor([T, T - 11, T - 3][:B])
    columns = torch.arange(6 + T)
    mask = ((columns >= 6 - prompts[:, None]) & (columns < 6 + completions[:, None])).long()
    ids = torch.randint(10, 90, (B, 6 + T), generator=torch.Generator().manual_seed(0))
    return ids.masked_fill(mask == 0, tokenizer.pad_token_id), mask, T


def _model(tokenizer, lora: bool, checkpointing: bool):
    model = model_of_kind("qwen2", tokenizer, max_position_embeddings=256)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]))
        model.enable_input_require_grads()
    if checkpointing:
        compat.enable_checkpointing(model.get_base_model() if lora else model)
    return model.train()


def _logps_and_grads(model, ids, mask, T, settings):
    forwards._VERDICTS.clear()
    out = forwards.score(model, ids, mask, T, settings, with_entropy=True)
    weights = torch.randn((2, *out.logps.shape), generator=torch.Generator().manual_seed(5)) * mask[:, -T:]
    model.zero_grad()
    ((out.logps * weights[0]).sum() + (out.entropy * weights[1]).sum()).backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_equals_untiled(tokenizer, lora, checkpointing, padding_free):
    """Tiles of 7 tokens (the 3 x 46-token micro-batch in 20 tiles, the last one short): the same log-probs and
    gradients of every trained parameter (the MLP's among them) within float32 rounding."""
    model = _model(tokenizer, lora, checkpointing)
    layers = (model.get_base_model() if lora else model).model.layers
    functions = [layer.__dict__.get("_gradient_checkpointing_func") for layer in layers]
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=padding_free)
    logps, grads = _logps_and_grads(model, ids, mask, T, plain)
    tiled_logps, tiled_grads = _logps_and_grads(model, ids, mask, T, dataclasses.replace(plain, mlp_tile_tokens=7))
    torch.testing.assert_close(tiled_logps, logps, atol=ATOL, rtol=0)
    assert grads.keys() == tiled_grads.keys() and any("mlp" in name for name in grads)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=ATOL, rtol=1e-4, msg=name)
    assert all("forward" not in m.__dict__ for m in model.modules())  # removed after the forward
    assert [layer.__dict__.get("_gradient_checkpointing_func") for layer in layers] == functions


def _saved_bytes(model, ids, mask, T, settings) -> int:
    """Bytes autograd keeps for the backward at the end of the forward (distinct storages; not the weights)."""
    storages, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    forwards._VERDICTS.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forwards.score(model, ids, mask, T, settings)
    return sum(storages.values())


def test_tiling_keeps_the_mlp_and_norm_inputs_only(tokenizer):
    """Without checkpointing each of the 2 layers' MLPs keeps gate, up, act(gate) and act(gate) * up
    (4 x 96 float32 per token) untiled; tiled it keeps its input, already kept as the norm's output: 2 x 4 x 96 x 4 B
    = 3,072 B per token less (the SiLU's input is gate itself). Each of the 5 RMSNorms (2 per layer, the final one)
    keeps its normalised input (64 float32) and its rstd (1 float32) untiled, its input alone tiled: 5 x 65 x 4 B
    = 1,300 B per token less. And each MLP keeps its norm's input (the residual sum, which that norm keeps) in place
    of the norm's output, rebuilt per tile in its backward: 2 x 64 x 4 B = 512 B per token less. 3 x 46 = 138
    tokens: (3,072 + 1,300 + 512) x 138 = 673,992 B."""
    model = _model(tokenizer, lora=False, checkpointing=False)
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=False)
    untiled = _saved_bytes(model, ids, mask, T, plain)
    tiled = _saved_bytes(model, ids, mask, T, dataclasses.replace(plain, mlp_tile_tokens=7))
    assert untiled - tiled == (2 * 4 * 96 * 4 + 5 * 65 * 4 + 2 * 64 * 4) * 3 * 46


def test_tiled_mlp_alone_by_hand():
    """One linear 'MLP' y = x W^T on 5 tokens in tiles of 2: dL/dW = sum over tiles of g_t^T x_t, dL/dx = g W."""
    linear = torch.nn.Linear(3, 2, bias=False)
    x = torch.randn(1, 5, 3, requires_grad=True)
    g = torch.randn(1, 5, 2)
    y = tiling.tiled_mlp(linear, linear.forward, 2)(x)
    torch.testing.assert_close(y, x @ linear.weight.T)
    y.backward(g)
    torch.testing.assert_close(linear.weight.grad, g[0].T @ x[0].detach())
    torch.testing.assert_close(x.grad, g @ linear.weight.detach())


def test_the_backward_recomputes_under_the_forwards_autocast():
    """Under bfloat16 autocast the tiles recomputed in the backward compute in bfloat16 as the forward did (as
    checkpointing's recomputation does), not in the float32 the backward pass runs in."""
    linear = torch.nn.Linear(4, 3)
    dtypes = []

    def forward(tile):  # the module's forward, recording the dtype it computed in
        out = linear(tile)
        dtypes.append(out.dtype)
        return out

    x = torch.randn(1, 5, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiling.tiled_mlp(linear, forward, 2)(x)
    y.float().sum().backward()
    assert dtypes == [torch.bfloat16] * 6  # 3 tiles forward, 3 recomputed
    assert linear.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gpt2_no_dropout", "mixtral", "phi3"])
def test_every_norm_tiles_and_the_gradients_stay_equal(tokenizer, kind, monkeypatch):
    """Per family, with checkpointing: every norm module (Qwen3's per-head q/k norms, Gemma 2's four per layer and
    its (1 + w) scale, GPT-2's biased LayerNorms, the final norm) and each dense MLP runs through `TiledMLP` (a
    Mixtral block's experts do not: not per token), and log-probs and every gradient equal the untiled run's."""
    model = model_of_kind(kind, tokenizer)
    compat.enable_checkpointing(model)
    model.train()
    ran = set()
    forward = tiling.TiledMLP.forward
    monkeypatch.setattr(tiling.TiledMLP, "forward", staticmethod(
        lambda ctx, function, *args: ran.add(function.__self__) or forward(ctx, function, *args)))
    ids, mask, T = _batch(tokenizer, T=20)
    plain = forwards.ForwardSettings(padding_free=False)
    logps, grads = _logps_and_grads(model, ids, mask, T, plain)
    assert not ran
    tiled_logps, tiled_grads = _logps_and_grads(model, ids, mask, T, dataclasses.replace(plain, mlp_tile_tokens=7))
    norms = {m for m in model.modules() if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")}
    assert norms and norms <= ran
    assert any("MLP" in type(m).__name__ for m in ran) == (kind != "mixtral")
    torch.testing.assert_close(tiled_logps, logps, atol=ATOL, rtol=0)
    assert grads.keys() == tiled_grads.keys()
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "lora"])
def test_recomputed_attention_equals_the_plain_forward(tokenizer, kind, checkpointing, padding_free):
    """`recompute_attention` alone and with tiles of 7 tokens (Qwen3's q/k norms tiled inside the recomputed
    attention): the same log-probs and gradients within float32 rounding, and the model as before afterwards."""
    if kind == "qwen3":
        model = model_of_kind("qwen3", tokenizer)
        if checkpointing:
            compat.enable_checkpointing(model)
        model.train()
    else:
        model = _model(tokenizer, lora=kind == "lora", checkpointing=checkpointing)
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=padding_free)
    logps, grads = _logps_and_grads(model, ids, mask, T, plain)
    for tile in (0, 7):
        settings = dataclasses.replace(plain, mlp_tile_tokens=tile, recompute_attention=True)
        again_logps, again = _logps_and_grads(model, ids, mask, T, settings)
        torch.testing.assert_close(again_logps, logps, atol=ATOL, rtol=0)
        assert again.keys() == grads.keys() and any("q_proj" in name for name in grads)
        for name in grads:
            torch.testing.assert_close(again[name], grads[name], atol=ATOL, rtol=1e-4, msg=name)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_recomputed_attention_keeps_its_inputs_only(tokenizer):
    """Without checkpointing, padded (a mask: keys and values repeated to the 4 query heads, `repeat_kv`), each of
    the 2 layers' attention saves per token its roped queries (4 heads x 16 = 64 float32), the repeated keys and
    values (2 x 64), SDPA's output (64) and log-sum-exp (4), o_proj's contiguous input (64): 1,296 B, and SDPA's
    float32 copy of its mask row (46 x 4 = 184 B); the rotation saves cos and sin (3 x 46 x 16 float32 each,
    8,832 B, shared by the layers). Recomputed, the attention's checkpoint holds its inputs by reference instead
    (the norm's output, cos / sin, the mask: alive anyway), and none of these: 2 x 138 x (1,296 + 184) + 2 x 8,832
    = 426,144 B less."""
    model = _model(tokenizer, lora=False, checkpointing=False)
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=False)
    kept = _saved_bytes(model, ids, mask, T, plain)
    recomputed = _saved_bytes(model, ids, mask, T, dataclasses.replace(plain, recompute_attention=True))
    assert kept - recomputed == 2 * 3 * 46 * (1_296 + 184) + 2 * 8_832
