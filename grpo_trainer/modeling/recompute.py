"""Forwards that run inside a backward (the tiled MLP's tiles, a replayed layer): their saved tensors are the
backward's own transients, used at once and freed. An outer saved-tensor hook installed for the training forward
(activation offloading: TRL's `OffloadActivations`, `trainer.parts.activation_offloading`) would otherwise take
them for forward activations and copy each to host memory and straight back; `transient_saves` makes the innermost
hooks the identity for them, as non-reentrant checkpointing's recomputation installs hooks of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["transient_saves"]


def _same(tensor: Tensor) -> Tensor:
    return tensor


@contextlib.contextmanager
def transient_saves() -> Iterator[None]:
    """Within this context autograd saves tensors as they are (the innermost saved-tensor hooks win)."""
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        yield
