"""Per-thread swaps of a module's attributes (`modeling.swaps`): what an asynchronous producer thread and the
training step each see of the one model."""

import threading

import torch

from grpo_trainer.modeling.swaps import base_forward, installed, patched, swapped


def test_an_installed_forward_is_the_installing_threads_alone():
    """Decision 8: while the main thread has a replacement installed, another thread (an asynchronous producer)
    calls the module's own forward, and its own install and removal leave the main thread's in place."""
    module = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    own = module(x)
    seen = {}

    def other_thread(step):
        seen[step] = (torch.equal(module(x), own), patched(module))
        if step == "install":
            with installed(module, lambda value: value * 0 + 7):
                seen["inside"] = (module(x) == 7).all().item(), patched(module)

    with installed(module, lambda value: value * 0 - 1):
        assert (module(x) == -1).all() and patched(module)
        for step in ("call", "install"):
            thread = threading.Thread(target=other_thread, args=(step,))
            thread.start()
            thread.join()
        assert (module(x) == -1).all()  # the other thread's removal left ours
        assert torch.equal(base_forward(module)(x), own)
    assert seen == {"call": (True, False), "install": (True, False), "inside": (True, True)}
    assert "forward" not in module.__dict__ and torch.equal(module(x), own)


def test_swaps_nest_within_a_thread_and_interleave_across_threads():
    """Decision 2: nested swaps in one thread wrap this thread's value (not the dispatcher) and unwind in order; two
    threads that enter and leave out of order restore their own values and, at the end, the module's."""
    layer = torch.nn.Module()
    layer.func = lambda: "original"
    original = layer.__dict__["func"]
    entered, release, results = threading.Event(), threading.Event(), {}

    def other():
        with swapped(layer, "func", lambda current: lambda: "other(" + current() + ")"):
            entered.set()
            release.wait()
            results["other"] = layer.func()
        results["other after"] = layer.func()

    with swapped(layer, "func", lambda current: lambda: "outer(" + current() + ")"):
        thread = threading.Thread(target=other)
        thread.start()
        entered.wait()
        with swapped(layer, "func", lambda current: lambda: "inner(" + current() + ")"):
            assert layer.func() == "inner(outer(original))"
        assert layer.func() == "outer(original)"
    assert layer.func() == "original"  # left before the other thread: its swap is still there, for it alone
    release.set()
    thread.join()
    assert results == {"other": "other(original)", "other after": "original"}
    assert layer.__dict__["func"] is original
