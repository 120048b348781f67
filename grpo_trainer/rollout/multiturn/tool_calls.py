"""Tool calls read out of a completion, in the format the tokenizer's chat template writes them.

Decisions:

1. A turn parses into one assistant message in the chat format (`{"role": "assistant", "content": ...,
   "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}`): the form reward functions receive
   and chat templates render.
2. The format is the chat template's own. A tokenizer with a `response_template` is parsed by transformers
   (`tokenizer.parse_response`); otherwise each built-in format (`FORMATS`) is tried. Either way the parser must read
   back exactly the call in the template's own rendering of a probe call; none reading it is an error at start-up,
   not a silent run without tool calls.
3. A malformed call (no name, arguments that are not an object, JSON that does not parse, an unclosed tag) makes the
   whole turn plain text without tool calls, as in TRL: the model gets no tool result and its text is scored as is.
   A well-formed call to an unknown tool, or with wrong arguments, is a call that fails (see `tools`).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["FORMATS", "ResponseTemplateParser", "TaggedJsonParser", "ToolCallParser", "select_parser",
           "tool_calls_of"]

PROBE_NAME, PROBE_ARGUMENTS = "probe_tool_7f3a", {"probe_argument": 7}


class ToolCallParser(Protocol):
    def __call__(self, ids: Sequence[int], prefix: Sequence[int], tools: Sequence[Any]) -> dict:
        """The assistant message of one turn: `ids` the turn's tokens (EOS included), `prefix` every token before
        them, `tools` the tools the prompt offered."""


def tool_calls_of(message: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of each call in a parsed assistant message."""
    return [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls") or []]


def _function(name: Any, arguments: Any) -> dict:
    """A call in the chat format; ValueError when it is malformed (decision 3)."""
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if arguments is None:  # a call without arguments
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError("a tool call needs a string name and an object of arguments")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _plain(tokenizer: Any, ids: Sequence[int]) -> dict:
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


class TaggedJsonParser:
    """Calls written as a JSON object `{"name": ..., "arguments": {...}}` between two tags, `<tool_call>` and
    `</tool_call>` by default (Hermes, Qwen2.5, Qwen3). Text outside the tags is the message's content."""

    def __init__(self, tokenizer: Any, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        self.tokenizer = tokenizer
        self.open_tag, self.close_tag = open_tag, close_tag
        self.block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
        self.special = sorted(set(tokenizer.all_special_tokens), key=len, reverse=True)

    def __call__(self, ids: Sequence[int], prefix: Sequence[int] = (), tools: Sequence[Any] = ()) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        try:
            calls = [_function(body.get("name"), body.get("arguments", body.get("parameters")))
                     for body in map(self._object, self.block.findall(text))]
        except ValueError:  # json.JSONDecodeError included
            return _plain(self.tokenizer, ids)
        outside = self.block.sub("", text)
        if self.open_tag in outside or self.close_tag in outside:  # an unclosed or stray tag
            return _plain(self.tokenizer, ids)
        for token in self.special:
            outside = outside.replace(token, "")
        message = {"role": "assistant", "content": outside.strip()}
        if calls:
            message["tool_calls"] = calls
        return message

    @staticmethod
    def _object(body: str) -> dict:
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError("a tool call must be a JSON object")
        return value


class ResponseTemplateParser:
    """transformers' response parsing, driven by the tokenizer's `response_template` (tool-typed arguments where the
    installed transformers supports them)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.typed = "tools" in inspect.signature(tokenizer.parse_response).parameters

    def __call__(self, ids: Sequence[int], prefix: Sequence[int] = (), tools: Sequence[Any] = ()) -> dict:
        typing = {"tools": list(tools) or None} if self.typed else {}
        try:
            parsed = self.tokenizer.parse_response(list(ids), prefix=list(prefix), **typing)
            calls = [_function(c.get("function", c).get("name"), c.get("function", c).get("arguments"))
                     for c in parsed.get("tool_calls") or []]
        except (ValueError, TypeError, KeyError, AttributeError):
            return _plain(self.tokenizer, ids)
        message = {"role": "assistant", "content": parsed.get("content") or ""}
        if calls:
            message["tool_calls"] = calls
        return message


# Built-in formats for templates without a `response_template`, tried in this order (decision 2).
FORMATS: dict[str, Callable[[Any], ToolCallParser]] = {"tagged_json": TaggedJsonParser}


def _probe(tokenizer: Any, chat_template_kwargs: dict) -> tuple[list[int], list[int]]:
    """The template's rendering of an assistant turn that makes the probe call, split into the tokens before the
    turn and the turn itself."""
    user = [{"role": "user", "content": "hi"}]
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": PROBE_ARGUMENTS}}
    turn = user + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=False,
                                           **chat_template_kwargs)
    full = tokenizer.apply_chat_template(turn, tokenize=True, return_dict=False, **chat_template_kwargs)
    start = len(prefix) if full[:len(prefix)] == prefix else 0
    return full[:start], full[start:]


def select_parser(tokenizer: Any, chat_template_kwargs: dict | None = None) -> ToolCallParser:
    """The parser for this tokenizer's tool-call format (decision 2)."""
    own = getattr(tokenizer, "response_template", None) is not None
    candidates = [ResponseTemplateParser] if own else list(FORMATS.values())
    prefix, turn = _probe(tokenizer, chat_template_kwargs or {})
    for make in candidates:
        parser = make(tokenizer)
        if tool_calls_of(parser(turn, prefix, ())) == [(PROBE_NAME, PROBE_ARGUMENTS)]:
            return parser
    rendered = tokenizer.decode(turn, skip_special_tokens=False)[:200]
    if own:
        raise ValueError(f"tokenizer.response_template does not read back the call in the chat template's own "
                         f"rendering of one ({rendered!r}); make the two describe the same format.")
    raise ValueError(
        f"the chat template writes tool calls as {rendered!r}, a format grpo_trainer cannot read (built-in: "
        f"{sorted(FORMATS)}). Set tokenizer.response_template (transformers' response parsing) to describe it.")
