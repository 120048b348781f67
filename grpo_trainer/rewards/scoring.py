"""Calling reward functions and reward models, with TRL's reward-function contract.

A reward function is called with keyword arguments only: `prompts`, `completions`, `completion_ids`, every
extra dataset column (one value per completion), `trainer_state`, and from the trainer `log_extra(column, values)`
and `log_metric(name, value)` (a column for the completions table, a scalar for the logged metrics); it returns one
float (or None for "not applicable") per completion. `async def` functions run concurrently. A reward model (an
`AutoModelForSequenceClassification` or a model id) scores `prompt + completion` in micro-batches, taking
`logits[:, 0]`.

A value may be any number a user computes: a Python number or bool, a numpy scalar or 0-d array, a one-element
tensor, or None; the values come as a list or tuple, a 1-D numpy array or a 1-D tensor. `None` is how a function
says "not applicable"; a NaN or inf it computed, or a value that is not a number, is a bug.

A failure is reported by name (`reward_error_policy='raise'`), or its values become missing rewards
(`reward_error_policy='none'`). A function that raises is re-run one sample at a time to name the failing sample
and prompt (or keep the samples that do score); a bad value is named from the batch result. A result that is
unusable as a whole (the wrong type or length) or that did not arrive within `timeout` seconds (`reward_timeout`)
is reported for the function, without re-running it per sample, which would blame a sample for the function's
return type or wait `timeout` once per sample. With a timeout, a synchronous function runs in a daemon thread (a
stuck call cannot be interrupted, only abandoned) and async functions in an event loop of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["RewardError", "RewardFunc", "RewardModel", "reward_name", "score_completions", "score_with_model"]


class RewardFunc(Protocol):
    def __call__(self, *, prompts: list, completions: list, completion_ids: list[list[int]],
                 **columns: Any) -> list[float | None]: ...


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names the function, the sample and its prompt."""


def reward_name(func: Any) -> str:
    """Metric name of a reward: the callable's `__name__`, or the reward model's id basename."""
    if isinstance(func, nn.Module):
        path = getattr(getattr(func, "config", None), "_name_or_path", "") or type(func).__name__
        return path.rstrip("/").split("/")[-1]
    if isinstance(func, str):
        return func.rstrip("/").split("/")[-1]
    return getattr(func, "__name__", None) or type(func).__name__


_VALUES = "one number (Python, numpy or torch), bool or None per completion"


class _UnusableResult(ValueError):
    """The result as a whole is unusable (its type or length): re-running the function per sample would blame a
    sample for it."""


class _TimedOut(Exception):
    """The call did not return within the reward timeout."""


def _as_list(values: Any, name: str, count: int) -> list:
    if isinstance(values, (Tensor, np.ndarray)):
        if values.ndim != 1:
            raise _UnusableResult(f"reward function {name!r} returned a {type(values).__name__} of shape "
                                  f"{tuple(values.shape)} for {count} completions; it must return {_VALUES}.")
        values = values.detach().cpu().tolist() if isinstance(values, Tensor) else values.tolist()
    elif not isinstance(values, (list, tuple)):
        raise _UnusableResult(f"reward function {name!r} returned a {type(values).__name__}; it must return {_VALUES} "
                              "(a list, tuple, 1-D numpy array or 1-D tensor).")
    if len(values) != count:
        raise _UnusableResult(f"reward function {name!r} returned {len(values)} values for {count} completions; it "
                              f"must return {_VALUES}.")
    return list(values)


def _as_float(value: Any) -> float | None:
    """The value as a float (None -> NaN, "not applicable"), or None when it is not a number."""
    if value is None:
        return math.nan
    if isinstance(value, np.ndarray) and value.size == 1 or isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def _to_floats(values: Any, name: str, count: int) -> tuple[list[float], dict[int, str]]:
    """Floats (None -> NaN) and, by index, why a value is a bug: a NaN or inf the function computed, or a value that
    is not a number at all (those values become NaN too)."""
    floats, bad = [], {}
    for i, value in enumerate(_as_list(values, name, count)):
        number = _as_float(value)
        if number is None:
            bad[i] = f"returned a {type(value).__name__}, not a number: {str(value)[:40]!r}"
        elif value is not None and not math.isfinite(number):
            bad[i] = f"returned {number}"
        floats.append(math.nan if i in bad else number)
    return floats, bad


def _in_thread(call: Callable[[], Any], timeout: float) -> Any:
    """`call()` in a daemon thread, waited for at most `timeout` seconds (then `_TimedOut`; the thread is left
    behind, and a daemon thread does not keep the process alive)."""
    done, box = threading.Event(), {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="reward function", daemon=True).start()
    if not done.wait(timeout):
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_coroutines(coroutines: list, timeout: float | None = None) -> list:
    """Results (or raised exceptions) of `coroutines` run concurrently; `_TimedOut` for one still running after
    `timeout` seconds, also when a coroutine blocks the event loop itself (a loop of its own, in a thread)."""
    results: list = [_TimedOut() for _ in coroutines]

    def record(index: int, task: asyncio.Future) -> None:
        if not task.cancelled():
            results[index] = task.exception() if task.exception() is not None else task.result()

    async def run_all() -> None:
        tasks = [asyncio.ensure_future(c) for c in coroutines]
        for index, task in enumerate(tasks):
            task.add_done_callback(functools.partial(record, index))
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()

    if timeout is not None:
        with contextlib.suppress(_TimedOut):
            _in_thread(lambda: asyncio.run(run_all()), timeout)
        return list(results)  # a copy: the abandoned loop may still write
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(run_all())
        return results
    with ThreadPoolExecutor(1) as pool:  # called from inside a running loop (e.g. a notebook)
        pool.submit(asyncio.run, run_all()).result()
    return results


def _call(func: Callable, kwargs: dict[str, Any], timeout: float | None = None) -> Any:
    result = func(**kwargs) if timeout is None else _in_thread(lambda: func(**kwargs), timeout)
    if inspect.isawaitable(result):
        result = _run_coroutines([result], timeout)[0]
        if isinstance(result, BaseException):
            raise result
    return result


LOGGING_KWARGS = ("log_extra", "log_metric")


def _discard(*args: Any) -> None:
    return None


def _failure(name: str, index: int, prompt: Any, reason: str) -> RewardError:
    return RewardError(f"reward function {name!r} failed on sample {index} ({reason}); prompt: {str(prompt)[:200]!r}. "
                       "Fix the function, or set reward_error_policy='none' to treat such failures as missing rewards.")


def _reason(exc: BaseException, timeout: float | None) -> str:
    if isinstance(exc, _TimedOut):
        return f"did not return within reward_timeout ({timeout} s)"
    return f"{type(exc).__name__}: {exc}"


def _locate_failure(func: Callable, name: str, kwargs: dict[str, Any], count: int, policy: str,
                    error: BaseException, timeout: float | None = None) -> list[float]:
    """The batch call failed: re-run `func` one sample at a time to name the failing sample (policy 'raise') or
    to keep the samples that do score (policy 'none')."""
    values = []
    for i in range(count):
        single = {k: ([v[i]] if isinstance(v, list) and len(v) == count else v) for k, v in kwargs.items()}
        # What a one-sample call logs would be a fragment of the round's column or a skewed metric: dropped.
        single.update({k: _discard for k in LOGGING_KWARGS if k in kwargs})
        try:
            (value,), bad = _to_floats(_call(func, single, timeout), name, 1)
            if bad:
                raise ValueError(bad[0])
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            if policy == "raise":
                raise _failure(name, i, kwargs["prompts"][i], _reason(exc, timeout)) from exc
            value = math.nan
        values.append(value)
    if policy == "raise":  # every sample passed alone: the batch call itself is broken
        raise RewardError(f"reward function {name!r} failed on the batch ({type(error).__name__}: {error}).") from error
    return values


def _whole_batch_failure(message: str, count: int, policy: str, error: BaseException) -> list[float]:
    """A failure of the function's whole result (its type or length, or a timeout): an error (policy 'raise') or
    missing rewards for the whole batch, with a warning (policy 'none')."""
    if policy == "raise":
        raise RewardError(f"{message} Fix the function, or set reward_error_policy='none' to treat such failures as "
                          "missing rewards.") from error
    warnings.warn(f"{message} Its rewards for these {count} completions are missing (reward_error_policy='none').",
                  stacklevel=3)
    return [math.nan] * count


def score_completions(
    funcs: Sequence[Callable],
    names: Sequence[str],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    policy: str = "raise",
    timeout: float | None = None,
    **extra: Any,
) -> Tensor:
    """Scores of every completion under every reward. Returns `[B, F]` float32, NaN for missing rewards. `timeout`:
    seconds each function may take on the batch (None: no limit)."""
    count = len(completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns, **extra}
    pending = {i: f(**kwargs) for i, f in enumerate(funcs) if inspect.iscoroutinefunction(f)}
    async_results = dict(zip(pending, _run_coroutines(list(pending.values()), timeout))) if pending else {}
    columns_out = []
    for i, (func, name) in enumerate(zip(funcs, names)):
        try:
            result = async_results[i] if i in async_results else _call(func, kwargs, timeout)
            if isinstance(result, BaseException):
                raise result
            values, bad = _to_floats(result, name, count)
        except _UnusableResult as exc:
            values, bad = _whole_batch_failure(str(exc), count, policy, exc), {}
        except _TimedOut as exc:
            message = f"reward function {name!r} {_reason(exc, timeout)} on {count} completions."
            values, bad = _whole_batch_failure(message, count, policy, exc), {}
        except Exception as exc:  # noqa: BLE001
            values, bad = _locate_failure(func, name, kwargs, count, policy, exc, timeout), {}
        if bad and policy == "raise":  # the batch result already names the sample: no need to call again
            first = min(bad)
            raise _failure(name, first, prompts[first], bad[first])
        columns_out.append(values)
    return torch.tensor(columns_out, dtype=torch.float32).T.reshape(count, len(funcs))


@torch.no_grad()
def score_with_model(model: nn.Module, tokenizer: Any, prompts: list, completions: list, batch_size: int) -> list:
    """Reward-model scores (`logits[:, 0]`) of `prompt + completion`, `batch_size` texts per forward."""
    if isinstance(prompts[0], list):  # conversational: the reward tokenizer's own chat template
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="right",
                          add_special_tokens=False).to(device)
        scores.extend(model(**batch).logits[:, 0].float().tolist())
    return scores


class RewardModel:
    """A sequence-classification model behind the reward-function contract, so the trainer treats every
    reward the same way."""

    def __init__(self, model: nn.Module, tokenizer: Any, batch_size: int) -> None:
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.__name__ = reward_name(model)
        if getattr(model.config, "pad_token_id", None) is None:
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            model.config.pad_token_id = tokenizer.pad_token_id

    def __call__(self, *, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return score_with_model(self.model, self.tokenizer, prompts, completions, self.batch_size)
