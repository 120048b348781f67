"""A LoRA policy's weights inside a real vLLM engine after a push, read back from the engine under checkpoint names
(`rollout.vllm.inspection`), against PEFT's own `merge_and_unload()`: vanilla LoRA, rank-stabilised scaling,
`lora_bias` and DoRA, colocated and on a server."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.modeling.export import inference_weight_metadata
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.vllm.inspection import encode_metadata
from tests.vllm_integration.test_vllm_server import _server_trainer
from tests.vllm_integration.vllm_helpers import trainer_args, vllm_tiny_model

# Qwen2's q/k/v projections have a bias (lora_bias needs one); o_proj and the MLP's projections do not
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
SETTINGS = {
    "vanilla": {},
    "rslora": {"use_rslora": True},  # scaling alpha / sqrt(r) = 8 / 2 = 4 instead of alpha / r = 2
    "lora_bias": {"lora_bias": True, "target_modules": ["q_proj", "k_proj", "v_proj"]},  # b' = b + B.bias * s
    "dora": {"use_dora": True},  # PEFT's in-place merge (the magnitude renormalises each merged row)
}


def _adapted(model, settings):
    """`model` with a LoRA adapter whose every tensor is non-zero (B, and B's bias, start at zero, which would hide
    a wrong merge)."""
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **settings})
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def _base_layer(name: str) -> str:
    """PEFT's name of a LoRA layer's original parameter: q_proj.weight -> q_proj.base_layer.weight."""
    module, _, attribute = name.rpartition(".")
    return f"{module}.base_layer.{attribute}"


def _assert_engine_holds_peft_merge(trainer, tmp_path):
    backend = trainer.rollout_backend
    policy = trainer.accelerator.unwrap_model(trainer.model)
    backend.sync_weights(policy, 0)
    metadata = encode_metadata(inference_weight_metadata(policy))
    engine = backend.engine if backend.engine is not None else backend.client
    path = engine.inspect("grpo_save_checkpoint_weights", metadata, str(tmp_path))
    held = load_file(path)
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert sorted(held) == sorted(reference)  # every weight, the tied head included, read back
    base = policy.get_base_model().state_dict()
    changed = {n for n in reference if not torch.equal(reference[n], base.get(_base_layer(n), reference[n]))}
    weights = {n for n in reference if _base_layer(n) in base and n.endswith(".weight")}
    biases = {n for n in reference if _base_layer(n) in base and n.endswith(".bias")}
    lora_bias = policy.peft_config["default"].lora_bias
    assert weights and changed == (weights | biases if lora_bias else weights)  # what the adapter changes
    for name, value in reference.items():
        torch.testing.assert_close(held[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", sorted(SETTINGS))
def test_colocated_engine_holds_the_peft_merge(tmp_path, tokenizer, variant):
    model = _adapted(vllm_tiny_model(tokenizer), SETTINGS[variant])
    trainer = GRPOTrainer(model, copy_digits_reward, args=trainer_args(tmp_path / "run"),
                          train_dataset=copy_digits_dataset(num_prompts=8), processing_class=tokenizer)
    _assert_engine_holds_peft_merge(trainer, tmp_path)


@pytest.mark.parametrize("variant", sorted(SETTINGS))
def test_server_holds_the_peft_merge(tmp_path, tokenizer, served_model, vllm_server, variant):
    trainer = _server_trainer(tmp_path / "run", tokenizer, served_model, vllm_server)
    trainer.model = _adapted(trainer.model, SETTINGS[variant])  # the served model with an adapter on top
    _assert_engine_holds_peft_merge(trainer, tmp_path)
