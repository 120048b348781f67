"""Prompts as tokens: the chat template for conversational prompts, left padding, optional truncation.

Decisions:

1. Conversational prompts go through the tokenizer's chat template with `add_generation_prompt=True` (and
   `chat_template_kwargs`); plain-text prompts are tokenised as they are.
2. A processor (a vision-language model's) tokenises through `multimodal.tokenize_with_processor`, which keeps its
   image inputs with the ids; a tokenizer's path below is unchanged by it.
3. Prompts are left-padded so every completion starts at the same column. `max_prompt_length` keeps the *last*
   tokens, nearest to where the completion starts. `pad_to_multiple_of` then left-pads the batch to a multiple of
   that many columns (TRL's option, for compilers that build one graph per input shape).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import ProcessorMixin

from grpo_trainer.data.checks import is_conversational
from grpo_trainer.rollout.multimodal import tokenize_with_processor
from grpo_trainer.rollout.types import PromptBatch

__all__ = ["tokenize_prompts"]


def tokenize_prompts(tokenizer: Any, prompts: list, max_prompt_length: int | None,
                     chat_template_kwargs: dict | None = None, pad_to_multiple_of: int | None = None,
                     tools: list | None = None) -> PromptBatch:
    """Left-padded prompt ids and mask, `[B, S]` each (S a multiple of `pad_to_multiple_of` when it is set).
    `tools`: per conversational prompt, the tools its chat template describes to the model (`rollout.multiturn`)."""
    if isinstance(tokenizer, ProcessorMixin):  # a vision-language model's processor
        if tools:
            raise NotImplementedError("tools with a vision-language model's processor are not supported yet; train "
                                      "with a text-only model, or without tools.")
        return tokenize_with_processor(tokenizer, prompts, max_prompt_length, chat_template_kwargs,
                                       pad_to_multiple_of)
    if is_conversational(prompts[0]):
        kwargs = {"tokenize": False, "add_generation_prompt": True, **(chat_template_kwargs or {})}
        if tools is None or all(t is tools[0] for t in tools):  # one call for the batch
            # `or None`: some templates describe an empty tool list, which is not the same as none
            texts = tokenizer.apply_chat_template(prompts, tools=(tools[0] or None) if tools else None, **kwargs)
        else:
            texts = [tokenizer.apply_chat_template(p, tools=t or None, **kwargs) for p, t in zip(prompts, tools)]
        add_special_tokens = False  # the template already wrote any BOS
    else:
        texts, add_special_tokens = prompts, True
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=add_special_tokens)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    if max_prompt_length is not None and ids.shape[1] > max_prompt_length:
        ids, mask = ids[:, -max_prompt_length:], mask[:, -max_prompt_length:]  # left padding: the tail is the text
    extra = -ids.shape[1] % pad_to_multiple_of if pad_to_multiple_of else 0
    if extra:
        ids = torch.nn.functional.pad(ids, (extra, 0), value=tokenizer.pad_token_id)
        mask = torch.nn.functional.pad(mask, (extra, 0), value=0)
    return PromptBatch(ids, mask)
