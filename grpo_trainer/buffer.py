"""The generation round as the micro-steps consume it.

One round holds `steps_per_generation` micro-batches of rows (`B` completions each). Its rows are shuffled once
(advantages are already computed, so groups no longer need to stay together) and cut into equal slices; each
slice is trimmed to its own padding before the forward pass, so a micro-batch of short completions does not pay
for the round's longest one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["kept_columns", "select_rows", "split_round", "trim_padding"]


def select_rows(round_: dict[str, Any], index: slice | Tensor) -> dict[str, Any]:
    """The rows `index` of every per-row tensor; scalars (such as the loss normaliser) are shared."""
    return {k: (v[index] if isinstance(v, Tensor) and v.dim() > 0 else v) for k, v in round_.items()}


def split_round(round_: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Shuffle the round's rows and cut `parts` equal slices (one part: the round itself, no copy)."""
    if parts == 1:
        return [round_]
    rows = round_["completion_ids"].shape[0]
    order = torch.randperm(rows, device=round_["completion_ids"].device)
    size = rows // parts
    return [select_rows(round_, order[i * size:(i + 1) * size]) for i in range(parts)]


def kept_columns(inputs: dict[str, Any]) -> tuple[int, int]:
    """The first prompt column and the completion length `trim_padding` keeps."""
    first = int(inputs["prompt_mask"].any(0).int().argmax())
    return first, max(int(inputs["completion_mask"].sum(1).max()), 1)


def trim_padding(inputs: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prompt ids/mask `[B, S']` and completion ids/mask `[B, T']` without the columns that are padding in every
    row: left of the longest prompt, right of the longest completion."""
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    first, last = kept_columns(inputs)
    return (inputs["prompt_ids"][:, first:], prompt_mask[:, first:], inputs["completion_ids"][:, :last],
            completion_mask[:, :last])
