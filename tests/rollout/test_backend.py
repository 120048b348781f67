"""The rollout-backend interface: the registry, selection by name, and a user backend driving a real training run."""

import pytest
import torch

from grpo_trainer import GRPOTrainer, rollout
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout import BACKENDS, Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import TWO_GROUPS_OF_4, make_args, make_trainer


def test_built_in_backends_declare_their_capabilities():
    assert set(BACKENDS) >= {"fast", "generate"}
    fast, generate = BACKENDS["fast"].capabilities, BACKENDS["generate"].capabilities
    assert fast.sampling_logps and fast.layer_outputs and fast.sampling_probs
    assert not (generate.sampling_logps or generate.layer_outputs or generate.sampling_probs)
    assert generate.stop_strings and not fast.stop_strings


def test_an_unknown_backend_is_refused_before_any_model_is_loaded(tmp_path, tokenizer, toy_dataset):
    args = make_args(tmp_path, **TWO_GROUPS_OF_4, generation_backend="nonexistent")
    # The model id does not exist: loading it would fail differently; the backend is checked first.
    with pytest.raises(ValueError, match="unknown generation_backend 'nonexistent'; choose one of"):
        GRPOTrainer("no/such-model", copy_digits_reward, args=args, train_dataset=toy_dataset,
                    processing_class=tokenizer)


def test_a_registered_backend_is_selected_by_name_and_trains(tmp_path, tiny_model, tokenizer, toy_dataset,
                                                             monkeypatch):
    calls = []

    class Recording(RolloutBackend):
        capabilities = Capabilities()

        def generate(self, model, prompts, config, capture=rollout.capture.KEEP_NOTHING):
            calls.append((prompts.ids.shape, config.max_new_tokens, capture))
            return generate_rollout(model, prompts, config)

    monkeypatch.setitem(BACKENDS, "recording", Recording)  # undone after the test
    register_backend("recording")(Recording)
    with pytest.raises(ValueError, match="already registered as 'recording'"):
        register_backend("recording")(type("Other", (Recording,), {}))
    # Seed 42: a round whose rewards differ within a group (with seed 0 the one step's advantages are all 0).
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=tiny_model, **TWO_GROUPS_OF_4, max_steps=1,
                           max_completion_length=4, seed=42, generation_backend="recording")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert len(calls) == 1 and calls[0][0][0] == 8 and calls[0][1] == 4
    assert isinstance(calls[0][2], rollout.Capture)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("kwargs, device, cache, decoder", [
    ({}, "cpu", "model", True),  # the fast decoder for its architectures
    ({}, "cuda", "model", False),  # on CUDA the fast backend samples with model.generate (FastBackend decision 5)
    ({"generation_backend": "generate"}, "cpu", "model", False),
    ({"use_transformers_continuous_batching": True}, "cpu", "paged", False),
    ({"use_vllm": True, "vllm_mode": "colocate"}, "cuda", "engine", False),
    ({"use_vllm": True, "vllm_mode": "server"}, "cuda", "remote", False),
])
def test_memory_profile_follows_the_backend_the_runtime_selects(tmp_path, kwargs, device, cache, decoder):
    from grpo_trainer import GRPOConfig
    from grpo_trainer.config.settings import backend_choice
    from grpo_trainer.rollout.backend import memory_profile
    from grpo_trainer.rollout.fast.guard import ARCHITECTURES

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)
    profile = memory_profile(backend_choice(args), device)
    assert profile.cache == cache
    assert profile.decoder_architectures == (frozenset(ARCHITECTURES) if decoder else frozenset())
    assert profile.layer_outputs == decoder  # replay of layer outputs: the decoder's alone
