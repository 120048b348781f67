"""Model options of TRL 1.16 on real tiny training runs: custom-code checkpoints (trust_remote_code), the MoE router
auxiliary loss (router_aux_loss_coef), a float32 LM head (cast_lm_head_to_fp32) and fixed-multiple padding
(pad_to_multiple_of)."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from grpo_trainer import GRPOTrainer
from grpo_trainer.modeling.logprobs import Float32Head
from tests.helpers import make_args, make_trainer, train_and_compare, varied_reward, write_remote_code_model


def stuck(trainer) -> list[str]:
    """Trains; the trainable parameters that did not change."""
    changed = train_and_compare(trainer)
    return [n for n, p in trainer.model.named_parameters() if p.requires_grad and not changed[n]]


def _common(tokenizer):
    return dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


MOE_CONFIGS = {
    "qwen3_moe": lambda common: Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, head_dim=8,
                                               num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda common: MixtralConfig(**common, intermediate_size=16, num_local_experts=4,
                                            num_experts_per_tok=2),
}


def moe_model(tokenizer, kind="qwen3_moe"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MOE_CONFIGS[kind](_common(tokenizer)))


# ------------------------------------------------------------------------------------------- custom code


def test_custom_code_checkpoints_need_trust_remote_code_then_train(tmp_path, tokenizer, toy_dataset):
    """TRL's test_trust_remote_code, offline: a checkpoint whose architecture is its own code is refused with an
    error naming custom code, and with trust_remote_code=True the policy, its tokenizer, a reward model and the
    reward model's tokenizer all load with their own classes, and the run trains."""
    policy = write_remote_code_model(tmp_path / "policy", tokenizer)
    reward = write_remote_code_model(tmp_path / "reward", tokenizer, task="reward")
    with pytest.raises(ValueError, match="custom code"):
        make_trainer(tmp_path, None, toy_dataset, varied_reward, policy)
    with pytest.raises(ValueError, match="custom code"):  # a reward model by path is checked the same way
        make_trainer(tmp_path, tokenizer, toy_dataset, reward)

    trainer = make_trainer(tmp_path, None, toy_dataset, [varied_reward, reward], policy, trust_remote_code=True)
    assert type(trainer.model).__name__ == "TinyRemoteForCausalLM"
    assert type(trainer.processing_class).__name__ == "TinyRemoteTokenizer"
    assert type(trainer.reward_funcs[1].model).__name__ == "TinyRemoteForSequenceClassification"
    assert trainer.reward_processing_classes[0] is None
    assert type(trainer.reward_processing_classes[1]).__name__ == "TinyRemoteTokenizer"
    assert stuck(trainer) == []


# ------------------------------------------------------------------------------------- router aux loss


@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_moe_models_train_with_their_router_aux_loss(tmp_path, tokenizer, toy_dataset, kind):
    """TRL's test_train on an MoE model: the aux loss is on by default (the config's coefficient) and logged as
    `aux_loss`; every parameter, router included, trains."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer, kind))
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001
    assert stuck(trainer) == []
    aux = [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]
    assert len(aux) == 2 and all(value > 0 for value in aux)


def test_router_aux_loss_coef_zero_turns_it_off(tmp_path, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer),
                           router_aux_loss_coef=0.0)
    assert not trainer.aux_loss_enabled
    train_and_compare(trainer)
    assert not any("aux_loss" in entry for entry in trainer.state.log_history)


def test_router_aux_loss_coef_on_a_dense_model_is_an_error(tmp_path, tiny_model, tokenizer, toy_dataset):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 but .* is not a Mixture-of-Experts model"):
        make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, router_aux_loss_coef=0.01)


def test_the_loss_adds_coef_times_aux_over_the_accumulation_steps(tmp_path, tokenizer, toy_dataset):
    """loss = policy loss + coef * aux / gradient_accumulation_steps (TRL 1.16), where aux is the router's
    load-balancing loss of the whole micro-batch, zero-advantage rows included (they are not skipped)."""
    coef, steps = 0.5, 4
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer),
                           router_aux_loss_coef=coef, gradient_accumulation_steps=steps, per_device_train_batch_size=2)
    model = trainer.model
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(8)], "train")
    inputs = trainer.scorer.prepare(round_, "train", trainer.model)
    inputs = dataclasses.replace(inputs, advantages=torch.tensor([1.0, 0.0, -1.0, 0.0, 0.5, 0.0, -0.5, 0.0]))
    ids = torch.cat([inputs.prompt_ids, inputs.completion_ids], 1)
    mask = torch.cat([inputs.prompt_mask, inputs.completion_mask], 1)
    with torch.no_grad():
        aux = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    output_router_logits=True).aux_loss
        with_aux = trainer.compute_loss(model, inputs)
        trainer.objective.settings = dataclasses.replace(trainer.objective.settings, router_aux_loss_coef=0.0)
        without = trainer.compute_loss(model, inputs)
    # coef 0.5, 4 accumulation steps: the aux term is aux / 8
    torch.testing.assert_close(with_aux - without, aux / 8, atol=1e-6, rtol=0)
    torch.testing.assert_close(trainer._metrics["train"]["aux_loss"][-1], aux, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------ float32 head


def test_cast_lm_head_to_fp32_trains_a_bf16_policy_with_a_float32_head(tmp_path, tokenizer, toy_dataset):
    """TRL's test_train_with_cast_lm_head_to_fp32 (untied heads): the policy's and the reference's heads are float32
    and train (the reference stays frozen); the rest of the model stays bf16."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**_common(tokenizer), intermediate_size=32, tie_word_embeddings=False), dtype=torch.bfloat16)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, model, cast_lm_head_to_fp32=True, beta=0.1)
    for lm in (trainer.model, trainer.ref_model):
        assert type(lm.lm_head) is Float32Head and lm.lm_head.weight.dtype == torch.float32
    assert trainer.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert stuck(trainer) == []
    assert trainer.model.lm_head.weight.dtype == torch.float32


def test_cast_lm_head_to_fp32_trains_a_tied_head(tmp_path, tokenizer, toy_dataset):
    """TRL's test_train_with_cast_lm_head_to_fp32[Gemma2] (tied embeddings): the shared weight trains in float32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**_common(tokenizer), intermediate_size=32, tie_word_embeddings=True), dtype=torch.bfloat16)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, model, cast_lm_head_to_fp32=True)
    head = trainer.model.lm_head
    assert type(head) is Float32Head and head.weight is trainer.model.model.embed_tokens.weight
    assert stuck(trainer) == []
    assert trainer.model.lm_head.weight.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- padding


def test_pad_to_multiple_of_pads_every_micro_batch_and_trains(tmp_path, tokenizer, toy_dataset):
    """TRL's test_train_with_pad_to_multiple_of, plus the shapes: every micro-batch the loss sees (after its own
    trim) has prompt and completion widths that are multiples of 8."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, pad_to_multiple_of=8,
                           gradient_accumulation_steps=2)
    seen, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append((inputs.prompt_ids.shape[1], inputs.completion_ids.shape[1]))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    assert stuck(trainer) == []
    # prompts "copy 123:" are 9-10 characters (plus BOS): 16 columns; completions of at most 6 tokens: 8 columns
    assert seen == [(16, 8)] * 4


def test_padding_to_a_multiple_leaves_the_loss_unchanged(tmp_path, tokenizer, toy_dataset):
    """Padding columns are masked everywhere: the same micro-batch padded to multiples of 8 gives the same loss."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, beta=0.1)
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(4)], "train")
    inputs = trainer.scorer.prepare(round_, "train", trainer.model)
    padded = dataclasses.replace(inputs, pad_to_multiple_of=8).padded(tokenizer.pad_token_id).trimmed()
    assert padded.prompt_ids.shape[1] % 8 == 0 and padded.completion_ids.shape[1] % 8 == 0
    assert padded.completion_ids.shape[1] > inputs.completion_ids.shape[1]
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(trainer.model, padded),
                                   trainer.compute_loss(trainer.model, inputs), atol=1e-6, rtol=0)


def test_skipping_zero_advantage_rows_is_refused_with_a_router_loss(tmp_path, tokenizer, toy_dataset):
    """The router's load-balancing loss covers every row: 'skip' would change the gradient."""
    with pytest.raises(ValueError, match="zero_variance_groups='skip' .* this Mixture-of-Experts model's router loss"):
        GRPOTrainer(moe_model(tokenizer), varied_reward, train_dataset=toy_dataset, processing_class=tokenizer,
                    args=make_args(tmp_path, router_aux_loss_coef=0.5, zero_variance_groups="skip"))
