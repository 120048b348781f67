"""Checks of a dataset before any model is loaded: a `prompt` column of strings or chat messages, at least one row.

Each failure raises one `ValueError` that names the dataset and column and says how to fix it (docs/ERRORS.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_dataset", "is_conversational"]


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of {'role', 'content'} messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def check_dataset(dataset: Any, name: str, tokenizer: Any, prompt_optional: bool = False) -> None:
    """A dataset needs a `prompt` column of strings or message lists, and at least one row. `prompt_optional`:
    environments may write the prompts (`rollout.multiturn.environments`), so rows may have none."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and not prompt_optional:
        raise ValueError(f"{name} has no 'prompt' column (columns: {columns}); rename the column that holds the "
                         "prompts to 'prompt', e.g. dataset.rename_column('question', 'prompt').")
    try:
        first = next(iter(dataset))
    except StopIteration:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.") from None
    prompt = first.get("prompt") if isinstance(first, dict) else None
    if isinstance(prompt, str) or prompt is None and prompt_optional:
        return
    if not is_conversational(prompt):
        raise ValueError(f"{name}['prompt'] must hold strings or lists of {{'role', 'content'}} messages; the first "
                         f"row holds {type(prompt).__name__}: {str(prompt)[:80]!r}.")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{name} has conversational prompts but the tokenizer has no chat_template; set "
                         "tokenizer.chat_template, or pass plain-text prompts.")
