"""Helpers shared by test modules: tiny models of each decoder family, grouped prompts, greedy settings, and rollout
comparisons. Everything is built offline from configs."""

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen3Config

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.types import PromptBatch, Rollout

MAX_NEW = 12


def model_of_kind(kind: str, tokenizer):
    """A tiny randomly initialised model of each supported family (seeded)."""
    if kind == "qwen2":
        return make_tiny_model(tokenizer, seed=1)
    common = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = {"llama": lambda: LlamaConfig(**common, attention_bias=True),  # biased q/k/v/o
              "qwen3": lambda: Qwen3Config(**common, head_dim=24),  # q/k RMSNorm, head_dim != hidden / heads
              "mistral": lambda: MistralConfig(**common, sliding_window=4096),  # a window longer than any test
              # Llama 3.x: frequency-dependent rotary scaling, untied LM head, no biases.
              "llama3": lambda: LlamaConfig(**common, rope_scaling={
                  "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}),
              "gpt2": lambda: GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)}[kind]()
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def grouped_prompts(tokenizer, repeats: int = 2) -> PromptBatch:
    """Three prompts of different lengths (left padding differs per row), each repeated as a GRPO group."""
    texts = [t for t in ["copy 123:", "copy 98765:", "c"] for _ in range(repeats)]
    return tokenize_prompts(tokenizer, texts, None)


def greedy_config(tokenizer, **overrides) -> GenerationConfig:
    settings = {"do_sample": False, "max_new_tokens": MAX_NEW, "eos_token_id": [tokenizer.eos_token_id],
                "pad_token_id": tokenizer.pad_token_id, "disable_compile": True}
    return GenerationConfig(**{**settings, **overrides})


def fast_rollout(model, prompts: PromptBatch, config: GenerationConfig, **capture) -> Rollout:
    """The fast backend's rollout, keeping the replay tensors named in `capture` (`layer_outputs`, `probs`)."""
    return FastBackend().generate(model, prompts, config, Capture(**capture))


def assert_same_rollout(fast: Rollout, reference: Rollout) -> None:
    assert torch.equal(fast.completion_ids, reference.completion_ids)
    assert torch.equal(fast.completion_mask, reference.completion_mask)
    assert torch.equal(fast.is_truncated, reference.is_truncated)


def copy_task_trainer(output_dir, tokenizer, dataset, reward_funcs=None, model=None, **overrides):
    """A GRPOTrainer on the toy copy task with a tiny seeded model: 4 completions per step, G=2, short completions,
    no checkpoints unless asked for."""
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_reward

    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, learning_rate=0.01, max_steps=2, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0, disable_tqdm=True)
    settings.update(overrides)
    return GRPOTrainer(model if model is not None else make_tiny_model(tokenizer, seed=7),
                       reward_funcs if reward_funcs is not None else copy_digits_reward,
                       args=GRPOConfig(**settings), train_dataset=dataset, processing_class=tokenizer)
