"""Replacing a module's attribute for one thread: the forward modifications (`modeling.forwards.installed`: the tiled
MLP and norms, the recomputed attention, the tied lookup, routing replay, layer replay) swap a module's `forward` or a
decoder layer's `_gradient_checkpointing_func` within a context.

Decisions:

1. A swap is the swapping thread's alone. With asynchronous rounds an in-process producer thread runs the same model
   (its sampling, the behaviour log-probs' forward) while the training step runs: a swap visible to the other thread,
   or two threads restoring each other's saved values in the wrong order, made the step's checkpoint recomputation run
   another thread's replacement (torch's CheckpointError; routing replay's "routed 84 tokens but 114 were recorded":
   found by the combination matrix). While any thread has a swap, the attribute is a `_PerThread` dispatcher: each
   thread calls its own latest value, every other thread the value the module had.
2. Swaps of one attribute nest within a thread (`swapped`: routing replay's checkpoint function wraps the tiling's):
   each receives this thread's current value, never the dispatcher, and leaving restores the one before it. A
   module's `forward` is replaced once (`installed`: an outer replacement, or one a hook library put on the instance,
   stays).
3. A checkpoint's recomputation calls the function its forward captured, so it needs no lookup in its own thread
   (on CUDA, autograd's device thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["base_forward", "installed", "patched", "swapped"]

_lock = threading.Lock()
_MISSING = object()


class _PerThread:
    """Decision 1's dispatcher of one attribute."""

    def __init__(self, original: Any, own: bool) -> None:
        self.original, self.own = original, own  # `own`: the original was the instance's (not its class's)
        self.values: dict[int, Any] = {}  # thread id -> its current value

    def current(self) -> Any:
        return self.values.get(threading.get_ident(), self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.current()(*args, **kwargs)


@contextlib.contextmanager
def swapped(obj: nn.Module, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`obj.<name>` is `make(this thread's value)` within this context, for this thread only (decision 2)."""
    me = threading.get_ident()
    with _lock:
        found = obj.__dict__.get(name, _MISSING)
        dispatch = found if isinstance(found, _PerThread) else _PerThread(getattr(obj, name), found is not _MISSING)
        previous = dispatch.values.get(me, _MISSING)
        dispatch.values[me] = make(dispatch.current())
        obj.__dict__[name] = dispatch
    try:
        yield
    finally:
        with _lock:
            if previous is _MISSING:
                del dispatch.values[me]
            else:
                dispatch.values[me] = previous
            if not dispatch.values:
                if dispatch.own:
                    obj.__dict__[name] = dispatch.original
                else:
                    del obj.__dict__[name]


def patched(module: nn.Module) -> bool:
    """Whether `module`'s forward is not its own for this thread: replaced on the instance by someone else (a hook
    library), or by `installed` in this thread."""
    own = module.__dict__.get("forward")
    return own is not None and (not isinstance(own, _PerThread) or threading.get_ident() in own.values)


def base_forward(module: nn.Module) -> Callable[..., Any]:
    """`module`'s forward as this thread would call it without `installed`'s replacements."""
    own = module.__dict__.get("forward")
    return own.original if isinstance(own, _PerThread) else module.forward


@contextlib.contextmanager
def installed(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """`module.forward` is `forward` within this context, for this thread only (decision 2: nested, the outer one's
    stays)."""
    if patched(module):
        yield
        return
    with swapped(module, "forward", lambda current: forward):
        yield
