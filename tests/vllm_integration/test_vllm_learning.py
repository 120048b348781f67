"""A learning run with vLLM on the toy task (copy 3 digits) against the same run without vLLM: the reward rises,
and about as much."""

from __future__ import annotations

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from grpo_trainer.rewards.library import copy_digits_reward
from tests.vllm_integration.vllm_helpers import trainer_args

STEPS, LOG_EVERY = 120, 5


def _rewards(tmp_path, tokenizer, use_vllm):
    # the demo's recipe, shorter: a random model, 16 samples per prompt, completions as long as the answer
    args = trainer_args(tmp_path / ("vllm" if use_vllm else "generate"), use_vllm=use_vllm,
                        per_device_train_batch_size=64, num_generations=16, max_completion_length=3,
                        max_steps=STEPS, logging_steps=LOG_EVERY, learning_rate=1e-3, lr_scheduler_type="constant",
                        beta=0.0)
    model = make_tiny_model(tokenizer, hidden_size=128, num_heads=4)  # head_dim 32, runnable by vLLM on CPU
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=256),
                          processing_class=tokenizer)
    trainer.train()
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def _rise(rewards):
    quarter = len(rewards) // 4
    return sum(rewards[-quarter:]) / quarter - sum(rewards[:quarter]) / quarter


def test_reward_rises_with_vllm_like_without(tmp_path, tokenizer):
    with_vllm, without = _rewards(tmp_path, tokenizer, True), _rewards(tmp_path, tokenizer, False)
    assert len(with_vllm) == len(without) == STEPS // LOG_EVERY
    assert _rise(without) > 0.05, without  # the task is learnable in this budget
    assert _rise(with_vllm) > 0.5 * _rise(without), (with_vllm, without)
