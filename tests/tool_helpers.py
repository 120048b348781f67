"""Shared by the multi-turn tests: tools, tokenizers built offline, and a tiny model made to call a tool.

- `make_tokenizer(tool_calling=True)` (the toy format, `<call>name k=v</call>`, parsed by transformers' response
  parsing) and `qwen_tokenizer()`: a character-level tokenizer carrying Qwen3's real chat template (the file TRL
  ships), whose calls are `<tool_call>{json}</tool_call>` and whose turns end with `<|im_end|>`.
- `calling_kwargs`: generation settings under which any model writes `<call>get</call>` after every assistant
  header (a +100 sequence bias on each next token of the call), so a random tiny model calls a tool for real, on
  every rollout backend.
"""

from importlib.resources import files

from grpo_trainer.cli.toy import make_tokenizer

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]


def get() -> str:
    """Read the secret.

    Returns:
        The secret.
    """
    return "42"


async def fetch() -> str:
    """Read the secret, asynchronously.

    Returns:
        The secret.
    """
    return "42"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


async def async_multiply(a: int, b: int) -> int:
    """Multiply two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def qwen_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    return tokenizer


def calling_kwargs(tokenizer, call: str = "<call>get</call><|end|>", after: str = "<|assistant|>") -> dict:
    """generation_kwargs that make the model write `call` right after `after` (greedy or sampled alike). Each token
    is biased after the one before it, so `call` must not repeat a token with two different successors."""
    ids = tokenizer.convert_tokens_to_ids([after] + tokenizer.tokenize(call))
    return {"sequence_bias": {tuple(ids[i:i + 2]): 100.0 for i in range(len(ids) - 1)}}
