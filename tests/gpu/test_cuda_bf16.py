"""On a CUDA GPU, in bfloat16 (where users train): the fast decoder samples what `model.generate` samples, the
LM-head log-probs and the loss stay within bfloat16's rounding of their float32 values, and a short training run
changes the weights. The whole module is skipped, with the reason, where no CUDA device is available; on CPU the
same properties are tested in float32 by tests/rollout/fast and tests/algorithms.

    python -m pytest -q tests/gpu
"""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests need one (they run in bfloat16 on cuda:0)", allow_module_level=True)

from grpo_trainer.algorithms.losses import LossNorm, policy_loss  # noqa: E402
from grpo_trainer.cli.toy import make_tiny_model  # noqa: E402
from grpo_trainer.modeling.logprobs import completion_logprobs  # noqa: E402
from grpo_trainer.rollout.generate import generate_rollout  # noqa: E402
from tests.helpers import (  # noqa: E402
    MAX_NEW,
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    make_trainer,
    model_of_kind,
)

CUDA = torch.device("cuda:0")
T = 8  # completion tokens scored in the log-prob tests


def _on_cuda(model, dtype=torch.bfloat16):
    return model.to(device=CUDA, dtype=dtype).eval()


def _prompts_on_cuda(tokenizer):
    return grouped_prompts(tokenizer).to(CUDA)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_fast_decoder_greedy_tokens_equal_generate_in_bf16(tokenizer, kind):
    """Greedy decoding is deterministic given the logits: the fast decoder's bf16 kernels must pick the tokens
    `generate` picks, at every position (no row ends early, so all MAX_NEW positions are compared)."""
    model = _on_cuda(model_of_kind(kind, tokenizer))
    prompts, config = _prompts_on_cuda(tokenizer), greedy_config(tokenizer)
    assert fast_path_blocker(model, config, prompts.ids.shape[1]) is None
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
        fast = fast_rollout(model, prompts, config)
    assert reference.completion_ids.shape[1] == MAX_NEW
    assert_same_rollout(fast, reference)


def _batch(tokenizer):
    generator = torch.Generator().manual_seed(3)
    prompts = grouped_prompts(tokenizer)
    completion = torch.randint(10, len(tokenizer) - 1, (prompts.ids.shape[0], T), generator=generator)
    ids = torch.cat([prompts.ids, completion], 1).to(CUDA)
    mask = torch.cat([prompts.mask, torch.ones_like(completion)], 1).to(CUDA)
    return ids, mask


def test_logprobs_and_loss_in_bf16_stay_within_rounding_of_fp32(tokenizer):
    """The same weights in float32 and in bfloat16 (8 significant bits: a relative rounding of 2**-8 per value,
    so log-probs of magnitude log V ~ 5 move by a few hundredths). The LM head's log-sum-exp runs in float32 in
    both, so the bf16 error comes from the hidden states only; the loss, a mean over tokens, is closer still."""
    fp32 = model_of_kind("qwen2", tokenizer).to(CUDA).eval()
    bf16 = _on_cuda(copy.deepcopy(fp32))
    ids, mask = _batch(tokenizer)
    completion_mask = mask[:, -T:].float()
    advantages = torch.linspace(-1, 1, ids.shape[0], device=CUDA)
    norm = LossNorm(window_tokens=float(completion_mask.sum()))
    results = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        out = completion_logprobs(model, ids, mask, T, with_entropy=True)
        loss = policy_loss(out.logps.float(), advantages, completion_mask, norm, loss_type="dapo").loss
        results[name] = (out.logps.float(), out.entropy.float(), loss.float())
    (logps32, entropy32, loss32), (logps16, entropy16, loss16) = results["fp32"], results["bf16"]
    assert logps32.dtype == torch.float32
    torch.testing.assert_close(logps16, logps32, atol=0.1, rtol=0.02)
    assert (logps16 - logps32).abs().mean() < 0.03
    torch.testing.assert_close(entropy16, entropy32, atol=0.1, rtol=0.02)
    torch.testing.assert_close(loss16, loss32, atol=0.02, rtol=0.02)


def test_a_short_bf16_training_run_changes_the_weights(tokenizer, toy_dataset, tmp_path):
    """Two optimizer steps on cuda in bf16 mixed precision: every trained matrix moved, the loss is finite and
    the rewards were logged."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7), bf16=True,
                           max_completion_length=8, learning_rate=0.05)
    assert next(trainer.model.parameters()).device.type == "cuda"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if p.ndim == 2 and not torch.equal(before[n], p)]
    matrices = [n for n, p in trainer.model.named_parameters() if p.ndim == 2]
    assert moved == matrices
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert logged and all(torch.isfinite(torch.tensor(row["loss"])) for row in logged)
    assert all("reward" in row for row in logged)


def test_the_fast_backend_samples_with_generate_on_cuda_by_default(tokenizer, caplog):
    """`rollout.fast.backend` decision 5: by measurement, `generate` on CUDA unless the decoder is asked for."""
    from grpo_trainer.rollout.fast.backend import FastBackend

    model = _on_cuda(model_of_kind("qwen2", tokenizer))
    prompts, config = _prompts_on_cuda(tokenizer), greedy_config(tokenizer)
    with torch.no_grad(), caplog.at_level("INFO", logger="grpo_trainer.rollout.fast.backend"):
        default = FastBackend().generate(model, prompts, config)
        reference = generate_rollout(model, prompts, config)
    assert "measured faster than the decoder" in caplog.text
    assert_same_rollout(default, reference)
    assert default.sampler.logps is None  # generate keeps no sampler values
