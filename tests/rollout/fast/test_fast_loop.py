"""What the fast paths' token loop does besides choosing tokens: it stops on NaN/inf logits at the step they appear,
warns past `max_position_embeddings` as `generate` does, and hands a patched `generate` back to `generate`."""

import logging
from unittest import mock

import pytest
import torch

from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import MAX_NEW, assert_same_rollout, fast_rollout, greedy_config, grouped_prompts, model_of_kind

PAST_LIMIT = "has exceeded the model's predefined maximum length"


def test_nan_logits_stop_the_rollout_at_their_step_naming_the_rows(tokenizer):
    """A token whose embedding is NaN: rows that feed it back get NaN logits at the next step. The rollout used to
    go on sampling from NaN (argmax/CDF of NaN picks some token) for every remaining step."""
    model = model_of_kind("llama", tokenizer)  # untied head: only the embedding row is broken
    prompts = grouped_prompts(tokenizer)
    with torch.no_grad():
        free = generate_rollout(model, prompts, greedy_config(tokenizer)).completion_ids  # [6, 12]
    token = free[0, 1].item()
    assert token not in prompts.ids  # the prompts themselves stay finite
    first = torch.where(free == token, torch.arange(MAX_NEW), MAX_NEW).min(1).values  # [6] first emission per row
    step, rows = first.min().item() + 1, (first == first.min()).sum().item()
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")
    with pytest.raises(RuntimeError, match=rf"NaN/inf logits at completion token {step} in {rows} of 6 rows"):
        fast_rollout(model, prompts, greedy_config(tokenizer))


def test_nan_logits_in_sampling_stop_the_rollout_too(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")  # every row's logit for token 7: the whole softmax is NaN
    with pytest.raises(RuntimeError, match="NaN/inf logits at completion token 0 in 6 of 6 rows"):
        fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer, do_sample=True))


@pytest.mark.parametrize("kind", ["qwen2", "phi3"])  # the decoder, and the model's own forward
@pytest.mark.parametrize("limit", [16, 8])  # past the limit after 5 new tokens; a prompt (11) already longer
def test_past_max_position_embeddings_warns_as_generate_does(tokenizer, caplog, kind, limit):
    model = model_of_kind(kind, tokenizer, max_position_embeddings=limit)
    prompts = grouped_prompts(tokenizer)
    assert prompts.ids.shape[1] == 11
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-message cache
    with caplog.at_level(logging.WARNING):
        with torch.no_grad():
            reference = generate_rollout(model, prompts, greedy_config(tokenizer))
        theirs = [r.getMessage() for r in caplog.records if PAST_LIMIT in r.getMessage()]
        caplog.clear()
        assert_same_rollout(fast_rollout(model, prompts, greedy_config(tokenizer)), reference)
        ours = [r.getMessage() for r in caplog.records if PAST_LIMIT in r.getMessage()]
    assert len(theirs) == 1 and ours == theirs and f"({limit})" in ours[0]


def test_within_max_position_embeddings_nothing_is_said(tokenizer, caplog):
    model = model_of_kind("qwen2", tokenizer, max_position_embeddings=11 + MAX_NEW)
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer))
    assert not [r for r in caplog.records if PAST_LIMIT in r.getMessage()]


def _forced(tokenizer):
    """A replacement generate that appends fixed tokens: what TRL's tests install to force completions."""
    digits = tokenizer.convert_tokens_to_ids(list("42")) + [tokenizer.eos_token_id]

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor([digits] * input_ids.shape[0])], dim=1)

    return fake_generate, digits


@pytest.mark.parametrize("kind", ["qwen2", "gpt2_no_dropout"])
def test_a_patched_generate_on_the_class_is_honoured(tokenizer, kind):
    model = model_of_kind(kind, tokenizer)
    fake, digits = _forced(tokenizer)
    with mock.patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake) as patched:
        rollout = fast_rollout(model, grouped_prompts(tokenizer), greedy_config(tokenizer))
    assert patched.call_count == 1 and rollout.completion_ids.tolist() == [digits] * 6


def test_a_patched_generate_on_the_model_or_its_adapter_wrapper_is_honoured(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = model_of_kind("qwen2", tokenizer)
    fake, digits = _forced(tokenizer)
    prompts = tokenize_prompts(tokenizer, ["copy 1:"] * 4, None)
    with mock.patch.object(model, "generate", side_effect=fake):
        assert fast_rollout(model, prompts, greedy_config(tokenizer)).completion_ids.tolist() == [digits] * 4
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with mock.patch.object(adapted, "generate", side_effect=fake):
        assert fast_rollout(adapted, prompts, greedy_config(tokenizer)).completion_ids.tolist() == [digits] * 4
    assert fast_rollout(adapted, prompts, greedy_config(tokenizer)).completion_ids.tolist() != [digits] * 4


def test_the_cuda_choice_is_checked():
    from grpo_trainer.rollout.fast.backend import FastBackend

    assert FastBackend().cuda == "generate" and FastBackend(cuda="decoder").cuda == "decoder"
    with pytest.raises(ValueError, match="FastBackend\\(cuda='vllm'\\): choose 'generate' or 'decoder'"):
        FastBackend(cuda="vllm")
