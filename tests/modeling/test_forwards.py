"""Padding-free log-prob forwards: packed log-probs, entropies and gradients equal the padded forward's (float32,
1e-5) on Llama, Qwen2, Mistral (sliding window) and Gemma-2 tiny models, with and without LoRA and activation
checkpointing; packed sequences never see each other; the `use_cache` trap and models that ignore the packing are
caught by the self-check and scored padded; the refusal rules; replay and the rollout's known values compose with
packing."""

import dataclasses
import logging

import pytest
import torch
from transformers import Qwen2ForCausalLM

from grpo_trainer.modeling import forwards
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.modeling.packing import Layout, PackedBatch, PackingCost, PackingSettings
from grpo_trainer.runtime import compat
from tests.helpers import fast_rollout, greedy_config, grouped_prompts, model_of_kind

ATOL = 1e-5
ON = forwards.ForwardSettings(padding_free=True)
ROWS_OF_17 = PackingSettings(token_budget=17)  # the longest sequence of `variable_batch`


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    """Every test starts with no model checked (verdicts are kept per model object, which tests may reuse)."""
    forwards._VERDICTS.clear()
    forwards._LOGGED.clear()


# A GRPO-like spread: one long completion, most short. Sequences of 17, 5, 9, 5, 7, 7, 11 and 7 tokens pack into
# rows of 17 as [17], [11, 5], [9, 7], [7, 7], [5] (first-fit decreasing): 85 tokens instead of 8 x 18 = 144.
PROMPTS, COMPLETIONS = [5, 3, 6, 4, 2, 5, 3, 6], [12, 2, 3, 1, 5, 2, 8, 1]


def variable_batch(tokenizer, B: int = 8, seed: int = 0):
    """The first `B` rows of PROMPTS / COMPLETIONS, left/right padded to S = 6, T = 12, random tokens."""
    S, T = max(PROMPTS), max(COMPLETIONS)
    generator = torch.Generator().manual_seed(seed)
    prompt, completion = torch.tensor(PROMPTS[:B]), torch.tensor(COMPLETIONS[:B])
    columns = torch.arange(S + T)
    mask = ((columns >= S - prompt[:, None]) & (columns < S + completion[:, None])).long()
    ids = torch.randint(10, 90, (B, S + T), generator=generator).masked_fill(mask == 0, tokenizer.pad_token_id)
    return ids, mask, T


def _shared_rows(packed: PackedBatch) -> list[tuple[int, int]]:
    """(earlier, later) padded rows packed one after the other into one row, from where their tokens are predicted."""
    W = packed.input_ids.shape[1]
    cell = {int(b): int(packed.predictors[packed.target_cells[0] == b][0]) for b in packed.target_cells[0].unique()}
    return [(a, b) for a in cell for b in cell if a != b and cell[a] // W == cell[b] // W and cell[a] < cell[b]]


def _model(kind: str, tokenizer, lora: bool, checkpointing: bool):
    overrides = {"sliding_window": 4} if kind == "mistral" else {}  # windows shorter than the sequences
    model = model_of_kind(kind, tokenizer, **overrides)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 init_lora_weights=False))
        model.enable_input_require_grads()
    if checkpointing:
        compat.enable_checkpointing(model.get_base_model() if lora else model)
    model.train()
    return model


def _loss_grads(model, logprobs, mask, generator_seed: int = 5):
    """Gradients of a loss reading log-probs and entropies of completion tokens only."""
    generator = torch.Generator().manual_seed(generator_seed)
    weights, entropy_weights = torch.randn((2, *mask.shape), generator=generator) * mask
    loss = (logprobs.logps * weights).sum() + (logprobs.entropy * entropy_weights).sum()
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_packed_equals_padded_values_and_gradients(tokenizer, kind, lora, checkpointing):
    model = _model(kind, tokenizer, lora, checkpointing)
    ids, mask, T = variable_batch(tokenizer)
    packed = PackedBatch.of(ids, mask, T, ROWS_OF_17)
    assert len(_shared_rows(packed)) == 3 and packed.tokens_computed == 85 < ids.numel() == 144
    completion_mask = mask[:, -T:]
    padded = completion_logprobs(model, ids, mask, T, with_entropy=True)
    padded_grads = _loss_grads(model, padded, completion_mask)
    ours = forwards.packed_logprobs(model, packed, ON, with_entropy=True)
    ours_grads = _loss_grads(model, ours, completion_mask)
    real = completion_mask.bool()
    torch.testing.assert_close(ours.logps[real], padded.logps[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.entropy[real], padded.entropy[real], atol=ATOL, rtol=0)
    assert ours.logps.dtype == padded.logps.dtype == torch.float32
    assert not ours.logps[~real].any() and not ours.entropy[~real].any()  # 0 where nothing is scored
    assert padded_grads.keys() == ours_grads.keys() and len(ours_grads) > 0
    assert any("lora" in name for name in ours_grads) == lora
    for name in padded_grads:
        torch.testing.assert_close(ours_grads[name], padded_grads[name], atol=ATOL, rtol=0, msg=name)


def _sdpa_masks(monkeypatch) -> list:
    """Records the `attn_mask` of every SDPA call (None: causal, no dense mask)."""
    masks, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return masks


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_rows_of_one_sequence_run_causal_without_a_dense_mask(tokenizer, kind, monkeypatch):
    """A layout whose rows each hold one sequence (one row per micro-batch, or long sequences the cost keeps
    apart) gives the filler its row's next positions, so SDPA runs causal with no `[R, 1, W, W]` mask (the memory
    the planner's "packed attention mask" counts), and the values and gradients are still the padded forward's
    (Mistral: a sliding window of 4, whose mask transformers builds either way). A layout with shared rows still
    masks densely."""
    model = _model(kind, tokenizer, lora=False, checkpointing=True)
    masks = _sdpa_masks(monkeypatch)
    ids, mask, T = variable_batch(tokenizer)
    row_each = Layout([[b] for b in range(8)], 17, mask.sum(1).tolist())  # rows of 17: the longest sequence
    packed = PackedBatch.of(ids, mask, T, layout=row_each)
    assert packed.input_ids.shape == (8, 17) and not _shared_rows(packed)
    completion_mask = mask[:, -T:]
    padded = completion_logprobs(model, ids, mask, T, with_entropy=True)
    padded_grads = _loss_grads(model, padded, completion_mask)
    masks.clear()
    ours = forwards.packed_logprobs(model, packed, ON, with_entropy=True)
    if kind == "qwen2":
        assert masks and all(m is None for m in masks)  # causal: no dense mask in any layer
    ours_grads = _loss_grads(model, ours, completion_mask)
    real = completion_mask.bool()
    torch.testing.assert_close(ours.logps[real], padded.logps[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.entropy[real], padded.entropy[real], atol=ATOL, rtol=0)
    for name in padded_grads:
        torch.testing.assert_close(ours_grads[name], padded_grads[name], atol=ATOL, rtol=0, msg=name)
    masks.clear()
    with torch.no_grad():
        forwards.packed_logprobs(model, PackedBatch.of(ids, mask, T, ROWS_OF_17), ON)
    assert masks and all(m is not None and m.shape[-1] == 17 for m in masks)  # shared rows: masked densely


def test_perturbing_one_sequence_leaves_the_others_bit_identical(tokenizer):
    model = model_of_kind("qwen2", tokenizer).eval()
    ids, mask, T = variable_batch(tokenizer, B=8)
    packed = PackedBatch.of(ids, mask, T, ROWS_OF_17)
    # Two sequences sharing a packed row: perturb the earlier one (other tokens, same length); a leak would reach
    # the later one.
    first_b, second_b = _shared_rows(packed)[0]
    changed = ids.clone()
    changed[first_b] = torch.where(mask[first_b].bool(), (ids[first_b] + 7) % 100, ids[first_b])
    with torch.no_grad():
        before = forwards.packed_logprobs(model, packed, ON).logps
        after = forwards.packed_logprobs(model, PackedBatch.of(changed, mask, T, ROWS_OF_17), ON).logps
    others = [b for b in range(ids.shape[0]) if b != first_b]
    assert second_b in others
    assert torch.equal(after[others], before[others])  # bit-identical, including the row's next sequence
    assert not torch.equal(after[first_b], before[first_b])


class AlwaysCaches(Qwen2ForCausalLM):
    """A model whose forward makes a KV cache whatever it is asked (as some remote code does), and hides it."""

    def forward(self, *args, use_cache=None, **kwargs):
        out = super().forward(*args, use_cache=True, **kwargs)
        out["cache"] = None
        return out


def test_the_use_cache_trap_is_real_and_caught(tokenizer, caplog):
    """With a cache, transformers does not look for restarting positions: packed sequences attend to each other.
    A model that makes one anyway fails the self-check, and is scored padded with the reason logged."""
    model = model_of_kind("qwen2", tokenizer).eval()
    ids, mask, T = variable_batch(tokenizer, B=8)
    packed = PackedBatch.of(ids, mask, T, ROWS_OF_17)
    real = mask[:, -T:].bool()
    with torch.no_grad():
        padded = completion_logprobs(model, ids, mask, T).logps
        isolated = forwards.packed_logprobs(model, packed, ON).logps
        leaked = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
    torch.testing.assert_close(isolated[real], padded[real], atol=ATOL, rtol=0)
    leaked_logps = torch.log_softmax(leaked.float(), -1).reshape(-1, leaked.shape[-1])[packed.predictors]
    leaked_logps = packed.scatter(leaked_logps.gather(1, packed.tokens[:, None]).squeeze(1))
    assert (leaked_logps[real] - padded[real]).abs().max() > 0.05  # the trap: the same call with a cache

    trapped = AlwaysCaches(model.config)
    trapped.load_state_dict(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.modeling.forwards"):
        reason = forwards.self_check(trapped, ids, mask, ON)
        # Caught by isolation (the leak itself), or before it where transformers returns the cache it made (the
        # transformers floor, 5.19, does: `_no_cache`); either way the model is scored padded.
        caught = ("perturbing one packed sequence moved the log-probs",
                  "the packed forward failed: RuntimeError: AlwaysCaches returned a KV cache")
        assert reason.startswith(caught), reason
        out = forwards.score(trapped, ids, mask, T, ON)
    torch.testing.assert_close(out.logps, padded, atol=0, rtol=0)  # scored padded
    assert f"AlwaysCaches is scored padded: {reason}" in caplog.text


def test_a_returned_cache_is_refused(tokenizer):
    """A packed forward that returns a cache although asked not to is an error, never a silent leak."""

    class ReturnsCache(Qwen2ForCausalLM):
        def forward(self, *args, use_cache=None, **kwargs):
            return super().forward(*args, use_cache=True, **kwargs)

    model = ReturnsCache(model_of_kind("qwen2", tokenizer).config).eval()
    ids, mask, T = variable_batch(tokenizer)
    with pytest.raises(RuntimeError, match="returned a KV cache from a packed forward"):
        forwards.packed_logprobs(model, PackedBatch.of(ids, mask, T, ROWS_OF_17), ON)
    assert forwards.self_check(model, ids, mask, ON).startswith("the packed forward failed: RuntimeError")


def test_a_model_whose_mask_ignores_restarting_positions_falls_back(tokenizer, monkeypatch, caplog):
    """transformers' packed-sequence detection switched off (as in a model that builds its own causal mask): the
    self-check sees the leak, and the model is scored padded from then on, the reason logged once."""
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    model = model_of_kind("llama", tokenizer)
    ids, mask, T = variable_batch(tokenizer)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.modeling.forwards"):
        first = forwards.score(model, ids, mask, T, ON, with_entropy=True)
        second = forwards.score(model, ids, mask, T, ON, with_entropy=True)
    padded = completion_logprobs(model, ids, mask, T, with_entropy=True)
    for out in (first, second):
        torch.testing.assert_close(out.logps, padded.logps, atol=0, rtol=0)
    assert caplog.text.count("LlamaForCausalLM is scored padded: perturbing one packed sequence") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_passes_and_catches_a_leak_in_each_dtype(tokenizer, dtype, monkeypatch):
    """The isolation check does not depend on rounding: bf16's layout noise hides a leak from a tolerance on the
    difference to the padded forward, not from perturbing a sequence."""
    import transformers.masking_utils as masking_utils

    model = model_of_kind("qwen2", tokenizer).to(dtype)
    ids, mask, _ = variable_batch(tokenizer, B=8)
    assert forwards.self_check(model, ids, mask, ON) is None
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert forwards.self_check(model, ids, mask, ON).startswith("perturbing one packed sequence")


def test_self_check_of_a_single_row_packs_it_with_a_copy(tokenizer, monkeypatch):
    import transformers.masking_utils as masking_utils

    model = model_of_kind("qwen2", tokenizer)
    ids, mask, _ = variable_batch(tokenizer, B=1)
    assert forwards.self_check(model, ids, mask, ON) is None
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert forwards.self_check(model, ids, mask, ON) is not None


def test_self_check_runs_with_dropout_off_and_restores_training_modes(tokenizer):
    model = model_of_kind("gpt2", tokenizer, n_layer=2)  # dropout 0.1 everywhere
    model.train()
    model.transformer.h[0].eval()  # a module deliberately in eval mode stays so
    ids, mask, _ = variable_batch(tokenizer)
    assert forwards.self_check(model, ids, mask, ON) is None
    assert model.training and model.transformer.h[1].training and not model.transformer.h[0].training


def _count_forwards(model) -> list:
    shapes = []
    model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    return shapes


def test_score_packs_when_it_saves_tokens_and_checks_once(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    shapes = _count_forwards(model)
    ids, mask, T = variable_batch(tokenizer)
    packed = PackedBatch.of(ids, mask, T, PackingSettings(cost=forwards.packing_cost(model)))
    off = forwards.score(model, ids, mask, T, dataclasses.replace(ON, padding_free=False))
    assert shapes == [tuple(ids.shape)]
    on = forwards.score(model, ids, mask, T, ON)
    # The self-check (padded, packed, packed perturbed; all tokens but the first scored), then the packed forward.
    assert len(shapes) == 1 + 3 + 1 and shapes[-1] == tuple(packed.input_ids.shape)
    real = mask[:, -T:].bool()
    torch.testing.assert_close(on.logps[real], off.logps[real], atol=ATOL, rtol=0)
    forwards.score(model, ids, mask, T, ON)
    assert len(shapes) == 6 and shapes[-1] == tuple(packed.input_ids.shape)  # checked once per model
    full = torch.ones_like(mask)  # no padding: nothing to gain, scored padded
    forwards.score(model, ids, full, T, ON)
    assert shapes[-1] == tuple(ids.shape)


def test_refusal_rules(tokenizer):
    from transformers import AttentionInterface, Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = model_of_kind("qwen2", tokenizer)
    assert forwards.refusal(model, forwards.Call()) is None
    assert "image inputs" in forwards.refusal(model, forwards.Call(model_inputs={"pixel_values": torch.zeros(1)}))
    assert "auxiliary loss" in forwards.refusal(model, forwards.Call(with_aux_loss=True))
    mrope = model_of_kind("qwen2", tokenizer, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                 "mrope_section": [2, 3, 3]})
    assert "3-D rope" in forwards.refusal(mrope, forwards.Call())
    AttentionInterface.register("my_attention", sdpa_attention_forward)
    custom = model_of_kind("qwen2", tokenizer)
    custom.set_attn_implementation("my_attention")
    assert "attention implementation 'my_attention'" in forwards.refusal(custom, forwards.Call())
    hybrid = Qwen3NextForCausalLM(Qwen3NextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
                                                  moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                  linear_num_value_heads=2, linear_num_key_heads=1,
                                                  full_attention_interval=2))
    assert "['linear_attention'] carry a state or a convolution" in forwards.refusal(hybrid, forwards.Call())


def test_vision_language_models_are_scored_padded(tokenizer):
    from tests.toy_vlm import make_tiny_vlm

    for family in ("qwen2_vl", "gemma3"):
        model, _ = make_tiny_vlm(family)
        assert "vision-language model" in forwards.refusal(model, forwards.Call())
    # Qwen2-VL's text model on its own still has 3-D rope positions.
    assert "3-D rope" in forwards.refusal(make_tiny_vlm("qwen2_vl")[0].model.language_model, forwards.Call())


@pytest.mark.parametrize("kind", ["qwen2", "lora"])
def test_replay_composes_with_packing(tokenizer, kind, monkeypatch):
    """On-policy: the rollout's layer outputs gathered into the packed layout stand in for the checkpointed forward,
    and its softmax for the LM head's, giving the padded plain forward's gradients; each layer runs once."""
    from tests.modeling.test_replay import _count_layer_runs

    model = _model("qwen2", tokenizer, lora=kind == "lora", checkpointing=True)
    lm = model.get_base_model() if kind == "lora" else model
    prompts = grouped_prompts(tokenizer, repeats=3)
    torch.manual_seed(3)
    rollout = fast_rollout(model, prompts, greedy_config(tokenizer, do_sample=True, max_new_tokens=10),
                           layer_outputs=True, probs=True)
    # The tiny model rarely samples EOS: end the completions at spread lengths (a prefix's layer outputs and
    # log-probs are the rollout's as they are: causal).
    lengths = torch.tensor([10, 3, 6, 2, 8, 1, 4, 5, 2])
    completion_mask = rollout.completion_mask * (torch.arange(rollout.completion_ids.shape[1]) < lengths[:, None])
    rollout = dataclasses.replace(rollout, completion_mask=completion_mask)
    ids = torch.cat([prompts.ids, rollout.completion_ids], 1)
    mask = torch.cat([prompts.mask, rollout.completion_mask], 1)
    T = rollout.completion_ids.shape[1]
    packed = PackedBatch.of(ids, mask, T, ROWS_OF_17)
    assert len(_shared_rows(packed)) >= 2
    runs = _count_layer_runs(lm, monkeypatch)
    known = (rollout.sampler.logps, rollout.sampler.entropy, rollout.sampler.replay.probs)
    padded = completion_logprobs(model, ids, mask, T, with_entropy=True)
    plain = _loss_grads(model, padded, rollout.completion_mask)
    runs[0] = 0
    ours = forwards.score(model, ids, mask, T, ON, with_entropy=True, known=known,
                          layer_outputs=rollout.sampler.replay.layer_outputs)
    layers = len(lm.get_decoder().layers)
    assert runs[0] == 3 * layers  # the self-check's three forwards, then nothing: every layer replayed
    replayed = _loss_grads(model, ours, rollout.completion_mask)
    assert runs[0] == 4 * layers  # the backward recomputes each layer once, on packed rows
    real = rollout.completion_mask.bool()
    torch.testing.assert_close(ours.logps[real], rollout.sampler.logps[real], atol=0, rtol=0)  # the rollout's
    torch.testing.assert_close(ours.logps[real], padded.logps[real], atol=2e-5, rtol=0)
    for name in plain:
        torch.testing.assert_close(replayed[name], plain[name], atol=2e-5, rtol=1e-4, msg=name)


def test_known_values_give_the_recomputed_gradients_when_packed(tokenizer):
    """The rollout's log-probs, entropies and softmax, read at the packed rows' cells, give the same gradients as
    recomputing them packed (the softmax is read per chunk, never copied whole)."""
    model = _model("qwen2", tokenizer, lora=False, checkpointing=False)
    ids, mask, T = variable_batch(tokenizer)
    with torch.no_grad():
        reference = completion_logprobs(model, ids, mask, T, with_entropy=True)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        probs = torch.softmax(logits[:, -T - 1:-1].float(), -1)  # [B, T, V]
    packed = PackedBatch.of(ids, mask, T, ROWS_OF_17)
    recomputed = _loss_grads(model, forwards.packed_logprobs(model, packed, ON, with_entropy=True), mask[:, -T:])
    known = (reference.logps, reference.entropy, probs)
    out = forwards.packed_logprobs(model, packed, ON, with_entropy=True, known=known)
    real = mask[:, -T:].bool()
    assert torch.equal(out.logps[real], reference.logps[real])  # the known values, returned as they are
    from_known = _loss_grads(model, out, mask[:, -T:])
    for name in recomputed:
        torch.testing.assert_close(from_known[name], recomputed[name], atol=ATOL, rtol=1e-5, msg=name)


def test_every_token_of_a_micro_batch_without_completions_still_runs_the_forward(tokenizer):
    """No completion token to score (all masked): the packed forward still runs (processes keep their forwards in
    step) and returns zeros connected to the graph."""
    model = _model("qwen2", tokenizer, lora=False, checkpointing=False)
    ids, mask, T = variable_batch(tokenizer)
    mask[:, -T:] = 0
    out = forwards.packed_logprobs(model, PackedBatch.of(ids, mask, T, ROWS_OF_17), ON, with_entropy=True)
    assert not out.logps.any() and out.logps.requires_grad
    out.logps.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.model.layers.parameters())


def test_packing_cost_by_hand(tokenizer):
    """The toy Qwen2 (hidden 64, MLP 128, 2 layers, 4 query heads of 16, 2 key/value heads, q/k/v biases): per layer
    q 64x64+64 = 4160, k and v 64x32+32 = 2080 each, o 64x64 = 4096, MLP 3 x 64x128 = 24576, two norms 128:
    37120; two layers 74240, the final norm 64: 74304 parameters besides the (tied) embedding, 2 flops each per
    token. A pair of tokens in a row: 4 x 2 layers x 64."""
    model = model_of_kind("qwen2", tokenizer)
    assert forwards.packing_cost(model) == PackingCost(token=2 * 74304, pair=4 * 2 * 64)


@pytest.mark.parametrize("kind", ["gpt2_no_dropout", "phi3", "mixtral", "qwen3"])
def test_other_architectures_train_packed_with_the_padded_gradients(tokenizer, kind):
    """`score` end to end (self-check, plan, packed forward) on architectures beyond the four above: GPT-2 (learned
    absolute positions, its layers under `transformer.h`), Phi-3 (fused projections), Mixtral (experts), Qwen3 (q/k
    norms, a head width other than hidden / heads)."""
    model = model_of_kind(kind, tokenizer, **({"n_positions": 64} if kind.startswith("gpt2") else {}))
    model.train()
    ids, mask, T = variable_batch(tokenizer)
    padded = _loss_grads(model, completion_logprobs(model, ids, mask, T, with_entropy=True), mask[:, -T:])
    shapes = _count_forwards(model)
    ours = forwards.score(model, ids, mask, T, ON, with_entropy=True)
    assert shapes[-1][0] < ids.shape[0]  # the last forward ran packed rows
    grads = _loss_grads(model, ours, mask[:, -T:])
    for name in padded:
        torch.testing.assert_close(grads[name], padded[name], atol=ATOL, rtol=0, msg=name)


def long_batch(tokenizer, T: int, B: int = 6, seed: int = 0):
    """`B` rows of prompts of 5, 3, 6, 4, 2, 5 tokens (S = 6) and completions of T, T, T - 7, T, T / 2, T tokens."""
    prompts = torch.tensor([5, 3, 6, 4, 2, 5][:B])
    completions = torch.tensor([T, T, T - 7, T, T // 2, T][:B])
    S = int(prompts.max())
    columns = torch.arange(S + T)
    mask = ((columns >= S - prompts[:, None]) & (columns < S + completions[:, None])).long()
    ids = torch.randint(10, 90, (B, S + T), generator=torch.Generator().manual_seed(seed))
    return ids.masked_fill(mask == 0, tokenizer.pad_token_id), mask, T


@pytest.mark.parametrize("B", [1, 6])
def test_the_self_check_runs_on_a_slice_whose_size_does_not_grow_with_T(tokenizer, B):
    """The self-check's three forwards see at most CHECK_ROWS rows of at most CHECK_TOKENS tokens each (packed:
    two sequences per row), the same shapes at T = 200 and T = 800, while the scoring forward after it sees all."""
    model = model_of_kind("qwen2", tokenizer, max_position_embeddings=1024)
    shapes = _count_forwards(model)
    seen = {}
    for T in (200, 800):
        forwards._VERDICTS.clear()
        shapes.clear()
        ids, mask, _ = long_batch(tokenizer, T, B)
        out = forwards.score(model, ids, mask, T, ON)
        assert out.logps.shape == (B, T)
        checks = shapes[:3]  # padded, packed, packed perturbed; then the scoring forward
        assert len(shapes) == 4 and forwards._VERDICTS[model] is None
        # rows: min(4, B) (a copy of row 0 when B == 1); tokens: 128, 112, 96, 80 of each sequence (T > 128);
        # padded width 128; packed at a budget of 2 x 128: FFD puts 128 + 112 in one row, 96 + 80 in the next.
        rows = 2 if B == 1 else forwards.CHECK_ROWS
        assert checks[0] == (rows, forwards.CHECK_TOKENS)
        assert checks[1] == checks[2] == ((1, 240) if B == 1 else (2, 240))
        seen[T] = checks
    assert seen[200] == seen[800]


def test_check_slice_keeps_each_sequences_first_tokens(tokenizer):
    """Row i keeps the first min(length, 128 - 16 i) tokens of its sequence, left-padded: row 2 (6 + 193 tokens)
    keeps 96, its prompt and 90 completion tokens; short sequences are kept whole."""
    model = model_of_kind("qwen2", tokenizer)
    ids, mask, _ = long_batch(tokenizer, 200)
    sliced, sliced_mask = forwards.check_slice(model, ids, mask)
    assert sliced.shape == (4, 128) and sliced_mask.sum(1).tolist() == [128, 112, 96, 80]
    for i in range(4):
        kept = int(sliced_mask[i].sum())
        assert torch.equal(sliced[i, 128 - kept:], ids[i][mask[i].bool()][:kept])
    short, short_mask, _ = variable_batch(tokenizer)  # sequences of 17, 5, 9, 5 tokens: all shorter than the cut
    sliced, sliced_mask = forwards.check_slice(model, short, short_mask)
    assert sliced_mask.sum(1).tolist() == [17, 5, 9, 5] and sliced.shape == (4, 17)


def test_check_slice_covers_the_attention_window(tokenizer):
    """A sliding window of 300 (Mistral: no layer_types) or Gemma-2's sliding layers: the slice keeps sequences of
    128 + 300 tokens, longer than the window, so the window's masking across a packing boundary is checked. Qwen2
    without sliding layers keeps 128."""
    ids, mask, _ = long_batch(tokenizer, 800)
    for kind in ("mistral", "gemma2"):
        model = model_of_kind(kind, tokenizer, sliding_window=300)
        assert forwards.check_slice(model, ids, mask)[1].sum(1).tolist() == [428, 375, 322, 269]  # 428 - 53 i
    assert forwards.check_slice(model_of_kind("qwen2", tokenizer), ids, mask)[0].shape == (4, 128)


def _positions_along_the_row(embedding, args):
    """A position embedding that re-derives its positions (0, 1, ... along the row) whatever it is given."""
    return (torch.arange(args[0].shape[-1]).expand_as(args[0]),)


@pytest.mark.parametrize("fault", ["leak", "cache", "positions"])
def test_the_sliced_self_check_still_catches_each_fault_at_long_T(tokenizer, fault, monkeypatch):
    """Negative controls on a micro-batch far longer than the slice (T = 600): attention across packed sequences
    (caught by isolation), a KV cache made anyway (isolation, or the returned cache), learned absolute positions
    re-derived along the row while the mask still keeps sequences apart (caught by agreement: the packed second
    sequence gets positions offset by the first's length); each model is scored padded. The healthy models pass."""
    import transformers.masking_utils as masking_utils

    kind = "gpt2_no_dropout" if fault == "positions" else "qwen2"
    healthy = model_of_kind(kind, tokenizer, **({"n_positions": 1024} if fault == "positions" else
                                                 {"max_position_embeddings": 1024}))
    ids, mask, T = long_batch(tokenizer, 600)
    assert forwards.self_check(healthy, ids, mask, ON) is None
    model = healthy
    if fault == "leak":
        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
        expected = ("perturbing one packed sequence",)
    elif fault == "cache":
        model = AlwaysCaches(healthy.config)
        model.load_state_dict(healthy.state_dict())
        expected = ("perturbing one packed sequence", "the packed forward failed: RuntimeError")
    else:
        healthy.transformer.wpe.register_forward_pre_hook(_positions_along_the_row)
        expected = ("its packed log-probs differ",)
    reason = forwards.self_check(model, ids, mask, ON)
    assert reason is not None and reason.startswith(expected), reason
    out = forwards.score(model, ids, mask, T, ON)
    torch.testing.assert_close(out.logps, completion_logprobs(model, ids, mask, T).logps, atol=0, rtol=0)
