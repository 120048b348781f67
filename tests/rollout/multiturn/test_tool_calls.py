"""Reading tool calls out of completions: Qwen's `<tool_call>{json}</tool_call>` (built-in parser, chosen by probing
the real Qwen3 template) and the toy `<call>` format (transformers' response parsing), malformed calls as text."""

import pytest

from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.rollout.multiturn.tool_calls import (
    ResponseTemplateParser,
    TaggedJsonParser,
    select_parser,
    tool_calls_of,
)
from tests.tool_helpers import multiply, qwen_tokenizer


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_qwen_template_gets_the_json_parser_and_reads_calls_with_their_arguments(qwen):
    parser = select_parser(qwen)
    assert isinstance(parser, TaggedJsonParser)
    text = ('Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
            '<tool_call>\n{"name": "multiply", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}\n</tool_call><|im_end|>')
    message = parser(_ids(qwen, text), [], [multiply])
    assert message["role"] == "assistant" and message["content"] == "Let me compute."
    assert tool_calls_of(message) == [("multiply", {"a": 3, "b": 4}), ("multiply", {"a": 5, "b": 6})]
    assert message["tool_calls"][0]["type"] == "function"


def test_a_call_without_arguments_has_empty_arguments(qwen):
    message = select_parser(qwen)(_ids(qwen, '<tool_call>{"name": "peek"}</tool_call><|im_end|>'), [], [])
    assert tool_calls_of(message) == [("peek", {})]


def test_text_without_calls_is_content_without_special_tokens(qwen):
    message = select_parser(qwen)(_ids(qwen, "I don't know any tool<|im_end|>"), [], [])
    assert message == {"role": "assistant", "content": "I don't know any tool"}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',  # no name
    '<toolcall>\n{"name": "multiply", "arguments": {"a": 3}}\n</toolcall><|im_end|>',  # not the tag
    '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',  # not JSON
    '<tool_call>\n{"name": "multiply", "arguments": [3, 4]}\n</tool_call><|im_end|>',  # arguments not an object
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3}}',  # never closed (out of budget)
    'ok <tool_call>["multiply"]</tool_call><|im_end|>',  # not an object
])
def test_malformed_calls_leave_the_turn_as_plain_text_without_calls(qwen, text):
    # TRL's rule: the whole turn becomes text and no tool runs (tools.run_calls is never reached).
    ids = _ids(qwen, text)
    message = select_parser(qwen)(ids, [], [multiply])
    assert "tool_calls" not in message
    assert message["content"] == qwen.decode(ids, skip_special_tokens=True)


def test_the_toy_format_is_read_by_transformers_response_parsing():
    tokenizer = make_tokenizer(tool_calling=True)
    parser = select_parser(tokenizer)
    assert isinstance(parser, ResponseTemplateParser)
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=False)
    message = parser(_ids(tokenizer, "sure<call>multiply a=3 b=4</call><call>get</call><|end|>"), prefix,
                     [multiply])
    assert message["content"] == "sure"
    assert tool_calls_of(message) == [("multiply", {"a": 3, "b": 4}), ("get", {})]
    broken = parser(_ids(tokenizer, "<call></call><|end|>"), prefix, [multiply])  # a call without a name
    assert "tool_calls" not in broken and broken["content"] == "<call></call>"


def test_a_template_writing_calls_in_an_unknown_format_is_refused_at_start_up():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
        "CALL {{ c['function']['name'] }}({{ c['function']['arguments'] }}){% endfor %}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="a format grpo_trainer cannot read.*response_template"):
        select_parser(tokenizer)


def test_a_response_template_that_misreads_the_templates_own_calls_is_refused():
    tokenizer = make_tokenizer(tool_calling=True)
    tokenizer.response_template = {**tokenizer.response_template, "fields": {
        "content": {"close_pattern": r"<\|end\|>|$", "content": "text"}}}  # no tool_calls field
    with pytest.raises(ValueError, match="response_template does not read back the call"):
        select_parser(tokenizer)
