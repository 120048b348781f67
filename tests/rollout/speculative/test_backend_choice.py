"""Asking for speculative rollouts asks for the fast decoder everywhere: on CUDA too, where the fast backend otherwise
samples with `model.generate` (`rollout.fast.backend`, decisions 5 and 7), and a setting that keeps `generate` there
is refused by name."""

import pytest

from grpo_trainer.rollout.backend import memory_profile, select
from grpo_trainer.rollout.fast.backend import CUDA_DECODE_ENV, FastBackend
from grpo_trainer.rollout.settings import BackendChoice
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

ON = SpeculativeSettings()


def test_the_decoder_serves_drafts_on_cuda(monkeypatch):
    monkeypatch.delenv(CUDA_DECODE_ENV, raising=False)
    backend = select(BackendChoice("fast", speculative=ON))
    assert isinstance(backend, FastBackend) and backend.speculation is not None
    assert not backend.uses_generate_on("cuda") and backend.decode_mode("cuda") == "eager"
    assert FastBackend().uses_generate_on("cuda")  # without drafts: decision 5 as before
    profile = memory_profile(BackendChoice("fast", speculative=ON), "cuda")
    assert "qwen2" in profile.decoder_architectures and profile.verify_positions == ON.max_verify_tokens
    assert memory_profile(BackendChoice("fast"), "cuda").decoder_architectures == frozenset()


def test_keeping_generate_on_cuda_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(CUDA_DECODE_ENV, "generate")
    with pytest.raises(ValueError, match=f"speculative_rollouts=True .* but {CUDA_DECODE_ENV}='generate' samples"):
        FastBackend(speculative=ON)
    with pytest.raises(ValueError, match="FastBackend\\(cuda='generate'\\) samples with model.generate"):
        FastBackend(cuda="generate", speculative=ON)
