"""The chat template's side of a tool loop: can it render tools at all, and which tokens follow a turn's tool calls.

Decisions:

1. A template must render a whole exchange, user -> assistant with a tool call -> tool result, keeping the tool's
   name, its argument and the result; one that drops any of them (several base templates render only `content`)
   is refused at start-up, since the model would never see its calls or their results.
2. Turns are joined as token ids, never re-tokenised text: the next turn's context is the previous context, the
   completion exactly as sampled (its EOS included), then `ToolSuffix`: the tokens the template writes after an
   assistant turn's EOS, through the tool messages, up to the next assistant header. They are read off a rendering
   of a stand-in conversation, cut after the EOS token that ends its assistant turn (counted, so a template that
   renders an earlier assistant turn differently, as Qwen3's drops an empty think block, still cuts right).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ToolSuffix", "check_renders_tools"]

_NAME, _KEY, _VALUE, _RESULT = "tool_name_5b1e", "tool_key_9c2d", "tool_value_3e7f", "tool_result_8a4c"


def check_renders_tools(tokenizer: Any, chat_template_kwargs: dict | None = None) -> None:
    """ValueError unless the chat template renders a tool call and its result (decision 1)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tools and environments need a tokenizer with a chat_template that renders tool calls.")
    call = {"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VALUE}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": _NAME, "content": _RESULT}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **(chat_template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a template may reject the tool role in any way
        raise ValueError(f"the chat template cannot render a tool call and its result ({error}); use a model "
                         "whose chat template supports tools, or set tokenizer.chat_template.") from error
    missing = [what for what, sentinel in (("the tool's name", _NAME), ("its arguments", _KEY), ("its argument "
               "values", _VALUE), ("the tool's result", _RESULT)) if sentinel not in text]
    if missing:
        raise ValueError(f"the chat template drops {', '.join(missing)} of a tool call, so the model would never see "
                         "its calls or their results; use a chat template that supports tools.")


class ToolSuffix:
    """Token ids that go between a turn that called tools and the next turn (decision 2)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], chat_template_kwargs: dict | None = None):
        self.tokenizer, self.eos = tokenizer, set(eos_token_ids)
        self.kwargs = chat_template_kwargs or {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)

    def __call__(self, tool_messages: list[dict]) -> list[int]:
        """The tokens after a turn's EOS for these tool messages (`{"role": "tool", "name", "content"}`)."""
        # The stand-in assistant turn calls the same tools: some templates name the result after its call.
        calls = [{"type": "function", "function": {"name": m["name"], "arguments": {}}} for m in tool_messages]
        head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        turn = self._render(head, generation_prompt=False)
        full = self._render(head + tool_messages, generation_prompt=True)
        ends = sum(token in self.eos for token in turn)
        if ends == 0:  # turns end without an EOS token: the template must then keep the turn as it was
            if full[:len(turn)] != turn:
                raise ValueError("the chat template ends turns without an EOS token and renders an assistant turn "
                                 "differently once a tool result follows, so tool results cannot be appended.")
            return full[len(turn):]
        seen = 0
        for position, token in enumerate(full):
            seen += token in self.eos
            if seen == ends:
                return full[position + 1:]
        raise ValueError("the chat template drops the end of an assistant turn once a tool result follows it.")
