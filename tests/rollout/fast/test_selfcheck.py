"""The decoder's self-check against the model's own forward: it runs once per model and structure, passes stock
models, and catches what the guard cannot see (a hook the decoder bypasses, a module it cannot run), also when
the change comes after a passed check, sending the model to its own forward with the reason logged."""

import copy
import logging

import pytest
import torch
from torch import nn

from grpo_trainer.rollout.fast import backend as fast_backend
from grpo_trainer.rollout.fast import selfcheck
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import (
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    model_of_kind,
)

SENSITIVE = {"initializer_range": 0.1}  # logits large enough that a 0.1% change in one projection shows


@pytest.fixture
def checks(monkeypatch):
    """Every self-check measurement made (the real one, counted)."""
    made = []
    measure = selfcheck._measure
    monkeypatch.setattr(selfcheck, "_measure", lambda *args: made.append(args[0]) or measure(*args))
    return made


def decoded_by_the_decoder(model, tokenizer) -> bool:
    """Whether the fast backend ran its decoder (the only tier that keeps every layer's output)."""
    rollout = fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer), layer_outputs=True)
    return rollout.sampler.replay.layer_outputs is not None


def scale_output(module: nn.Module, factor: float):
    return module.register_forward_hook(lambda m, inputs, output: output * factor)


@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama3", "qwen3", "mistral"])
def test_stock_models_pass_once_and_then_skip_the_check(tokenizer, checks, kind):
    model = model_of_kind(kind, tokenizer, **SENSITIVE)
    prompts = grouped_prompts(tokenizer)
    assert selfcheck.decoder_mismatch(model, prompts, fast_backend._decode) is None
    difference, tolerance = selfcheck._measure(model, prompts, fast_backend._decode)
    assert difference < tolerance / 10  # far inside the tolerance
    checks.clear()
    assert decoded_by_the_decoder(model, tokenizer) and decoded_by_the_decoder(model, tokenizer)
    assert checks == []  # the verdict was kept
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # weights change in place, as an optimizer step does
    assert decoded_by_the_decoder(model, tokenizer) and checks == []


def test_a_subtle_change_the_decoder_would_bypass_is_caught_and_logged(tokenizer, checks, caplog):
    """A hook scaling one query projection by 1.001 (steering, an adapter applied by hooks): the guard sees the
    family's modules, the decoder runs the fused weights without the hook, the model runs it."""
    model = model_of_kind("qwen2", tokenizer, **SENSITIVE)
    scale_output(model.model.layers[0].self_attn.q_proj, 1.001)
    assert fast_path_blocker(model, greedy_config(tokenizer), grouped_prompts(tokenizer).ids.shape[1]) is None
    with caplog.at_level(logging.WARNING):
        reason = selfcheck.decoder_mismatch(model, grouped_prompts(tokenizer), fast_backend._decode)
    assert "log-probs differ from the model's forward by up to" in reason
    assert reason in caplog.text and "self-check failed for Qwen2ForCausalLM" in caplog.text
    assert not decoded_by_the_decoder(model, tokenizer)
    with torch.no_grad():
        reference = generate_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer))
    assert_same_rollout(fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer)), reference)
    assert len(checks) == 1  # one check for this model, however many rollouts


def test_a_model_changed_after_its_check_passed_is_checked_again(tokenizer, checks):
    model = model_of_kind("qwen2", tokenizer, **SENSITIVE)
    assert decoded_by_the_decoder(model, tokenizer) and len(checks) == 1
    hook = scale_output(model.model.layers[1].mlp.down_proj, 1.001)  # after the check passed
    assert not decoded_by_the_decoder(model, tokenizer) and len(checks) == 2
    hook.remove()
    assert decoded_by_the_decoder(model, tokenizer) and len(checks) == 3


def test_a_new_model_gets_its_own_check(tokenizer, checks):
    """A copy perturbed after its original passed is not served by the original's verdict."""
    model = model_of_kind("qwen2", tokenizer, **SENSITIVE)
    assert decoded_by_the_decoder(model, tokenizer)
    perturbed = copy.deepcopy(model)
    scale_output(perturbed.model.layers[1].self_attn.v_proj, 1.001)
    assert not decoded_by_the_decoder(perturbed, tokenizer)
    assert decoded_by_the_decoder(model, tokenizer)
    assert checks == [model, perturbed]


def test_the_fingerprint_follows_structure_not_weight_values(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    before = selfcheck.fingerprint(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # an optimizer step
    assert selfcheck.fingerprint(model) == before
    model.enable_input_require_grads()  # transformers' hook marking embeddings as requiring grad
    assert selfcheck.fingerprint(model) == before
    hook = scale_output(model.model.embed_tokens, 1.0)  # any other hook counts, even one that changes nothing
    assert selfcheck.fingerprint(model) != before
    hook.remove()
    assert selfcheck.fingerprint(model) == before
    model.model.layers[0].mlp.act_fn = nn.GELU()
    assert selfcheck.fingerprint(model) != before
    model = model_of_kind("qwen2", tokenizer)
    before = selfcheck.fingerprint(model)
    model.to(torch.bfloat16)
    assert selfcheck.fingerprint(model) != before


class ThreeDimensionalOnly(nn.Module):
    """A projection whose kernel takes `[B, S, E]` inputs only; the decoder's step passes `[B, E]`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear, self.out_features = linear, linear.out_features

    def forward(self, x):
        if x.dim() != 3:
            raise ValueError(f"expected [batch, sequence, features], got {tuple(x.shape)}")
        return self.linear(x)


def test_a_decoder_that_fails_on_the_model_is_a_mismatch_not_a_crash(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    model.model.layers[0].mlp.down_proj = ThreeDimensionalOnly(model.model.layers[0].mlp.down_proj)
    reason = selfcheck.decoder_mismatch(model, grouped_prompts(tokenizer), fast_backend._decode)
    assert reason.startswith("the decoder failed on this model (ValueError: expected [batch, sequence, features]")
    with torch.no_grad():
        reference = generate_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer))
    assert_same_rollout(fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer)), reference)
