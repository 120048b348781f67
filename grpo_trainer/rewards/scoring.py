"""Calling reward functions and reward models, with TRL's reward-function contract.

A reward function is called with keyword arguments only: `prompts`, `completions`, `completion_ids`, every
extra dataset column (one value per completion), `trainer_state`, and from the trainer `log_extra(column, values)`
and `log_metric(name, value)` (a column for the completions table, a scalar for the logged metrics); it returns one
float (or None for "not applicable") per completion. `async def` functions run concurrently. A reward model (an
`AutoModelForSequenceClassification` or a model id) scores `prompt + completion` in micro-batches, taking
`logits[:, 0]`.

A function that raises, returns the wrong number of values, or computes NaN or inf is reported by name with the
sample index and prompt (`reward_error_policy='raise'`), or its bad values become missing rewards
(`reward_error_policy='none'`). `None` is how a function says "not applicable"; a NaN it computed is a bug.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

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


def _to_floats(values: Any, name: str, count: int) -> tuple[list[float], list[int]]:
    """Floats with None -> NaN ("not applicable"), and the indices of values the function computed as NaN or
    inf, which are bugs rather than abstentions."""
    if isinstance(values, Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != count:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward function {name!r} returned {got} values for {count} completions; it must return "
                         "a list with one float (or None) per completion.")
    floats = [math.nan if v is None else float(v) for v in values]
    bad = [i for i, (v, f) in enumerate(zip(values, floats)) if v is not None and not math.isfinite(f)]
    return [math.nan if i in bad else f for i, f in enumerate(floats)], bad


def _run_coroutines(coroutines: list) -> list:
    async def gather() -> list:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with ThreadPoolExecutor(1) as pool:  # called from inside a running loop (e.g. a notebook)
        return pool.submit(asyncio.run, gather()).result()


def _call(func: Callable, kwargs: dict[str, Any]) -> Any:
    result = func(**kwargs)
    if inspect.isawaitable(result):
        result = _run_coroutines([result])[0]
        if isinstance(result, BaseException):  # gather(return_exceptions=True) hands the exception back
            raise result
    return result


LOGGING_KWARGS = ("log_extra", "log_metric")


def _discard(*args: Any) -> None:
    return None


def _failure(name: str, index: int, prompt: Any, reason: str) -> RewardError:
    return RewardError(f"reward function {name!r} failed on sample {index} ({reason}); prompt: {str(prompt)[:200]!r}. "
                       "Fix the function, or set reward_error_policy='none' to treat such failures as missing rewards.")


def _locate_failure(func: Callable, name: str, kwargs: dict[str, Any], count: int, policy: str,
                    error: BaseException) -> list[float]:
    """The batch call failed: re-run `func` one sample at a time to name the failing sample (policy 'raise') or
    to keep the samples that do score (policy 'none')."""
    values = []
    for i in range(count):
        single = {k: ([v[i]] if isinstance(v, list) and len(v) == count else v) for k, v in kwargs.items()}
        # What a one-sample call logs would be a fragment of the round's column or a skewed metric: dropped.
        single.update({k: _discard for k in LOGGING_KWARGS if k in kwargs})
        try:
            (value,), bad = _to_floats(_call(func, single), name, 1)
            if bad:
                raise ValueError("returned NaN or inf")
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            if policy == "raise":
                raise _failure(name, i, kwargs["prompts"][i], f"{type(exc).__name__}: {exc}") from exc
            value = math.nan
        values.append(value)
    if policy == "raise":  # every sample passed alone: the batch call itself is broken
        raise RewardError(f"reward function {name!r} failed on the batch ({type(error).__name__}: {error}).") from error
    return values


def score_completions(
    funcs: Sequence[Callable],
    names: Sequence[str],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    policy: str = "raise",
    **extra: Any,
) -> Tensor:
    """Scores of every completion under every reward. Returns `[B, F]` float32, NaN for missing rewards."""
    count = len(completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns, **extra}
    pending = {i: f(**kwargs) for i, f in enumerate(funcs) if inspect.iscoroutinefunction(f)}
    async_results = dict(zip(pending, _run_coroutines(list(pending.values())))) if pending else {}
    columns_out = []
    for i, (func, name) in enumerate(zip(funcs, names)):
        try:
            result = async_results[i] if i in async_results else func(**kwargs)
            if isinstance(result, BaseException):
                raise result
            values, bad = _to_floats(result, name, count)
        except Exception as exc:  # noqa: BLE001
            values, bad = _locate_failure(func, name, kwargs, count, policy, exc), []
        if bad and policy == "raise":  # the batch result already names the sample: no need to call again
            raise _failure(name, bad[0], prompts[bad[0]], f"returned {result[bad[0]]}")
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
