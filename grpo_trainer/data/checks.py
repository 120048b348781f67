"""Checks of a dataset before any model is loaded: a `prompt` in every row, enough prompts for a generation round, a
processor (not a tokenizer) when rows hold images; and the loader settings a streamed (`IterableDataset`) train or
eval set needs.

Each failure raises one `ValueError` that names the dataset, the column (and the first bad row) and says how to fix
it (docs/ERRORS.md).

Decisions:

1. Every row's prompt is checked, not only the first: a `None` in row 50 000 would otherwise stop training hours
   later inside the tokenizer with an error that names neither the row nor the column. A `datasets.Dataset` is
   checked on its Arrow column (its type, null count and list lengths) without building a Python object per row;
   other map-style datasets row by row; a stream (`IterableDataset`) only by its first row, since reading it
   would consume it.
2. A sized dataset with fewer prompts than one generation round needs is an error: the sampler drops an
   incomplete round, so training would end at step 0 and exit 0.
3. Environments may write the prompts (`rollout.multiturn.environments`): with `prompt_optional`, a dataset without
   a prompt column (or whose prompts are None) passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import IterableDataset
from transformers import ProcessorMixin, TrainingArguments

__all__ = ["check_dataset", "check_enough_prompts", "eval_datasets", "is_conversational", "prepare_for_streaming"]

logger = logging.getLogger(__name__)

_PROMPT_HELP = "strings or lists of {'role', 'content'} messages"


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of {'role', 'content'} messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def _bad_row(name: str, index: int, prompt: Any) -> ValueError:
    if prompt is None:
        return ValueError(f"{name} row {index} has no prompt ('prompt' is None); every row needs one ({_PROMPT_HELP})."
                          " Drop or fill such rows first, e.g. dataset.filter(lambda row: row['prompt'] is not None).")
    return ValueError(f"{name}['prompt'] must hold {_PROMPT_HELP}; row {index} holds {type(prompt).__name__}: "
                      f"{str(prompt)[:80]!r}.")


def _arrow_column(dataset: Any) -> Any:
    """The prompt column as an Arrow array in the dataset's row order, or None for a dataset that is not Arrow."""
    import datasets

    if not isinstance(dataset, datasets.Dataset):  # a stream has no column to read without consuming it
        return None
    return dataset.with_format("arrow")["prompt"]


def _check_arrow(column: Any, name: str, dataset: Any) -> bool:
    """Decision 1 on an Arrow column. Returns whether the prompts are conversational."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    chat = (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(kind.value_type) and \
        {"role", "content"} <= {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)}
    if not (text or chat):
        raise _bad_row(name, 0, dataset[0]["prompt"])
    bad = pc.is_null(column)
    if chat:  # an empty list, or a null message, is no conversation either
        bad = pc.or_kleene(bad, pc.equal(pc.list_value_length(column), 0))
    candidates = [pc.index(pc.fill_null(bad, True), True).as_py()]
    messages = pc.list_flatten(column) if chat else None
    if messages is not None and messages.null_count:
        candidates.append(pc.min(pc.filter(pc.list_parent_indices(column), pc.is_null(messages))).as_py())
    flagged = [i for i in candidates if i is not None and i >= 0]
    if flagged:
        raise _bad_row(name, min(flagged), dataset[min(flagged)]["prompt"])
    return chat


def _check_rows(rows: Any, name: str) -> bool:
    """Decision 1, row by row. Returns whether the prompts are conversational."""
    kinds = set()
    for index, row in enumerate(rows):
        prompt = row.get("prompt") if isinstance(row, dict) else None
        kind = "text" if isinstance(prompt, str) else "chat" if is_conversational(prompt) else None
        if kind is None:
            raise _bad_row(name, index, prompt)
        kinds.add(kind)
        if len(kinds) > 1:
            raise ValueError(f"{name} mixes plain-text and conversational prompts (row {index} differs from row 0); "
                             "use one kind for the whole dataset.")
    if not kinds:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.")
    return kinds == {"chat"}


def check_dataset(dataset: Any, name: str, tokenizer: Any, prompt_optional: bool = False) -> None:
    """A dataset needs a `prompt` column of strings or message lists in every row, and at least one row.
    `prompt_optional`: decision 3."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    image_columns = sorted({"image", "images"} & set(columns or []))
    if image_columns and tokenizer is not None and not isinstance(tokenizer, ProcessorMixin):
        raise ValueError(f"{name} has an {image_columns[0]!r} column, so its prompts come with images, but "
                         f"processing_class is a {type(tokenizer).__name__}, which cannot read images; pass the "
                         "model's processor, e.g. processing_class=AutoProcessor.from_pretrained(model_id).")
    if prompt_optional and (columns is not None and "prompt" not in columns or _first_prompt_is_none(dataset)):
        return
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"{name} has no 'prompt' column (columns: {columns}); rename the column that holds the "
                         "prompts to 'prompt', e.g. dataset.rename_column('question', 'prompt').")
    column = _arrow_column(dataset)
    if column is not None and len(column) == 0:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.")
    if column is not None:
        conversational = _check_arrow(column, name, dataset)
    elif isinstance(dataset, Sized) and hasattr(dataset, "__getitem__"):
        conversational = _check_rows((dataset[i] for i in range(len(dataset))), name)
    else:
        conversational = _check_rows(_first(dataset), name)
    if conversational and tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{name} has conversational prompts but the tokenizer has no chat_template; set "
                         "tokenizer.chat_template, or pass plain-text prompts.")


def _first_prompt_is_none(dataset: Any) -> bool:
    for row in dataset:
        return isinstance(row, dict) and row.get("prompt") is None
    return False


def _first(stream: Any) -> list:
    for row in stream:
        return [row]
    return []


def check_enough_prompts(dataset: Any, name: str, generation_batch_size: int, num_generations: int) -> None:
    """Decision 2: `dataset` must hold the `generation_batch_size / num_generations` prompts of one round."""
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        return
    needed = generation_batch_size // num_generations
    if len(dataset) < needed:
        raise ValueError(
            f"{name} has {len(dataset)} prompts but one generation round needs {needed} (generation_batch_size "
            f"{generation_batch_size} / num_generations {num_generations}), so training would stop at step 0. Add "
            "prompts, or make the round smaller: generation_batch_size = per_device_train_batch_size x processes x "
            "steps_per_generation, so lower per_device_train_batch_size or steps_per_generation (or set "
            "generation_batch_size), or raise num_generations.")


def eval_datasets(eval_dataset: Any) -> Iterator[tuple[str, Any]]:
    """(name, dataset) for every evaluation set: one unnamed ('eval') or each entry of a dict, `DatasetDict` or
    `IterableDatasetDict` (the names prefix their metrics, `eval_<name>_loss`)."""
    if isinstance(eval_dataset, dict):
        yield from eval_dataset.items()
    elif eval_dataset is not None:
        yield "eval", eval_dataset


def prepare_for_streaming(train_dataset: Any, eval_dataset: Any, args: TrainingArguments) -> None:
    """Loader settings (on `args`, the Trainer's arguments) for streamed datasets, which have no length and no index.

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
