"""`modeling.lora`: one LoRA merge rule for the fast decoder and the weight export, checked against PEFT's own
`merge_and_unload()` (the reference) for the adapter settings users train with."""

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.modeling import lora
from grpo_trainer.modeling.export import check_exportable, inference_weights
from grpo_trainer.rollout.fast import decoder as decoder_module
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import assert_same_rollout, fast_rollout, greedy_config, grouped_prompts

ATTENTION = ["q_proj", "v_proj"]  # Qwen2's q/k/v projections have a bias; o_proj and the MLP's do not


def _trained_lora(tokenizer, **settings):
    """A Qwen2 tiny model with a LoRA adapter whose every LoRA tensor is non-zero (B, and B's bias, are zero at
    initialisation, which would hide a wrong merge)."""
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION, **settings}
    model = get_peft_model(make_tiny_model(tokenizer), LoraConfig(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


SETTINGS = {
    "vanilla": {},
    "rslora": {"use_rslora": True},  # scaling alpha / sqrt(r) = 4, not alpha / r = 2
    "lora_bias": {"lora_bias": True},  # b' = b + B.bias * scaling
    "rslora_and_bias": {"use_rslora": True, "lora_bias": True},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_applied_weights_equal_peft_merge_and_unload_exactly(tokenizer, name):
    """In float32 the rule computes exactly PEFT's arithmetic (W + (B A) * s, b + B.bias * s), so the values are
    bit-identical to `merge_and_unload()`'s, for every merged layer."""
    model = _trained_lora(tokenizer, **SETTINGS[name])
    layers = {n: m for n, m in model.named_modules() if lora.merge_blocker(m) is None}
    assert len(layers) == 4  # q_proj and v_proj in each of the 2 layers
    ours = {n: (lora.applied_weight(m).clone(), lora.applied_bias(m).clone()) for n, m in layers.items()}
    reference = model.merge_and_unload()
    for full_name, (weight, bias) in ours.items():
        merged = reference.get_submodule(full_name.removeprefix("base_model.model."))
        assert torch.equal(weight, merged.weight), full_name
        assert torch.equal(bias, merged.bias), full_name


def test_rslora_and_lora_bias_change_the_merge_as_peft_defines_them(tokenizer):
    """The options are not ignored: rank-stabilised scaling doubles the delta here (alpha/sqrt(r) = 8/2 = 4 against
    alpha/r = 8/4 = 2), and lora_bias moves the bias by B.bias * s."""
    plain, rs = _trained_lora(tokenizer), _trained_lora(tokenizer, use_rslora=True)
    layer, rs_layer = (m.base_model.model.model.layers[0].self_attn.q_proj for m in (plain, rs))
    base = layer.base_layer.weight
    torch.testing.assert_close(lora.applied_weight(rs_layer) - base, 2 * (lora.applied_weight(layer) - base),
                               rtol=1e-5, atol=1e-6)
    biased = _trained_lora(tokenizer, lora_bias=True).base_model.model.model.layers[0].self_attn.q_proj
    expected = biased.base_layer.bias + biased.lora_B["default"].bias * 2.0  # scaling 8 / 4
    assert torch.equal(lora.applied_bias(biased), expected)
    assert torch.equal(lora.applied_bias(layer), layer.base_layer.bias)  # no lora_bias: the base bias as it is


@pytest.mark.parametrize("name", ["rslora", "lora_bias"])
def test_exported_weights_equal_merge_and_unload(tokenizer, name):
    """What the weight push sends to an inference engine is PEFT's merged model, names and values."""
    model = _trained_lora(tokenizer, **SETTINGS[name])
    pushed = {n: t.clone() for n, t in inference_weights(model)}
    merged = model.merge_and_unload().state_dict()
    assert sorted(pushed) == sorted(merged)
    for key, value in merged.items():
        assert torch.equal(pushed[key], value), key


def test_dora_is_not_merged_by_the_rule_and_is_exported_through_peft(tokenizer):
    model = _trained_lora(tokenizer, use_dora=True)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert "DoRA" in lora.merge_blocker(layer)
    pushed = {n: t.clone() for n, t in inference_weights(model)}
    merged = model.merge_and_unload().state_dict()
    for key, value in merged.items():  # PEFT's in-place merge: one add and one subtract of rounding
        torch.testing.assert_close(pushed[key], value, atol=1e-6, rtol=0, msg=key)


def test_lora_bias_on_a_layer_without_bias_is_refused_by_name(tokenizer):
    model = _trained_lora(tokenizer, lora_bias=True, target_modules=["gate_proj"])  # Qwen2's MLP has no bias
    layer = model.base_model.model.model.layers[0].mlp.gate_proj
    assert "lora_bias=True on a layer without a bias" in lora.merge_blocker(layer)
    with pytest.raises(ValueError, match=r"LoRA layer base_model\.model\.model\.layers\.0\.mlp\.gate_proj.*lora_bias"):
        check_exportable(model)


def test_the_decoder_runs_lora_bias_merged_and_reproduces_generate(tokenizer, monkeypatch):
    """The fast decoder's fused projections take the rule's merged weight and bias: greedy tokens equal
    `generate`'s, which runs PEFT's forward (base + B(A x) * s with B's bias)."""
    monkeypatch.setattr(decoder_module, "FUSE_MAX_PARAMETERS", 2**40)
    model = _trained_lora(tokenizer, lora_bias=True).eval()
    calls = []
    monkeypatch.setattr(lora, "applied_bias", lambda layer, *a, _f=lora.applied_bias: calls.append(1) or _f(layer, *a))
    prompts, config = grouped_prompts(tokenizer), greedy_config(tokenizer)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
        assert_same_rollout(fast_rollout(model, prompts, config), reference)
    assert calls  # the merged bias was used, not the module's forward


def test_a_merge_that_disagrees_with_peft_falls_back_everywhere(tokenizer, monkeypatch, caplog):
    """Decision 3: a formula that no longer matches PEFT's (here a doubled delta) is caught by the once-per-type
    check; the export then uses PEFT's own merge, so what is pushed is still PEFT's merged model."""
    monkeypatch.setattr(lora, "_CHECKED", {})
    monkeypatch.setattr(lora, "_delta", lambda layer, adapter, value, _d=lora._delta: 2 * _d(layer, adapter, value))
    model = _trained_lora(tokenizer)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.modeling.lora"):
        pushed = {n: t.clone() for n, t in inference_weights(model)}
    assert "does not reproduce PEFT" in caplog.text
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert decoder_module._lora_weights(layer) is None  # the decoder runs the module's own forward
    merged = model.merge_and_unload().state_dict()
    for key, value in merged.items():
        torch.testing.assert_close(pushed[key], value, atol=1e-6, rtol=0, msg=key)
