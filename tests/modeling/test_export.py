"""`inference_weights`: the policy's weights under checkpoint names, LoRA merged without touching the model."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_trainer.modeling.export import inference_weights


def test_plain_model_yields_every_checkpoint_name_with_the_tied_head(tiny_model):
    pushed = dict(inference_weights(tiny_model))
    state = tiny_model.state_dict()
    assert sorted(pushed) == sorted(state)  # lm_head.weight included although tied to the embedding
    assert all(torch.equal(pushed[name], state[name]) for name in state)
    assert pushed["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # no copy


def _lora(model, **kwargs):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], **kwargs)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained-looking adapter: B is zero at initialisation
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    return peft_model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora-on-the-fly", "dora-merge-in-place"])
def test_lora_is_merged_into_checkpoint_names_and_the_model_is_left_as_it_was(tokenizer, use_dora):
    from grpo_trainer.cli.toy import make_tiny_model

    peft_model = _lora(make_tiny_model(tokenizer), use_dora=use_dora)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    pushed = {name: tensor.clone() for name, tensor in inference_weights(peft_model)}
    after = dict(peft_model.named_parameters())
    # the model is unchanged (the in-place fall-back rounds by at most one add and one subtract)
    exact = not use_dora
    for name, value in before.items():
        if exact:
            assert torch.equal(after[name], value), name
        else:
            torch.testing.assert_close(after[name].detach(), value, atol=1e-6, rtol=0)
    merged = peft_model.merge_and_unload().state_dict()  # PEFT's own merge, the reference
    assert sorted(pushed) == sorted(merged)
    for name, value in merged.items():
        torch.testing.assert_close(pushed[name], value, atol=1e-6, rtol=0, msg=name)
    # the adapter changed the pushed projections (not just copied the base weights)
    base = make_tiny_model(tokenizer).state_dict()
    assert not torch.allclose(pushed["model.layers.0.self_attn.q_proj.weight"],
                              base["model.layers.0.self_attn.q_proj.weight"])


def test_modules_to_save_replace_the_original_module(tiny_model):
    peft_model = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    head = peft_model.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        head.weight.add_(1.0)
    pushed = dict(inference_weights(peft_model))
    assert not any("modules_to_save" in name or "original_module" in name or "lora_" in name for name in pushed)
    assert torch.equal(pushed["lm_head.weight"], head.weight)


def test_quantized_layers_are_refused_by_name(tiny_model):
    class Linear4bit(torch.nn.Linear):  # stands in for bitsandbytes' class: only its module path is read
        __module__ = "bitsandbytes.nn.modules"

    tiny_model.model.layers[0].mlp.up_proj = Linear4bit(4, 4)
    refused = r"bitsandbytes-quantized layers \(model\.layers\.0\.mlp\.up_proj: Linear4bit\).*use_vllm"
    with pytest.raises(ValueError, match=refused):
        next(inference_weights(tiny_model))


def test_metadata_describes_what_is_yielded_in_order(tokenizer):
    from grpo_trainer.cli.toy import make_tiny_model
    from grpo_trainer.modeling.export import inference_weight_metadata

    peft_model = _lora(make_tiny_model(tokenizer))
    yielded = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in inference_weights(peft_model)]
    assert inference_weight_metadata(peft_model) == yielded
