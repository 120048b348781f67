"""Asking for partial rollouts asks for the fast decoder's plain loop everywhere: on CUDA too, where the fast backend
otherwise samples with `model.generate` (`rollout.fast.backend`, decisions 5 and 8), and a setting that keeps
`generate` or the static steps there is refused by name."""

import pytest

from grpo_trainer import GRPOConfig
from grpo_trainer.config.settings import backend_choice
from grpo_trainer.rollout.backend import select
from grpo_trainer.rollout.fast.backend import CUDA_DECODE_ENV, FastBackend


def test_the_eager_decoder_serves_partial_rounds_on_cuda(monkeypatch, tmp_path):
    monkeypatch.delenv(CUDA_DECODE_ENV, raising=False)
    choice = backend_choice(GRPOConfig(output_dir=str(tmp_path), partial_rollouts=0.5))
    assert choice.partial
    backend = select(choice)
    assert isinstance(backend, FastBackend)
    assert not backend.uses_generate_on("cuda") and backend.decode_mode("cuda") == "eager"
    assert not backend_choice(GRPOConfig(output_dir=str(tmp_path))).partial
    assert FastBackend().uses_generate_on("cuda")  # off: decision 5 as before


@pytest.mark.parametrize("mode", ["generate", "compact", "graphs"])
def test_keeping_generate_or_the_static_steps_on_cuda_is_refused_by_name(monkeypatch, mode):
    monkeypatch.setenv(CUDA_DECODE_ENV, mode)
    with pytest.raises(ValueError, match=f"partial_rollouts ends a round .* but {CUDA_DECODE_ENV}='{mode}'"):
        FastBackend(partial=True)
    with pytest.raises(ValueError, match=f"FastBackend\\(cuda='{mode}'\\)"):
        FastBackend(cuda=mode, partial=True)
