"""Asynchronous rollouts with real vLLM (`async_rollouts=1`), the set-up docs/ASYNC.md says asynchrony is for:
every round is sampled by the engine with exactly the weights of its version (the trainer's log-probs under a copy
of those weights equal the engine's), in the training process (colocate) and on a server; and a colocated run saved
after 2 steps and resumed for 2 more ends with the weights of 4 straight steps."""

from __future__ import annotations

import copy

import torch
from transformers import TrainerCallback

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.trainer import round_builder
from tests.helpers import StopAt
from tests.vllm_integration.test_vllm_colocate import LOGP_ATOL, _policy_logps
from tests.vllm_integration.vllm_helpers import trainer_args, vllm_tiny_model


class WeightSnapshots(TrainerCallback):
    """The weights after each optimizer step (version v = after v steps); version 0 taken at construction."""

    def __init__(self, model):
        self.model, self.versions = model, {0: self._copy(model)}

    @staticmethod
    def _copy(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_step_end(self, args, state, control, **kwargs):
        self.versions[state.global_step] = self._copy(self.model)


def _record_rounds(monkeypatch):
    """Every round the producer samples: (version, the rollout)."""
    rounds = []
    sample = round_builder.RoundBuilder.sample

    def recording(self, batch, mode, policy, state):
        out = sample(self, batch, mode, policy, state)
        rounds.append((policy.version, out.rollout))
        return out

    monkeypatch.setattr(round_builder.RoundBuilder, "sample", recording)
    return rounds


def _assert_each_round_sampled_with_its_versions_weights(trainer, rounds, snapshots):
    assert [version for version, _ in rounds] == [0, 0, 1]  # round r + 1 with the weights after r steps
    for version, rollout in rounds:
        at_version = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
        at_version.load_state_dict(snapshots.versions[version])
        mask = rollout.completion_mask.bool()
        gap = (rollout.sampler.logps - _policy_logps(at_version, rollout, 1.0))[mask].abs().max().item()
        assert gap < LOGP_ATOL, (version, gap)  # a stale weight is off by > 1e-2
    changed = any(not torch.equal(snapshots.versions[0][k], snapshots.versions[1][k]) for k in snapshots.versions[0])
    assert changed  # version 1 differs from version 0, so the check above tells them apart


def _train(trainer):
    snapshots = WeightSnapshots(trainer.accelerator.unwrap_model(trainer.model))
    trainer.add_callback(snapshots)
    trainer.train()
    return snapshots


def test_colocated_engine_samples_each_round_with_the_weights_of_its_version(tmp_path, tokenizer, monkeypatch):
    rounds = _record_rounds(monkeypatch)
    trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward,
                          args=trainer_args(tmp_path, async_rollouts=1, max_steps=3, learning_rate=0.05),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    snapshots = _train(trainer)
    _assert_each_round_sampled_with_its_versions_weights(trainer, rounds, snapshots)
    staleness = [row["async/staleness"] for row in trainer.state.log_history if "async/staleness" in row]
    assert staleness == [0.0, 1.0, 1.0]


def test_server_samples_each_round_with_the_weights_of_its_version(tmp_path, tokenizer, served_model, vllm_server,
                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM

    rounds = _record_rounds(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    args = trainer_args(tmp_path, vllm_mode="server", vllm_server_base_url=vllm_server, vllm_server_timeout=60,
                        async_rollouts=1, max_steps=3, learning_rate=0.05)
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=32),
                          processing_class=tokenizer)
    snapshots = _train(trainer)
    _assert_each_round_sampled_with_its_versions_weights(trainer, rounds, snapshots)


def test_colocated_async_run_resumes_to_the_weights_of_a_straight_run(tmp_path, tokenizer):
    def run(output_dir, stop=False, resume=None):
        args = trainer_args(output_dir, async_rollouts=1, max_steps=4, optim="sgd", learning_rate=0.05,
                            save_strategy="steps", save_steps=2)
        trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward, args=args,
                              train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer,
                              callbacks=[StopAt(2)] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}

    straight = run(tmp_path / "straight")
    run(tmp_path / "split", stop=True)  # saved at step 2 with round 2 sampled ahead
    resumed = run(tmp_path / "split", resume=str(tmp_path / "split" / "checkpoint-2"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6, msg=name)
