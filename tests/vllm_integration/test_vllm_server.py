"""Training against a real vLLM server (`vllm_mode='server'`, started with `grpo-train vllm-serve` by the
`vllm_server` fixture): the server's completions, its log-probs against the trainer's, the weight transfer after
optimizer steps, and the clear errors when no server answers."""

from __future__ import annotations

import time

import pytest
import torch

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.generate import generate_rollout
from tests.vllm_integration.test_vllm_colocate import (
    LOGP_ATOL,
    _assert_engine_matches,
    _config,
    _engine_rollout,
    _prompts,
)
from tests.vllm_integration.vllm_helpers import free_port, trainer_args


def _server_trainer(tmp_path, tokenizer, served_model, url, **overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    args = trainer_args(tmp_path, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30, **overrides)
    return GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=32),
                       processing_class=tokenizer)


def test_server_rollouts_and_weight_sync_after_optimizer_steps(tmp_path, tokenizer, served_model, vllm_server):
    trainer = _server_trainer(tmp_path, tokenizer, served_model, vllm_server, max_steps=3)
    prompts, greedy = _prompts(trainer), _config(trainer, do_sample=False)
    before = _engine_rollout(trainer, prompts, greedy)  # the served checkpoint = the policy
    assert torch.equal(before.completion_ids, generate_rollout(trainer.model, prompts, greedy).completion_ids)
    _assert_engine_matches(trainer.model, before, temperature=1.0)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 3 and all(h["sampling/sampling_logp_difference/max"] < LOGP_ATOL for h in steps), steps
    after = _engine_rollout(trainer, prompts, greedy)  # pushes the trained weights (new step)
    assert torch.equal(after.completion_ids, generate_rollout(trainer.model, prompts, greedy).completion_ids)
    _assert_engine_matches(trainer.model, after, temperature=1.0)
    assert not torch.equal(after.sampler.logps, before.sampler.logps)  # the server's weights changed


def test_a_server_that_does_not_answer_is_named_after_the_timeout(tmp_path, tokenizer):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = trainer_args(tmp_path, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=2)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"The vLLM server at {url} did not answer within "
                                              "vllm_server_timeout=2 s"):
        GRPOTrainer("no/such-model", copy_digits_reward, args=args, train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer)
    assert time.monotonic() - started < 30
