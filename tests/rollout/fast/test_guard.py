"""The guard inspects the modules the decoder re-implements: every variant it lets through gives `generate`'s greedy
tokens, and every one it refuses falls back (to the model's own forward or to `generate`) with the reason, instead
of diverging or crashing mid-rollout."""

import pytest
import torch
from transformers.models.llama import modeling_llama

from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import (
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    fresh_copy,
    greedy_config,
    grouped_prompts,
    model_of_kind,
)

# Weights larger than the default init make the tiny model's tokens depend on positions, so a wrong rotary
# table changes greedy tokens rather than only the last digits of the logits.
SENSITIVE = {"initializer_range": 0.1, "max_position_embeddings": 16}
LONG_ROPE = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}  # D/2


def assert_equals_generate(model, tokenizer, **settings):
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer, **settings)
    with torch.no_grad():  # on a copy: dynamic RoPE keeps state between calls (see tests.helpers.fresh_copy)
        reference = generate_rollout(fresh_copy(model), prompts, config)
    assert_same_rollout(fast_rollout(model, prompts, config), reference)
    return reference


def blocker(model, tokenizer, **settings):
    return fast_path_blocker(model, greedy_config(tokenizer, **settings), grouped_prompts(tokenizer).ids.shape[1])


def test_dynamic_rope_past_the_original_context_is_refused_and_the_rollout_equals_generate(tokenizer):
    """Dynamic NTK scaling recomputes the frequencies from each call's longest position; the decoder computes one
    table per rollout. A stock Llama config with `rope_scaling={"rope_type": "dynamic"}` used to pass the guard and
    sample other tokens than generate (every row, with these weights) once the rollout outgrew the original 16
    positions."""
    model = model_of_kind("llama", tokenizer, rope_scaling={"rope_type": "dynamic", "factor": 8.0}, **SENSITIVE)
    assert_equals_generate(model, tokenizer, max_new_tokens=20)
    assert "RoPE type 'dynamic'" in blocker(model, tokenizer, max_new_tokens=20)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "dynamic", "factor": 8.0},  # within the original context: the plain frequencies
    {"rope_type": "longrope", "original_max_position_embeddings": 64, **LONG_ROPE},  # within it: short factors
])
def test_each_rope_type_the_guard_clears_gives_generates_tokens(tokenizer, rope):
    model = model_of_kind("llama", tokenizer, rope_scaling=rope, **{**SENSITIVE, "max_position_embeddings": 64})
    assert blocker(model, tokenizer) is None
    reference = assert_equals_generate(model, tokenizer)
    plain = model_of_kind("llama", tokenizer, **{**SENSITIVE, "max_position_embeddings": 64})
    with torch.no_grad():
        unscaled = generate_rollout(plain, grouped_prompts(tokenizer), greedy_config(tokenizer))
    if rope["rope_type"] != "dynamic":  # the scaling changes the tokens: the comparison above could tell
        assert not torch.equal(unscaled.completion_ids, reference.completion_ids)


def test_long_rope_past_the_original_context_is_refused(tokenizer):
    """LongRoPE switches from short to long factors once a call's longest position passes the original
    context: within one rollout, depending on the step."""
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 12, **LONG_ROPE}  # prompts: <= 11
    model = model_of_kind("llama", tokenizer, rope_scaling=rope, **{**SENSITIVE, "max_position_embeddings": 64})
    assert_equals_generate(model, tokenizer)
    assert "RoPE type 'longrope'" in blocker(model, tokenizer)


class RenamedScaling(modeling_llama.LlamaAttention):
    """An attention whose softmax scale has another name, as a future release or a user's module may have."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.softmax_scale = self.scaling
        del self.scaling

    def forward(self, *args, **kwargs):
        self.scaling = self.softmax_scale
        try:
            return super().forward(*args, **kwargs)
        finally:
            del self.scaling


def _with_attention(model, cls):
    for index, layer in enumerate(model.model.layers):
        replacement = cls(model.config, index)
        replacement.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = replacement
    return model


def test_an_attention_without_scaling_falls_back_instead_of_crashing(tokenizer):
    """The decoder read `attn.scaling` while building itself, after the guard had cleared the model: an
    AttributeError in the middle of a rollout."""
    model = _with_attention(model_of_kind("llama", tokenizer), RenamedScaling)
    assert_equals_generate(model, tokenizer)
    assert "runs its own forward" in blocker(model, tokenizer)


def test_a_renamed_attribute_in_the_familys_own_class_is_refused(tokenizer, monkeypatch):
    """The same rename made in the family's class itself (as a transformers release would): the forward is the
    family's, so only the attribute check can see it."""
    monkeypatch.setattr(modeling_llama, "LlamaAttention", RenamedScaling)
    model = model_of_kind("llama", tokenizer)
    assert type(model.model.layers[0].self_attn) is RenamedScaling
    assert_equals_generate(model, tokenizer)
    assert "has no attribute scaling" in blocker(model, tokenizer)


def test_a_rotary_forward_with_a_third_argument_is_refused(tokenizer, monkeypatch):
    """Gemma 3's rotary module takes the layer type as a third argument and returns other tables for it; the
    decoder would call it with two and get something else (or a TypeError)."""
    original = modeling_llama.LlamaRotaryEmbedding.forward

    def forward(self, x, position_ids, layer_type=None):  # Gemma 3's signature
        return original(self, x, position_ids)

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", forward)
    model = model_of_kind("llama", tokenizer)
    assert "takes (x, position_ids, layer_type)" in blocker(model, tokenizer)
    assert_equals_generate(model, tokenizer)


def test_modules_the_decoder_replaces_must_run_their_familys_forward(tokenizer):
    model = model_of_kind("qwen3", tokenizer)
    layer = model.model.layers[1]
    layer.mlp.forward = lambda x: layer.mlp.down_proj(torch.relu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
    assert_equals_generate(model, tokenizer)
    assert "forward is patched on the instance" in blocker(model, tokenizer)
    del layer.mlp.forward
    layer.self_attn.k_norm = torch.nn.LayerNorm(24)  # a norm the decoder does not compute
    assert_equals_generate(model, tokenizer)
    assert "LayerNorm" in blocker(model, tokenizer)
