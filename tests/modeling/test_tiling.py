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
    values (2 x 64), SDPA's output (64; o_proj reads it in place) and log-sum-exp (4): 1,040 B, and SDPA's float32
    copy of its mask row (46 x 4 = 184 B). Recomputed, the attention's checkpoint saves its inputs instead: the
    norm's output (which q_proj saved before), cos and sin (which the rotation saved before), and what nothing
    saved before, the boolean mask `[3, 1, 46, 46]` (6,348 B) and the position ids `[3, 46]` (1,104 B), shared by
    the layers: 2 x 138 x (1,040 + 184) - 6,348 - 1,104 = 330,372 B less. (Before the checkpoint took its inputs as
    positional tensors, it kept the hidden states, a keyword argument, by reference for as long as the graph lived,
    and they went uncounted here.)"""
    model = _model(tokenizer, lora=False, checkpointing=False)
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=False)
    kept = _saved_bytes(model, ids, mask, T, plain)
    recomputed = _saved_bytes(model, ids, mask, T, dataclasses.replace(plain, recompute_attention=True))
    assert kept - recomputed == 2 * 3 * 46 * (1_040 + 184) - 6_348 - 1_104


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_recomputed_attention_runs_one_row_at_a_time(tokenizer, monkeypatch, layout):
    """Decision 7: each attention call of the 3 padded rows (masks `[3, 1, 46, 46]`), or of the 2 packed rows (the
    45-token sequence alone, the 43- and 32-token ones together under a mask), sees one row, and the log-probs and
    every gradient equal the whole block's (also with the tiles, checkpointed)."""
    from transformers.models.qwen2 import modeling_qwen2

    seen = []
    forward = modeling_qwen2.Qwen2Attention.forward
    monkeypatch.setattr(modeling_qwen2.Qwen2Attention, "forward",
                        lambda self, *a, **k: seen.append(k["hidden_states"].shape[0]) or forward(self, *a, **k))
    model = _model(tokenizer, lora=False, checkpointing=True)
    ids, mask, T = _batch(tokenizer)
    settings = forwards.ForwardSettings(padding_free=layout == "packed", mlp_tile_tokens=7)
    packing = forwards.PackingSettings(token_budget=80)  # first fit: [45], [43, 32]

    def logps_and_grads(settings):
        forwards._VERDICTS.clear()
        model.zero_grad()
        if layout == "packed":
            out = forwards.packed_logprobs(model, forwards.PackedBatch.of(ids, mask, T, packing), settings)
        else:
            out = forwards.score(model, ids, mask, T, settings)
        (out.logps * torch.linspace(-1, 1, out.logps.numel()).view_as(out.logps)).sum().backward()
        return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole_logps, whole = logps_and_grads(settings)
    rows = seen[0]
    assert rows == (2 if layout == "packed" else 3) and set(seen) == {rows}  # 2 layers, forward and recomputation
    seen.clear()
    logps, grads = logps_and_grads(dataclasses.replace(settings, recompute_attention=True))
    # each layer: a row at a time in the forward, in the layer's recomputation and in the attention's own
    assert seen == [1] * (2 * 3 * rows)
    torch.testing.assert_close(logps, whole_logps, atol=ATOL, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], whole[name], atol=ATOL, rtol=1e-4, msg=name)


def test_the_rows_run_one_at_a_time_only_where_the_call_is_plainly_a_batch():
    """Decision 7's guard: hidden states `[R, W, E]` with `R > 1`; per-row tensors sliced, broadcast ones and
    positions `[W]` passed whole; a cache, flash-attention's varlen arguments, a mask that is not a tensor, a
    tensor whose leading dimension is neither `R` nor 1, or one with `R` leading and again further in (multimodal
    position ids `[3, R, W]` at R = 3) keep the call whole."""
    hidden, cos = torch.zeros(3, 5, 8), torch.zeros(1, 5, 4)
    mask, positions = torch.zeros(3, 1, 5, 5, dtype=torch.bool), torch.arange(5)
    call = {"hidden_states": hidden, "position_embeddings": (cos, cos), "attention_mask": mask,
            "cache_position": positions, "cache": None}
    assert tiling._rows_of((), call) == 3
    assert tiling._rows_of((hidden,), {}) == 3  # positional
    row = tiling._row(call, 1, 3)
    assert row["hidden_states"].shape == (1, 5, 8) and row["attention_mask"].shape == (1, 1, 5, 5)
    assert row["position_embeddings"][0] is cos and row["cache_position"] is positions
    torch.testing.assert_close(row["hidden_states"], hidden[1:2], atol=0, rtol=0)
    for whole in ({"cache": object()}, {"past_key_values": object()}, {"cu_seq_lens_q": torch.tensor([0, 5])},
                  {"attention_mask": {"full_attention": mask}}, {"position_bias": torch.zeros(2, 5, 5)},
                  {"position_ids": torch.zeros(3, 3, 5, dtype=torch.long)}):  # Qwen2-VL's [3, R, W] at R = 3
        assert tiling._rows_of((), {**call, **whole}) == 1, whole
    assert tiling._rows_of((), {**call, "hidden_states": hidden[:1]}) == 1
    out = tiling._joined_rows([(torch.ones(1, 2), None), (torch.zeros(1, 2), None)])
    assert out[1] is None and out[0].tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_one_row_at_a_time_bounds_the_attentions_working_set(tokenizer, monkeypatch):
    """A scoring forward (no gradients) of 4 padded rows of 128 tokens through one layer of width E = 128 and a
    narrow MLP (32): at its peak the whole attention block holds, besides the layer's input and the norm's output,
    its queries and the rotary embedding's temporaries (`q * cos`, `rotate_half(q)`, its product with `sin`), each
    `[4, 128, 128]` float32 = U = 256 KiB, for every row at once. One row at a time they are a quarter of that: the
    allocator's peak is lower by more than 1.5 U (2.25 U measured with transformers 5.24)."""
    from tests.modeling.test_logprobs import _peak_new_bytes

    model = model_of_kind("qwen2", tokenizer, hidden_size=128, intermediate_size=32, num_attention_heads=8,
                          num_key_value_heads=2, num_hidden_layers=1).eval()
    R, S, T = 4, 8, 120
    ids = torch.randint(10, 90, (R, S + T), generator=torch.Generator().manual_seed(0))
    settings = forwards.ForwardSettings(padding_free=False, recompute_attention=True)

    def peak() -> int:
        forwards._VERDICTS.clear()
        with torch.no_grad():
            return _peak_new_bytes(lambda: forwards.score(model, ids, torch.ones_like(ids), T, settings))

    by_row = peak()
    monkeypatch.setattr(tiling, "_rows_of", lambda args, kwargs: 1)
    whole = peak()
    assert whole - by_row > 1.5 * R * (S + T) * 128 * 4


def test_a_partitioned_attention_runs_whole(tokenizer, monkeypatch):
    """Under ZeRO-3 (parameters with a `ds_id`) each call of the attention's projections gathers their parameters,
    and processes with different row counts would gather different numbers of times: the block runs whole."""
    from transformers.models.qwen2 import modeling_qwen2

    seen = []
    forward = modeling_qwen2.Qwen2Attention.forward
    monkeypatch.setattr(modeling_qwen2.Qwen2Attention, "forward",
                        lambda self, *a, **k: seen.append(k["hidden_states"].shape[0]) or forward(self, *a, **k))
    model = _model(tokenizer, lora=False, checkpointing=False)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.ds_id = 0  # what DeepSpeed marks a partitioned parameter with
    ids, mask, T = _batch(tokenizer)
    forwards._VERDICTS.clear()
    forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=False, recompute_attention=True))
    assert seen == [3, 3]


def _kept_after(run) -> int:
    """Bytes allocated while `run()` runs and still allocated after it (torch.profiler's memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    live: dict[int, int] = {}

    def walk(node):
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr"):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        for child in node.children:
            walk(child)

    events: list[tuple[int, int, int]] = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    for _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    del result
    return sum(live.values())


@pytest.mark.parametrize("tile", [0, 7])
def test_a_checkpointed_layer_keeps_no_attention_input(tokenizer, tile):
    """Under activation checkpointing the recomputed attention's inputs (the norm's output, passed by keyword as
    transformers' layers pass it) are the layer checkpoint's to discard and rebuild: after the forward, with its
    graph alive, `recompute_attention` holds exactly what plain checkpointing holds (its row checkpoints keep no CPU
    RNG state: this attention has no dropout; they kept 5,056 B each with this torch before). Kept by reference, the
    inputs were one norm output per layer for the whole step besides: 2 x 3 x 46 x 64 x 4 B = 70,656 B here, 224
    MiB at 2 x 16k tokens on the 2-layer proxy. The backward still trains the attention."""
    model = _model(tokenizer, lora=False, checkpointing=True)
    ids, mask, T = _batch(tokenizer)
    plain = forwards.ForwardSettings(padding_free=False, mlp_tile_tokens=tile)
    kept = {}
    for recompute in (False, True):
        forwards._VERDICTS.clear()
        settings = dataclasses.replace(plain, recompute_attention=recompute)
        kept[recompute] = _kept_after(lambda s=settings: forwards.score(model, ids, mask, T, s))
    assert kept[True] == kept[False] > 0
    forwards._VERDICTS.clear()
    model.zero_grad()
    forwards.score(model, ids, mask, T, dataclasses.replace(plain, recompute_attention=True)).logps.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["no_dropout", "dropout"])
def test_the_recomputed_attention_leaves_torchs_generator_alone_unless_it_draws(tokenizer, monkeypatch, dropout):
    """Without dropout the attention's checkpoint neither stashes nor sets torch's CPU generator (an asynchronous
    producer thread may be sampling from that process-wide generator during the backward's recomputation: setting it
    back there made two seeded runs sample differently, the matrix cell with async_rollouts=1 and
    recompute_attention); with dropout it keeps the state, so the recomputation draws the forward's masks."""
    model = model_of_kind("qwen2", tokenizer, max_position_embeddings=256, attention_dropout=dropout).train()
    ids, mask, T = _batch(tokenizer)
    calls, real = [], torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda state: (calls.append(1), real(state))[1])
    settings = forwards.ForwardSettings(padding_free=False, recompute_attention=True)
    forwards.score(model, ids, mask, T, settings).logps.sum().backward()
    assert (len(calls) > 0) == (dropout > 0)
