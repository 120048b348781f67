"""Model loading options: custom code (trust_remote_code), the float32 LM head, the MoE router auxiliary loss's
weight, and the Liger kernel settings; each with TRL 1.16's semantics."""

import json
import os
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from grpo_trainer.modeling.logprobs import Float32Head
from grpo_trainer.runtime import models
from tests.helpers import write_remote_code_model


def _llama(tokenizer, tied: bool, dtype=torch.float32):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _moe(tokenizer, **overrides):
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, **overrides)
    return AutoModelForCausalLM.from_config(config)


# ------------------------------------------------------------------------------------------- custom code


def test_untrusted_custom_code_is_refused_before_anything_loads(tmp_path, tokenizer):
    folder = write_remote_code_model(tmp_path / "remote", tokenizer)
    with pytest.raises(ValueError, match="contains custom code.*trust_remote_code=True"):
        models.check_remote_code(folder, trust_remote_code=False)
    with pytest.raises(ValueError, match="custom code"):
        models.load_policy(folder, None)
    models.check_remote_code(folder, trust_remote_code=True)


def test_trust_remote_code_reaches_the_model_and_tokenizer_loads(tmp_path, tokenizer):
    policy = write_remote_code_model(tmp_path / "policy", tokenizer)
    reward = write_remote_code_model(tmp_path / "reward", tokenizer, task="reward")
    assert type(models.load_policy(policy, None, trust_remote_code=True)).__name__ == "TinyRemoteForCausalLM"
    assert type(models.load_tokenizer(policy, True)).__name__ == "TinyRemoteTokenizer"
    reward_model, reward_tokenizer = models.load_reward_model(reward, None, trust_remote_code=True)
    assert type(reward_model).__name__ == "TinyRemoteForSequenceClassification"
    assert type(reward_tokenizer).__name__ == "TinyRemoteTokenizer"
    # model_init_kwargs may set it too (TRL: model_init_kwargs win over GRPOConfig.trust_remote_code)
    assert type(models.load_policy(policy, {"trust_remote_code": True})).__name__ == "TinyRemoteForCausalLM"


def test_an_auto_map_for_an_architecture_transformers_has_needs_no_trust(tmp_path, tokenizer):
    """Many Hub checkpoints keep an auto_map from before transformers implemented them (model_type 'llama' here):
    transformers then runs its own code, so there is nothing to trust."""
    folder = tmp_path / "native"
    _llama(tokenizer, tied=False).save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_old.OldLlama"}}))
    models.check_remote_code(str(folder), trust_remote_code=False)
    assert type(models.load_policy(str(folder), None)).__name__ == "LlamaForCausalLM"


def test_a_hub_id_that_is_not_available_offline_is_left_to_from_pretrained():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    models.check_remote_code("an-org/a-model-that-is-not-cached", trust_remote_code=False)


# ------------------------------------------------------------------------------------------ float32 head


def test_cast_lm_head_to_fp32_keeps_the_weights_in_float32_and_the_rest_as_it_was(tokenizer):
    model = _llama(tokenizer, tied=False, dtype=torch.bfloat16)
    weight = model.lm_head.weight.detach().clone()
    models.cast_lm_head_to_fp32(model)
    head = model.get_output_embeddings()
    assert type(head) is Float32Head and head.weight.dtype == torch.float32 and head.weight.requires_grad
    assert torch.equal(head.weight, weight.float())  # bf16 -> float32 is exact
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    models.cast_lm_head_to_fp32(model)  # idempotent: a copy of a cast policy (the reference) stays as it is
    assert model.get_output_embeddings() is head


def test_cast_lm_head_to_fp32_keeps_a_tied_head_tied_in_float32_and_the_embeddings_outputs_in_their_dtype(
        tokenizer):
    """As TRL does for Gemma-2-style tied heads: the one shared weight becomes float32; the embedding's outputs are
    cast back to bf16, so the layers' inputs keep their dtype, while the logits are computed in float32."""
    model = _llama(tokenizer, tied=True, dtype=torch.bfloat16)
    weight = model.lm_head.weight.detach().clone()
    models.cast_lm_head_to_fp32(model)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is Float32Head and head.weight is embedding.weight and head.weight.dtype == torch.float32
    assert torch.equal(head.weight, weight.float())
    ids = torch.tensor([[3, 4, 5]])
    assert embedding(ids).dtype == torch.bfloat16
    assert model(input_ids=ids).logits.dtype == torch.float32


def test_cast_lm_head_to_fp32_refuses_a_head_under_a_peft_wrapper(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(tokenizer, tied=False), LoraConfig(r=2, target_modules=["q_proj"],
                                                                    modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True needs a plain nn.Linear LM head"):
        models.cast_lm_head_to_fp32(model)


# ------------------------------------------------------------------------------------- router aux loss


@pytest.mark.parametrize(("coef", "expected"), [
    (None, 0.001),  # Qwen3-MoE's own default coefficient
    (0.0, 0.0),  # off
    (0.5, 0.5),  # the user's
])
def test_router_aux_loss_coef_defaults_to_the_models_own(tokenizer, coef, expected):
    assert models.router_aux_loss_coef(_moe(tokenizer), coef) == expected


def test_router_aux_loss_coef_reads_the_config_of_the_model(tokenizer):
    assert models.router_aux_loss_coef(_moe(tokenizer, router_aux_loss_coef=0.02), None) == 0.02


def test_router_aux_loss_coef_on_a_dense_model(tiny_model):
    assert models.router_aux_loss_coef(tiny_model, None) == 0.0  # nothing to add
    assert models.router_aux_loss_coef(tiny_model, 0.0) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.1 but Qwen2ForCausalLM is not a Mixture-of-Experts"):
        models.router_aux_loss_coef(tiny_model, 0.1)


# ------------------------------------------------------------------------------------------------ Liger


def test_liger_kernel_config_keeps_the_models_forward():
    with pytest.warns(FutureWarning, match="use_liger_kernel=True is deprecated"):
        assert models.liger_kernel_config({"rope": True}) == {"rope": True, "fused_linear_cross_entropy": False}
    with warnings.catch_warnings(), pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        warnings.simplefilter("ignore")
        models.liger_kernel_config({"fused_linear_cross_entropy": True})
