"""Sampling completions: prompt tokenisation, `model.generate`, and the completion mask.

Decisions:

1. Generation works on token ids. Prompts are left-padded so every completion starts at the same column;
   completions are right-padded, and every token after a sequence's first EOS is masked out.
2. Conversational prompts go through the tokenizer's chat template with `add_generation_prompt=True` (and
   `chat_template_kwargs`); plain-text prompts are tokenised as they are. `max_prompt_length` keeps the
   *last* tokens, nearest to where the completion starts.
3. Every EOS id of the tokenizer and of the model's generation config stops a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig

from grpo_trainer.validation import is_conversational

__all__ = ["Rollout", "completion_mask", "eos_token_ids", "make_generation_config", "sample", "tokenize_prompts"]


@dataclass
class Rollout:
    """One generation round on one process. `B` completions, `S` prompt tokens, `T` completion tokens."""

    prompt_ids: Tensor  # [B, S] left-padded
    prompt_mask: Tensor  # [B, S]
    completion_ids: Tensor  # [B, T] right-padded
    completion_mask: Tensor  # [B, T] 1 up to and including the first EOS
    is_truncated: Tensor  # [B] bool: the completion never emitted EOS
    # Filled by the fast backend (`decoding`): log pi(token) and the entropy at each position under the weights that
    # sampled, from the full tempered softmax (before top-k/top-p filtering), as the training forward computes them.
    sampling_logps: Tensor | None = None  # [B, T] float32
    sampling_entropy: Tensor | None = None  # [B, T] float32
    # When asked: that whole tempered softmax at every step, [B, T, V] float32, for `replay`.
    sampling_probs: Tensor | None = None
    # Also from the fast backend, when asked: every decoder layer's output at every prompt and completion column,
    # [B, layers, S+T, E] (zeros for the last completion token, which is never fed back), for `replay`.
    layer_outputs: Tensor | None = None


def tokenize_prompts(tokenizer: Any, prompts: list, max_prompt_length: int | None,
                     chat_template_kwargs: dict | None = None) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask, `[B, S]` each."""
    if is_conversational(prompts[0]):
        texts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True,
                                              **(chat_template_kwargs or {}))
        add_special_tokens = False  # the template already wrote any BOS
    else:
        texts, add_special_tokens = prompts, True
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=add_special_tokens)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    if max_prompt_length is not None and ids.shape[1] > max_prompt_length:
        ids, mask = ids[:, -max_prompt_length:], mask[:, -max_prompt_length:]  # left padding: the tail is the text
    return ids, mask


def eos_token_ids(tokenizer: Any, generation_config: GenerationConfig | None) -> list[int]:
    """Every token id that ends a completion."""
    ids = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    if not ids:
        raise ValueError("the tokenizer and the model's generation config define no eos_token_id; set "
                         "tokenizer.eos_token so completions can end.")
    return sorted(ids)


def completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask `[B, T]` that keeps each row up to and including its first EOS, and `[B]` truncated flags."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    # Number of EOS strictly before each position: 0 means "still inside the completion".
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).int(), ~is_eos.any(dim=1)


def make_generation_config(args: Any, model_config: GenerationConfig | None, tokenizer: Any,
                           max_new_tokens: int) -> GenerationConfig:
    """Sampling settings from a GRPOConfig; `generation_kwargs` override the named fields."""
    settings = {
        "do_sample": True, "max_new_tokens": max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
        "eos_token_id": eos_token_ids(tokenizer, model_config), "pad_token_id": tokenizer.pad_token_id,
        "cache_implementation": args.cache_implementation, "disable_compile": True,
        "bos_token_id": getattr(model_config, "bos_token_id", None),
    }
    return GenerationConfig(**{**settings, **(args.generation_kwargs or {})})


def sample(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, generation_config: GenerationConfig) -> Rollout:
    """Generate one completion per prompt row with `model.generate` (rows are already repeated G times)."""
    output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config)
    completion_ids = output[:, prompt_ids.shape[1]:]
    eos = generation_config.eos_token_id
    mask, truncated = completion_mask(completion_ids, eos if isinstance(eos, (list, tuple)) else [eos])
    completion_ids = completion_ids.masked_fill(mask == 0, generation_config.pad_token_id)
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated)
