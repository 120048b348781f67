"""Tiny models, a tokenizer and a toy task built offline: the demo, the tests and the benchmarks use them.

Nothing here downloads anything. The tokenizer is character-level (a `tokenizers` WordLevel model over single
characters, wrapped in `PreTrainedTokenizerFast`) with a chat template, a pad token and an EOS token, so it
exercises the same code paths as a real instruct model's tokenizer.

`make_tokenizer(tool_calling=True)` adds a tool role and call tags, with a chat template that writes a call as
`<call>name key=value ...</call>` and a `response_template` for transformers' response parsing that reads it back:
a format short enough for a tiny model to learn (examples/tool_use.py).

The toy task ("copy the digits"): the prompt holds a few random digits, the completion should repeat them and
stop. `copy_digits_reward` (in the reward library, so `--reward_funcs copy_digits` finds it) gives partial credit
per correct position, so a randomly initialised model has a reward signal to climb from the first step.
"""

from __future__ import annotations

import random
import string

from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

from grpo_trainer.rewards.library import copy_digits_reward  # the task's reward, selectable by name

__all__ = ["CHAT_TEMPLATE", "TOOL_CHAT_TEMPLATE", "TOOL_RESPONSE_TEMPLATE", "copy_digits_dataset", "copy_digits_reward",
           "make_tiny_model", "make_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL_TOKENS = ["<|tool|>", "<call>", "</call>"]
# Tools are listed by name in a system turn; a call is `<call>name key=value ...</call>`; results are tool turns.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}<|end|>"
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<call>{{ call['function']['name'] }}"
    "{% for key, value in call['function']['arguments'].items() %} {{ key }}={{ value }}{% endfor %}</call>"
    "{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# transformers' response parsing of that format: the text before any call is the content; each call's name follows
# `<call>`, its arguments are `key=value` pairs whose values are read as JSON where they parse (numbers).
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<call>(?P<name>\w+)", "close": "</call>", "repeats": True, "content": "xml-inline",
            "content_args": {"tag_pattern": r"(?P<key>\w+)=(?P<value>[^\s<]+)",
                             "value_parser": {"name": "json", "args": {"allow_non_json": True}}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|end\|>|<eos>|$", "content": "text"},
    },
}


def make_tokenizer(extra_vocab: int = 0, tool_calling: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with `extra_vocab` unused filler tokens (to reach a
    realistic vocabulary size for benchmarks). `tool_calling`: three more special tokens (after the others, so every
    other id is unchanged), `TOOL_CHAT_TEMPLATE` and `TOOL_RESPONSE_TEMPLATE`."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    specials = SPECIAL_TOKENS + (TOOL_TOKENS if tool_calling else [])
    tokens = SPECIAL_TOKENS + chars + [f"<extra_{i}>" for i in range(extra_vocab)] + (TOOL_TOKENS if tool_calling
                                                                                         else [])
    backend = Tokenizer(models.WordLevel(vocab={tok: i for i, tok in enumerate(tokens)}, unk_token="<unk>"))
    pattern = "|".join(t.replace("|", r"\|") for t in specials)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pattern}|."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join back without spaces
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        chat_template=TOOL_CHAT_TEMPLATE if tool_calling else CHAT_TEMPLATE, padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[3:]})
    if tool_calling:
        tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised Qwen2-architecture causal LM sized to the tokenizer, in float32."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")],
        bos_token_id=None,
    )
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def copy_digits_dataset(num_prompts: int = 64, num_digits: int = 3, seed: int = 0,
                        conversational: bool = False) -> Dataset:
    """Prompts asking to repeat random digits; the `answer` column reaches the reward function."""
    rng = random.Random(seed)
    answers = ["".join(rng.choice("0123456789") for _ in range(num_digits)) for _ in range(num_prompts)]
    prompts: list = [f"copy {a}:" for a in answers]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "answer": answers})
