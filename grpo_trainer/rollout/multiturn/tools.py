"""Tools: checked when the trainer is built, run when a turn calls them.

Decisions:

1. A tool is a Python function (or an environment's bound method), sync or `async def`, whose schema transformers
   builds from its type hints and Google-style docstring (`get_json_schema`); one it cannot describe is refused at
   start-up, naming the tool.
2. A turn's calls run in the order they were written; `async` tools of every rollout in the batch run concurrently,
   on one event loop in a background thread that lives as long as the process (so an async tool or environment may
   keep loop-bound resources, e.g. a client session, across steps). Sync tools run one after another in the
   calling thread: several may share state.
3. A call to an unknown tool, or one that raises, fails: its result is `{"error": "<reason>"}`, which the model sees,
   and it counts in `tools/failure_frequency`. Results become strings (`str`), as chat templates expect.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

__all__ = ["ToolResult", "check_tools", "run_async", "run_calls", "tool_list", "toolbox"]


def tool_list(tools: Any) -> list[Callable]:
    """`GRPOTrainer(tools=)` as a list (None: no tools)."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of functions, not a {type(tools).__name__}; pass tools=[f].")
    return list(tools or [])


def check_tools(tools: Sequence[Callable], owner: str = "tools") -> None:
    """ValueError naming the first tool transformers cannot describe to the model (decision 1)."""
    names = set()
    for tool in tools:
        name = getattr(tool, "__name__", repr(tool))
        if not callable(tool):
            raise ValueError(f"{owner}: {name} is not callable; a tool is a function with type hints and a "
                             "Google-style docstring.")
        try:
            get_json_schema(tool)
        except Exception as error:  # noqa: BLE001 - transformers raises several types here
            raise ValueError(f"{owner}: tool {name!r} cannot be described to the model ({error}). Give it type "
                             "hints and a Google-style docstring with an `Args:` entry per argument.") from error
        if name in names:
            raise ValueError(f"{owner}: two tools are named {name!r}; tool names must be unique.")
        names.add(name)


def toolbox(tools: Sequence[Callable]) -> dict[str, Callable]:
    """Tools by the name the model calls them by."""
    return {tool.__name__: tool for tool in tools}


class _Loop:
    """One event loop in a daemon thread, started on first use (decision 2)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()

    def run(self, awaitables: list[Awaitable]) -> list[Any]:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="grpo-tools", daemon=True).start()

        async def together() -> list[Any]:
            return await asyncio.gather(*awaitables, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(together(), self.loop).result()


_LOOP = _Loop()


def run_async(awaitables: list[Awaitable]) -> list[Any]:
    """Results of `awaitables` run concurrently on the tools' event loop; an exception is returned, not raised."""
    return _LOOP.run(awaitables) if awaitables else []


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def _failure(name: str, error: BaseException | str) -> ToolResult:
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return ToolResult(name, str({"error": reason}), True)


def run_calls(calls: Sequence[Sequence[tuple[str, dict]]], toolboxes: Sequence[dict[str, Callable]]
              ) -> list[list[ToolResult]]:
    """Each rollout's calls `(name, arguments)` run against its own toolbox; results in call order (decision 2)."""
    results: list[list[ToolResult | None]] = [[None] * len(row) for row in calls]
    pending: list[tuple[int, int, str, Awaitable]] = []
    for i, (row, tools) in enumerate(zip(calls, toolboxes)):
        for j, (name, arguments) in enumerate(row):
            tool = tools.get(name)
            if tool is None:
                results[i][j] = _failure(name, f"unknown tool {name!r}; available: {sorted(tools)}")
                continue
            try:
                value = tool(**arguments)
            except Exception as error:  # noqa: BLE001 - a tool may raise anything; the model sees why
                results[i][j] = _failure(name, error)
                continue
            if inspect.isawaitable(value):
                pending.append((i, j, name, value))
            else:
                results[i][j] = ToolResult(name, str(value), False)
    for (i, j, name, _), value in zip(pending, run_async([p[3] for p in pending])):
        results[i][j] = _failure(name, value) if isinstance(value, BaseException) else ToolResult(name, str(value),
                                                                                                 False)
    return results  # type: ignore[return-value]
