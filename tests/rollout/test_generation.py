"""The reference backend and what every backend shares: prompt tokenisation, the completion mask, EOS handling and
the generation config."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from grpo_trainer import GRPOConfig
from grpo_trainer.config.settings import sampling_settings
from grpo_trainer.rollout.backend import BACKENDS
from grpo_trainer.rollout.capture import KEEP_NOTHING
from grpo_trainer.rollout.fast import guard
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import eos_token_ids, make_generation_config
from grpo_trainer.rollout.types import PromptBatch, completion_mask
from tests.helpers import greedy_config, model_of_kind

EOS, END = 1, 6  # the tiny tokenizer's "<eos>" and "<|end|>"


def ids_of(tokenizer, tokens: list[str]) -> list[int]:
    return tokenizer.convert_tokens_to_ids(tokens)


# ---------------------------------------------------------------------------------------------------------------
# completion_mask
# ---------------------------------------------------------------------------------------------------------------


def test_completion_mask_by_hand():
    completion_ids = torch.tensor([
        [1, 50, 51, 52],  # EOS first: only the EOS itself counts
        [50, 51, 1, 52],  # EOS in the middle: up to and including it
        [50, 51, 52, 53],  # no EOS: the whole row, truncated
        [50, 6, 1, 52],  # two EOS ids: the first of either ends the row
        [50, 51, 52, 1],  # EOS at the last position: complete, not truncated
    ])
    mask, truncated = completion_mask(completion_ids, [EOS, END])
    assert mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True, False, False]
    # with only EOS 1 as a stop id, row 3 runs on to its "1" at position 2
    mask, _ = completion_mask(completion_ids[3:4], [EOS])
    assert mask.tolist() == [[1, 1, 1, 0]]


# ---------------------------------------------------------------------------------------------------------------
# tokenize_prompts
# ---------------------------------------------------------------------------------------------------------------


def test_plain_prompts_are_left_padded(tokenizer):
    a, b, c, d = ids_of(tokenizer, ["a", "b", "c", "d"])
    pad = tokenizer.pad_token_id
    prompts = tokenize_prompts(tokenizer, ["ab", "abcd"], max_prompt_length=None)
    ids, mask = prompts.ids, prompts.mask
    assert ids.tolist() == [[pad, pad, a, b], [a, b, c, d]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_max_prompt_length_keeps_the_last_tokens(tokenizer):
    a, b, c, d = ids_of(tokenizer, ["a", "b", "c", "d"])
    pad = tokenizer.pad_token_id
    prompts = tokenize_prompts(tokenizer, ["ab", "abcd"], max_prompt_length=3)
    ids, mask = prompts.ids, prompts.mask
    assert ids.tolist() == [[pad, a, b], [b, c, d]]  # "abcd" loses its first token, nearest the end survives
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    unchanged = tokenize_prompts(tokenizer, ["ab", "abcd"], max_prompt_length=10)
    assert unchanged.ids.shape == (2, 4)


def test_pad_to_multiple_of_left_pads_after_truncation(tokenizer):
    a, b, c, d = ids_of(tokenizer, ["a", "b", "c", "d"])
    pad = tokenizer.pad_token_id
    # 4 columns -> 6 (the next multiple of 3): two more pad columns on the left, masked out
    prompts = tokenize_prompts(tokenizer, ["ab", "abcd"], None, pad_to_multiple_of=3)
    assert prompts.ids.tolist() == [[pad, pad, pad, pad, a, b], [pad, pad, a, b, c, d]]
    assert prompts.mask.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]]
    # truncated to the last 3 tokens first, then 3 is already a multiple of 3
    assert tokenize_prompts(tokenizer, ["ab", "abcd"], 3, pad_to_multiple_of=3).ids.tolist() == [[pad, a, b],
                                                                                                 [b, c, d]]
    assert tokenize_prompts(tokenizer, ["ab", "abcd"], None, pad_to_multiple_of=4).ids.shape == (2, 4)


@pytest.mark.parametrize("backend", ["generate", "fast"])
def test_extra_left_padding_changes_no_completion(tokenizer, backend):
    """Whole columns of left padding (pad_to_multiple_of) leave greedy completions as they were, in both
    backends."""
    model = model_of_kind("qwen2", tokenizer)
    texts = ["copy 123:", "copy 98765:", "c", "copy 4:"]
    plain = tokenize_prompts(tokenizer, texts, None)
    padded = tokenize_prompts(tokenizer, texts, None, pad_to_multiple_of=16)
    assert plain.ids.shape[1] == 11 and padded.ids.shape[1] == 16  # "copy 98765:": 11 characters
    config = greedy_config(tokenizer)
    with torch.no_grad():
        want = BACKENDS[backend]().generate(model, plain, config, KEEP_NOTHING)
        got = BACKENDS[backend]().generate(model, padded, config, KEEP_NOTHING)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)


def test_conversational_prompts_use_the_chat_template(tokenizer):
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "abc"}]]
    batch = tokenize_prompts(tokenizer, prompts, max_prompt_length=None)
    ids, mask = batch.ids, batch.mask
    user, h, i, end, assistant = ids_of(tokenizer, ["<|user|>", "h", "i", "<|end|>", "<|assistant|>"])
    a, b, c = ids_of(tokenizer, ["a", "b", "c"])
    # "<|user|>hi<|end|><|assistant|>": the generation prompt is added, no extra special tokens
    assert ids.tolist() == [[tokenizer.pad_token_id, user, h, i, end, assistant], [user, a, b, c, end, assistant]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1], [1] * 6]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    thinking = copy.deepcopy(tokenizer)  # leave the session fixture untouched
    thinking.chat_template = tokenizer.chat_template + "{% if enable_thinking %}T{% endif %}"
    prompts = [[{"role": "user", "content": "hi"}]]
    with_flag = tokenize_prompts(thinking, prompts, None, chat_template_kwargs={"enable_thinking": True}).ids
    without = tokenize_prompts(thinking, prompts, None).ids
    assert with_flag[0, :-1].tolist() == without[0].tolist()
    assert with_flag[0, -1].item() == thinking.convert_tokens_to_ids("T")


# ---------------------------------------------------------------------------------------------------------------
# eos_token_ids and make_generation_config
# ---------------------------------------------------------------------------------------------------------------


def test_eos_token_ids_collects_every_source(tokenizer):
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=[END, 9])) == [EOS, END, 9]
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=END)) == [EOS, END]
    assert eos_token_ids(tokenizer, GenerationConfig(eos_token_id=EOS)) == [EOS]  # no duplicates
    assert eos_token_ids(tokenizer, None) == [EOS]


def test_eos_token_ids_missing_everywhere():
    with pytest.raises(ValueError, match="define no eos_token_id; set tokenizer.eos_token"):
        eos_token_ids(SimpleNamespace(eos_token_id=None), GenerationConfig())


def test_generation_config_from_args_and_overrides(tokenizer, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1,
                      report_to="none", generation_kwargs={"top_k": 5, "max_new_tokens": 3, "num_beams": 1})
    config = make_generation_config(sampling_settings(args), GenerationConfig(eos_token_id=[END], bos_token_id=2),
                                    tokenizer, 16)
    assert config.do_sample is True
    assert (config.temperature, config.top_p, config.repetition_penalty) == (0.7, 0.9, 1.1)
    assert config.top_k == 5 and config.max_new_tokens == 3  # generation_kwargs win over the named fields
    assert config.eos_token_id == [EOS, END] and config.pad_token_id == tokenizer.pad_token_id
    assert config.bos_token_id == 2

    plain = make_generation_config(sampling_settings(GRPOConfig(output_dir=str(tmp_path), report_to="none")), None,
                                   tokenizer, 16)
    assert plain.max_new_tokens == 16 and plain.temperature == 1.0 and plain.eos_token_id == [EOS]


def test_a_checkpoints_sampling_defaults_do_not_override_the_configs(tokenizer, tiny_model, tmp_path):
    """Instruct checkpoints ship sampling defaults (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
    repetition_penalty 1.05). `generate` fills the fields a GenerationConfig leaves unset from the model's, so
    every field GRPOConfig owns must be set explicitly: the loss scores completions at `args.temperature` with no
    filtering, and that must be the distribution they were sampled from."""
    model = copy.deepcopy(tiny_model)
    model.generation_config.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    defaults = sampling_settings(GRPOConfig(output_dir=str(tmp_path), report_to="none"))
    config = make_generation_config(defaults, model.generation_config, tokenizer, 16)
    resolved = guard.resolved(model, config)  # what generate (and the fast path) will run with
    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    one = torch.ones(1, 1, dtype=torch.long)
    assert len(guard.processors(model, resolved, one, one)) == 0  # nothing reshapes the sampled distribution


def test_sample_slices_masks_and_pads_the_completions():
    class FakeModel:  # generate appends fixed completions: exact expectations without a sampling model
        def generate(self, input_ids, attention_mask, generation_config):
            completions = torch.tensor([[50, 1, 51, 52], [50, 51, 52, 53], [6, 50, 1, 51]])
            return torch.cat([input_ids, completions], 1)

    prompt_ids, prompt_mask = torch.tensor([[0, 20, 21]] * 3), torch.tensor([[0, 1, 1]] * 3)
    config = GenerationConfig(eos_token_id=[EOS, END], pad_token_id=0)
    rollout = generate_rollout(FakeModel(), PromptBatch(prompt_ids, prompt_mask), config)
    assert rollout.prompt_ids is prompt_ids and rollout.prompt_mask is prompt_mask
    # tokens after each row's first EOS become pad (0); the EOS itself stays
    assert rollout.completion_ids.tolist() == [[50, 1, 0, 0], [50, 51, 52, 53], [6, 0, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert rollout.is_truncated.tolist() == [False, True, False]
