"""Tools: refused at start-up when the model cannot be told about them; run sync and async, concurrently across
the batch, failures reported to the model and counted."""

import asyncio
import threading

import pytest

from grpo_trainer.rollout.multiturn.tools import check_tools, run_calls, toolbox
from tests.tool_helpers import async_multiply, get, multiply


def undocumented(a: int) -> int:
    return a


def test_a_tool_without_a_docstring_is_refused_by_name():
    with pytest.raises(ValueError, match="tool 'undocumented' cannot be described.*Google-style docstring"):
        check_tools([multiply, undocumented])


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        check_tools([multiply, multiply])


def test_results_come_back_in_call_order_as_strings_sync_and_async_alike():
    tools = toolbox([multiply, async_multiply, get])
    calls = [[("async_multiply", {"a": 2, "b": 3}), ("multiply", {"a": 3, "b": 4}), ("get", {})]]
    (results,) = run_calls(calls, [tools])
    assert [(r.name, r.content, r.failed) for r in results] == [
        ("async_multiply", "6", False), ("multiply", "12", False), ("get", "42", False)]
    assert results[0].message() == {"role": "tool", "name": "async_multiply", "content": "6"}


def test_failures_are_results_the_model_sees():
    tools = toolbox([multiply, async_multiply])
    calls = [[("decrement", {"step": 1}),  # unknown tool
              ("multiply", {"a": 3, "c": 4}),  # wrong argument name
              ("async_multiply", {"a": 3, "c": 4}),  # same, async
              ("multiply", {"a": 3, "b": 4})]]
    (results,) = run_calls(calls, [tools])
    assert [r.failed for r in results] == [True, True, True, False]
    assert results[0].content == "{'error': \"unknown tool 'decrement'; available: ['async_multiply', 'multiply']\"}"
    assert "TypeError" in results[1].content and "'c'" in results[1].content
    assert results[3].content == "12"


def test_async_tools_of_the_whole_batch_run_concurrently_on_one_lasting_loop():
    # Each call waits until all four have started: they can only finish if they run at the same time.
    started, loops = [], []

    async def rendezvous(row: int) -> int:
        """Wait for the others.

        Args:
            row: The caller.
        """
        started.append(row)
        loops.append((asyncio.get_running_loop(), threading.current_thread().name))
        while len(started) < 4:
            await asyncio.sleep(0.001)
        return row

    calls = [[("rendezvous", {"row": i})] for i in range(4)]
    results = run_calls(calls, [toolbox([rendezvous])] * 4)
    assert [r[0].content for r in results] == ["0", "1", "2", "3"]
    started.clear()
    run_calls(calls, [toolbox([rendezvous])] * 4)
    assert len({id(loop) for loop, _ in loops}) == 1  # the same loop across calls (loop-bound resources survive)
    assert {thread for _, thread in loops} == {"grpo-tools"}  # in its own thread, not the trainer's
