"""From rollout types to vLLM requests and back, without vLLM: sampling parameters, prompt runs, the Rollout."""

import math

import pytest
import torch
from transformers import GenerationConfig

from grpo_trainer.rollout.types import PromptBatch
from grpo_trainer.rollout.vllm.sampling import (
    Request,
    check_engine_prompts,
    prompt_runs,
    sampling_settings,
    to_rollout,
)

PAD = 0


def _prompts():
    # rows: prompt [5, 6] twice (left-padded to 3 columns), then [7, 8, 9] once, then [5, 6] again (a new run)
    ids = torch.tensor([[PAD, 5, 6], [PAD, 5, 6], [7, 8, 9], [PAD, 5, 6]])
    return PromptBatch(ids, (ids != PAD).long())


def test_identical_rows_in_a_row_become_one_request_with_n():
    assert prompt_runs(_prompts()) == [Request([5, 6], 2), Request([7, 8, 9], 1), Request([5, 6], 1)]


def test_greedy_sends_one_request_per_row():
    assert prompt_runs(_prompts(), greedy=True) == [Request([5, 6], 1), Request([5, 6], 1), Request([7, 8, 9], 1),
                                                    Request([5, 6], 1)]


def test_image_rows_go_with_their_images_and_their_placeholders_unexpanded():
    # rows 0-1 hold one image (its prompt ids with the image expanded: 5, 50, 50, 6), row 2 none: the request of
    # rows 0-1 carries the unexpanded ids the backend computed and the image, row 2's its own ids
    ids = torch.tensor([[5, 50, 50, 6], [5, 50, 50, 6], [PAD, 7, 8, 9]])
    prompts = PromptBatch(ids, (ids != PAD).long(), image_lists=[["picture"], ["picture"], []])
    assert prompt_runs(prompts, engine_ids={0: [5, 50, 6]}) == [Request([5, 50, 6], 2, ["picture"]),
                                                                Request([7, 8, 9], 1)]


def test_a_prompt_vllm_expanded_differently_is_refused_with_both_token_lists():
    ids = torch.tensor([[5, 50, 50, 6], [PAD, 7, 8, 9]])
    prompts = PromptBatch(ids, (ids != PAD).long(), image_lists=[["picture"], []])
    check_engine_prompts(prompts, False, [[5, 50, 50, 6], [7, 8, 9]], "idefics3")  # the same tokens: fine
    with pytest.raises(RuntimeError, match=r"(?s)vLLM expanded the image placeholders of a idefics3 prompt into other "
                                           r"tokens than the processor did.*processor: \[5, 50, 50, 6\]\n  vLLM:      "
                                           r"\[5, 50, 50, 50, 6\]"):
        check_engine_prompts(prompts, False, [[5, 50, 50, 50, 6], [7, 8, 9]], "idefics3")


def test_sampling_settings_from_the_generation_config_then_generation_kwargs():
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=None, min_p=None,
                              repetition_penalty=1.1, max_new_tokens=16, eos_token_id=[1, 6], pad_token_id=PAD)
    settings = sampling_settings(config, prompt_length=3, generation_kwargs={"seed": 3, "top_p": 0.5},
                                 regex=r"\d+")
    assert settings == {"temperature": 0.7, "top_p": 0.5, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
                        "max_tokens": 16, "stop_token_ids": [1, 6], "logprobs": 0, "seed": 3,
                        "structured_outputs": {"regex": r"\d+"}}
    greedy = GenerationConfig(do_sample=False, max_length=10, eos_token_id=1)
    settings = sampling_settings(greedy, prompt_length=3, generation_kwargs=None, regex=None)
    assert settings["temperature"] == 0.0 and settings["max_tokens"] == 7 and settings["stop_token_ids"] == [1]


def test_suppressed_tokens_get_vllms_strongest_negative_bias_next_to_a_users_own():
    config = GenerationConfig(do_sample=True, max_new_tokens=4, eos_token_id=1, suppress_tokens=[50, 51])
    settings = sampling_settings(config, 3, {"logit_bias": {"7": 2.0, "50": 5.0}}, None)
    assert settings["logit_bias"] == {7: 2.0, 50: -100.0, 51: -100.0}  # an image token is never sampled
    assert "logit_bias" not in sampling_settings(GenerationConfig(max_new_tokens=4, eos_token_id=1), 3, None, None)


def test_rollout_ends_at_the_first_eos_and_keeps_the_engines_logps_apart():
    config = GenerationConfig(eos_token_id=[1, 6], pad_token_id=PAD)
    completions = [([4, 6], [-0.5, -1.0]),  # stopped on the second EOS id (vLLM includes it)
                   ([4, 4, 4], [-0.1, None, -0.3]),  # truncated; one token vLLM could not score
                   ([1], [-2.0])]
    prompts = PromptBatch(torch.tensor([[9], [9], [9]]), torch.ones(3, 1, dtype=torch.long))
    out = to_rollout(prompts, completions, config)
    assert out.completion_ids.tolist() == [[4, 6, PAD], [4, 4, 4], [1, PAD, PAD]]
    assert out.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out.is_truncated.tolist() == [False, True, False]
    assert out.sampler.kind == "engine" and not out.sampler.exact  # the engine's values are never the trainer's
    logps = out.sampler.logps
    assert logps[0].tolist() == [-0.5, -1.0, 0.0] and logps[2].tolist() == [-2.0, 0.0, 0.0]
    assert math.isnan(logps[1, 1]) and logps[1, 0].item() == torch.tensor(-0.1).item()
