"""vLLM in the training process (`vllm_mode='colocate'`), against the policy itself: greedy completions equal
`model.generate`'s, vLLM's log-probs equal the trainer's (float32 on both sides), and after optimizer steps, LoRA
included, the engine holds the trained weights."""

from __future__ import annotations

import pytest
import torch

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.config.settings import sampling_settings
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import make_generation_config
from tests.vllm_integration.vllm_helpers import ON_GPU, trainer_args, vllm_tiny_model

PROMPTS = ["copy 123:", "copy 98765:", "c", "copy 4:"]
LOGP_ATOL = 1e-4  # float32 on both sides; different kernels agree to ~1e-6, a stale weight is off by > 1e-2


def _trainer(tmp_path, tokenizer, model=None, **overrides):
    model = model if model is not None else vllm_tiny_model(tokenizer)
    return GRPOTrainer(model, copy_digits_reward, args=trainer_args(tmp_path, **overrides),
                       train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)


def _prompts(trainer, repeats=1):
    texts = [t for t in PROMPTS for _ in range(repeats)]
    return tokenize_prompts(trainer.processing_class, texts, None).to(trainer.accelerator.device)


def _config(trainer, **changes):
    config = make_generation_config(sampling_settings(trainer.args), trainer.model.generation_config,
                                    trainer.processing_class, 12)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _engine_rollout(trainer, prompts, config):
    trainer.rollout_backend.sync_weights(trainer.accelerator.unwrap_model(trainer.model), trainer.state.global_step)
    return trainer.rollout_backend.generate(trainer.model, prompts, config)


def _policy_logps(model, rollout, temperature):
    """The trainer's log-probs `[B, T]` of the rollout's completion tokens."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    with torch.no_grad():
        return completion_logprobs(model, ids, mask, rollout.completion_ids.shape[1], temperature).logps


def _assert_engine_matches(model, out, temperature):
    trainer_logps = _policy_logps(model, out, temperature)
    mask = out.completion_mask.bool()
    gap = (out.sampler.logps - trainer_logps)[mask].abs().max().item()
    assert gap < LOGP_ATOL, gap
    return gap


def test_greedy_completions_equal_generate_and_logps_equal_the_trainers(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer)
    assert type(trainer.rollout_backend).__name__ == "VLLMBackend"
    prompts = _prompts(trainer)
    config = _config(trainer, do_sample=False)
    out = _engine_rollout(trainer, prompts, config)
    reference = generate_rollout(trainer.model, prompts, config)
    assert torch.equal(out.completion_ids, reference.completion_ids)
    assert torch.equal(out.completion_mask, reference.completion_mask)
    assert len({tuple(row.tolist()) for row in out.completion_ids}) > 1  # the prompts' completions differ
    _assert_engine_matches(trainer.model, out, temperature=1.0)  # greedy: vLLM reports the raw log-probs


def test_sampled_groups_are_in_row_order_with_the_trainers_logps_at_the_temperature(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, temperature=0.7)
    prompts = _prompts(trainer, repeats=4)  # 4 prompts x G=4 rows, one vLLM request with n=4 per prompt
    out = _engine_rollout(trainer, prompts, _config(trainer))
    assert out.completion_ids.shape[0] == 16 and torch.equal(out.prompt_ids, prompts.ids)
    # processed log-probs: log softmax(logits / 0.7), the distribution sampled from, as the trainer computes it
    _assert_engine_matches(trainer.model, out, temperature=0.7)
    groups = out.completion_ids.view(4, 4, -1)
    assert any(len({tuple(r.tolist()) for r in group}) > 1 for group in groups)  # G samples, not one repeated


def test_after_optimizer_steps_the_engine_samples_with_the_new_weights(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, max_steps=3)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(start[n], p) for n, p in trainer.model.named_parameters())
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 3
    # the rollouts of steps 2 and 3 ran after weight changes: vLLM's log-probs were still the trainer's
    assert all(h["sampling/sampling_logp_difference/max"] < LOGP_ATOL for h in steps), steps
    # and now: greedy equals the trained policy's generate, and its log-probs are far from the initial weights'
    prompts, config = _prompts(trainer), _config(trainer, do_sample=False)
    out = _engine_rollout(trainer, prompts, config)
    assert torch.equal(out.completion_ids, generate_rollout(trainer.model, prompts, config).completion_ids)
    _assert_engine_matches(trainer.model, out, temperature=1.0)
    initial = vllm_tiny_model(tokenizer).to(trainer.accelerator.device)
    stale_gap = (out.sampler.logps - _policy_logps(initial, out, 1.0))[out.completion_mask.bool()].abs().max()
    assert stale_gap > 100 * LOGP_ATOL


def test_lora_training_pushes_the_merged_weights(tmp_path, tokenizer):
    from peft import LoraConfig

    model = vllm_tiny_model(tokenizer)
    trainer = GRPOTrainer(model, copy_digits_reward, args=trainer_args(tmp_path, max_steps=2, learning_rate=5e-2),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer,
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    trainer.train()
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert all(h["sampling/sampling_logp_difference/max"] < LOGP_ATOL for h in steps), steps
    prompts, config = _prompts(trainer), _config(trainer, do_sample=False)
    out = _engine_rollout(trainer, prompts, config)
    assert torch.equal(out.completion_ids, generate_rollout(trainer.model, prompts, config).completion_ids)
    _assert_engine_matches(trainer.model, out, temperature=1.0)
    # the adapter moved the policy away from its base weights, and the engine followed
    with trainer.model.disable_adapter():
        base_gap = (out.sampler.logps - _policy_logps(trainer.model, out, 1.0))[out.completion_mask.bool()]
    assert base_gap.abs().max() > 10 * LOGP_ATOL


def test_structured_outputs_regex_constrains_completions(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, vllm_structured_outputs_regex="[0-9]{3}", max_completion_length=6)
    out = _engine_rollout(trainer, _prompts(trainer, repeats=2), _config(trainer, max_new_tokens=6))
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    assert all(len(t) == 3 and t.isdigit() for t in texts), texts


@pytest.mark.skipif(ON_GPU, reason="sleep mode exists on CUDA")
def test_sleep_mode_is_refused_on_cpu_before_any_model_loads(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"vllm_enable_sleep_mode=True: vLLM's sleep mode is not supported on this "
                                         r"platform \(cpu\)"):
        GRPOTrainer("no/such-model", copy_digits_reward, args=trainer_args(tmp_path, vllm_enable_sleep_mode=True),
                    train_dataset=copy_digits_dataset(num_prompts=8), processing_class=tokenizer)


@pytest.mark.skipif(ON_GPU, reason="the GPU kernels run head_dim 16")
def test_a_head_size_vllm_cpu_cannot_run_is_refused_before_the_engine_starts(tmp_path, tokenizer, tiny_model):
    with pytest.raises(ValueError, match="head size is 16"):
        _trainer(tmp_path, tokenizer, model=tiny_model)  # hidden 64 / 4 heads


def test_generation_kwargs_are_vllm_sampling_parameters(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"generation_kwargs \['do_sample'\] are not vLLM sampling parameters"):
        _trainer(tmp_path, tokenizer, generation_kwargs={"do_sample": False})
    trainer = _trainer(tmp_path, tokenizer, generation_kwargs={"seed": 7, "max_tokens": 3})
    out = _engine_rollout(trainer, _prompts(trainer), _config(trainer))
    assert out.completion_ids.shape[1] <= 3  # vLLM's own name overrides max_completion_length, as in TRL
