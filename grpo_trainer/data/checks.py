"""Checks of a dataset before any model is loaded: a `prompt` column of strings or chat messages, at least one row;
and the loader settings a streamed (`IterableDataset`) train or eval set needs.

Each failure raises one `ValueError` that names the dataset and column and says how to fix it (docs/ERRORS.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

__all__ = ["check_dataset", "eval_datasets", "is_conversational", "prepare_for_streaming"]

logger = logging.getLogger(__name__)


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


def eval_datasets(eval_dataset: Any) -> Iterator[tuple[str, Any]]:
    """(name, dataset) for every evaluation set: one unnamed ('eval') or each entry of a dict, `DatasetDict` or
    `IterableDatasetDict` (the names prefix their metrics, `eval_<name>_loss`)."""
    if isinstance(eval_dataset, dict):
        yield from eval_dataset.items()
    elif eval_dataset is not None:
        yield "eval", eval_dataset


def prepare_for_streaming(train_dataset: Any, eval_dataset: Any, args: Any) -> None:
    """Loader settings (on `args`, a GRPOConfig) for streamed datasets, which have no length and no index.

    Their rows are dicts of Python objects that only the process reading them can collate, so every process reads
    its own share: accelerate's `dispatch_batches` must be off (refused when set to True). A streamed train set
    carries the prompt repeats in the stream itself, so a single worker must read it in order: more would
    interleave the repeats and split prompt groups (`dataloader_num_workers` is forced to 0, with a warning).
    """
    streamed = [name for name, dataset in [("train", train_dataset), *eval_datasets(eval_dataset)]
                if isinstance(dataset, IterableDataset)]
    if not streamed:
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                         f"`accelerator_config` (streamed: {streamed}); set it to False, or pass map-style datasets.")
    args.accelerator_config.dispatch_batches = False
    if not isinstance(train_dataset, IterableDataset):
        return
    if args.max_steps <= 0:
        raise ValueError("train_dataset is an IterableDataset (no length), so set max_steps > 0.")
    if args.dataloader_num_workers != 0:
        logger.warning("Iterable datasets require `dataloader_num_workers=0` to keep each prompt's repeats together; "
                       f"overriding dataloader_num_workers={args.dataloader_num_workers} with 0.")
        args.dataloader_num_workers = 0
