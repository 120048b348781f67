"""The weight-sync self-check against real vLLM (`rollout.vllm.sync_check`): a correct sync passes every check, and
a broken one stops the run at the first check after it, naming what differs: a name mapped onto the wrong
parameter, a name vLLM silently drops, a push that never reached the engine (colocate and server)."""

from __future__ import annotations

import pytest

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.modeling import export
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.vllm import colocate, server
from grpo_trainer.rollout.vllm.sync_check import WeightSyncError
from tests.vllm_integration.test_vllm_server import _server_trainer
from tests.vllm_integration.vllm_helpers import trainer_args, vllm_tiny_model


def _trainer(tmp_path, tokenizer, **overrides):
    args = trainer_args(tmp_path, **{"vllm_sync_check_interval": 1, **overrides})
    return GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward, args=args,
                       train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)


def _renamed_in_transit(monkeypatch, rename):
    """Rename the weights between the trainer and the engine (a broken name mapping on the way)."""
    load = colocate.ColocateEngine.load_weights
    monkeypatch.setattr(colocate.ColocateEngine, "load_weights",
                        lambda self, weights: load(self, ((rename(n), t) for n, t in weights)))


def test_a_correct_sync_passes_the_check_after_every_push(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, max_steps=3)
    trainer.train()
    schedule = trainer.rollout_backend.schedule
    assert schedule.checks == 3  # one per push: steps 0, 1 and 2
    # float32 on both sides: the engine's log-probs of the probed tokens are the trainer's to float error
    assert all(tokens > 0 and gap < 1e-5 for gap, tokens in schedule.gaps), schedule.gaps


def test_every_n_pushes(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, max_steps=4, vllm_sync_check_interval=3)
    trainer.train()
    assert trainer.rollout_backend.schedule.pushes == 4 and trainer.rollout_backend.schedule.checks == 2  # 1st, 4th


def test_names_mapped_onto_the_wrong_parameters_are_named(tmp_path, tokenizer, monkeypatch):
    # an off-by-one layer index: layer 0's output projection arrives as layer 1's and the other way round. vLLM
    # loads each exactly once and says nothing (a name it does not know, or one sent twice, it refuses itself).
    swap = {"model.layers.0.self_attn.o_proj.weight": "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight"}
    _renamed_in_transit(monkeypatch, lambda name: swap.get(name, name))
    trainer = _trainer(tmp_path, tokenizer)
    with pytest.raises(WeightSyncError) as failure:
        trainer.train()
    message = str(failure.value)
    assert "after weight push 1 (optimizer step 0)" in message
    # 27 compared: the 26 tensors of the model, and the tied head under its own name (vLLM's CPU copy of it)
    assert ("Parameter groups whose vLLM values differ from the policy's (2 of 27 compared): "
            "model.layers.0.self_attn.o_proj.weight, model.layers.1.self_attn.o_proj.weight.") in message
    assert "did not reach" not in message and "failed to map" not in message


def test_a_name_vllm_silently_drops_is_named(tmp_path, tokenizer, monkeypatch):
    # the export names the final norm as a rotary-embedding buffer, which vLLM's Qwen2 loader skips without a word:
    # the norm keeps the engine's placeholder values
    original = export._checkpoint_name
    monkeypatch.setattr(export, "_checkpoint_name", lambda name, adapter: "model.rotary_emb.inv_freq"
                        if name == "model.norm.weight" else original(name, adapter))
    trainer = _trainer(tmp_path, tokenizer)
    with pytest.raises(WeightSyncError) as failure:
        trainer.train()
    message = str(failure.value)
    assert "Names that failed to map onto any vLLM parameter: model.rotary_emb.inv_freq." in message
    assert "vLLM parameters the push did not reach: model.norm.weight." in message


def test_a_skipped_push_is_caught_at_the_next_check(tmp_path, tokenizer, monkeypatch):
    pushes = []
    load = colocate.ColocateEngine.load_weights

    def second_push_lost(self, weights):
        pushes.append(1)
        if len(pushes) == 2:
            for _ in weights:  # consumed, never loaded
                pass
            return []
        return load(self, weights)

    monkeypatch.setattr(colocate.ColocateEngine, "load_weights", second_push_lost)
    trainer = _trainer(tmp_path, tokenizer, max_steps=3)
    with pytest.raises(WeightSyncError) as failure:
        trainer.train()
    message = str(failure.value)
    assert "after weight push 2 (optimizer step 1)" in message
    assert "Every weight differs: the push did not reach the engine." in message
    assert trainer.state.global_step == 1  # stopped before training on the stale round


def test_a_skipped_push_to_a_server_is_caught(tmp_path, tokenizer, served_model, vllm_server, monkeypatch):
    pushes = []
    push = server.ServerWeights.push

    def second_push_lost(self, model):
        pushes.append(1)
        return [] if len(pushes) == 2 else push(self, model)

    monkeypatch.setattr(server.ServerWeights, "push", second_push_lost)
    trainer = _server_trainer(tmp_path, tokenizer, served_model, vllm_server, max_steps=3,
                              vllm_sync_check_interval=1)
    assert trainer.rollout_backend.client.inspection  # `grpo-train vllm-serve` loads the inspection extension
    with pytest.raises(WeightSyncError, match=r"after weight push 2 \(optimizer step 1\).*Parameter groups whose vLLM "
                                              r"values differ from the policy's"):
        trainer.train()
    # the server keeps step 1's weights; the next test session pushes its own


def test_with_async_rollouts_the_check_runs_after_each_push_on_the_main_thread(tmp_path, tokenizer):
    """Rounds sampled on the producer thread (`rollout.vllm.backend`, decision 6): every push after the first round
    is checked on the main thread, on that round's rows, and passes."""
    trainer = _trainer(tmp_path, tokenizer, max_steps=3, async_rollouts=1)
    trainer.train()
    schedule = trainer.rollout_backend.schedule
    assert schedule.pushes == 3 and schedule.checks == 2  # pushes 2 and 3: the first comes before any round
    assert all(tokens > 0 and gap < 1e-5 for gap, tokens in schedule.gaps), schedule.gaps


def test_with_async_rollouts_a_skipped_push_is_caught(tmp_path, tokenizer, monkeypatch):
    pushes = []
    load = colocate.ColocateEngine.load_weights

    def second_push_lost(self, weights):
        pushes.append(1)
        if len(pushes) == 2:
            for _ in weights:  # consumed, never loaded
                pass
            return []
        return load(self, weights)

    monkeypatch.setattr(colocate.ColocateEngine, "load_weights", second_push_lost)
    trainer = _trainer(tmp_path, tokenizer, max_steps=3, async_rollouts=1)
    with pytest.raises(WeightSyncError, match=r"after weight push 2 \(optimizer step 1\)"):
        trainer.train()
    assert trainer.state.global_step == 1
