"""The chat template's side of the tool loop: templates that cannot show tool calls are refused, and the tokens
between a turn's EOS and the next turn are exactly what the template renders there."""

import pytest

from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.rollout.multiturn.chat import ToolSuffix, check_renders_tools
from tests.tool_helpers import qwen_tokenizer

RESULT = [{"role": "tool", "name": "multiply", "content": "12"}]


def test_a_template_that_renders_only_content_is_refused_naming_what_it_drops():
    with pytest.raises(ValueError, match="drops the tool's name, its arguments, its argument values"):
        check_renders_tools(make_tokenizer())  # the plain toy template writes each message's content only


def test_tool_templates_pass_the_check():
    check_renders_tools(make_tokenizer(tool_calling=True))
    check_renders_tools(qwen_tokenizer())


def test_prompt_turn_and_suffix_join_into_the_templates_own_rendering_of_the_conversation():
    # The toy template renders earlier turns the same whatever follows, so the loop's concatenation of token ids
    # must be exactly the template's tokenisation of the whole conversation.
    tokenizer = make_tokenizer(tool_calling=True)
    user = [{"role": "user", "content": "3*4?"}]
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    assistant = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=False)
    turn = tokenizer("<call>multiply a=3 b=4</call><|end|>", add_special_tokens=False)["input_ids"]
    suffix = ToolSuffix(tokenizer, [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")])(RESULT)
    whole = tokenizer.apply_chat_template(user + assistant + RESULT, add_generation_prompt=True, return_dict=False)
    assert prompt + turn + suffix == whole
    assert tokenizer.decode(suffix, skip_special_tokens=False) == "<|tool|>12<|end|><|assistant|>"


def test_the_suffix_is_cut_after_the_turns_eos_when_the_template_renders_earlier_turns_differently():
    # Qwen3's template writes an empty think block into the last assistant turn only, so a turn followed by a tool
    # result renders differently from the same turn alone: the cut is found by counting EOS tokens instead.
    tokenizer = qwen_tokenizer()
    suffix = ToolSuffix(tokenizer, [tokenizer.eos_token_id])(RESULT)
    assert tokenizer.decode(suffix, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_several_results_of_one_turn_share_one_suffix():
    tokenizer = make_tokenizer(tool_calling=True)
    two = RESULT + [{"role": "tool", "name": "get", "content": "42"}]
    suffix = ToolSuffix(tokenizer, [tokenizer.convert_tokens_to_ids("<|end|>")])(two)
    assert tokenizer.decode(suffix, skip_special_tokens=False) == "<|tool|>12<|end|><|tool|>42<|end|><|assistant|>"
