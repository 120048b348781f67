"""Built-in reward functions, picked by name (`grpo-train --reward_funcs accuracy think_format`), and user ones
given as `module:function` or `path/to/file.py:function`.

Decisions:

1. `REWARD_FUNCS` maps a name to a *builder* `(GRPOConfig) -> reward function`, not to the function itself: some
   rewards depend on the run's settings (the soft overlong penalty on `max_completion_length`). Every built
   function keeps TRL's reward contract (keyword arguments, one float or None per completion).
2. Rewards accept plain-text and conversational completions alike; TRL's math rewards index `completion[0]`,
   so completions are normalised to message lists before they are called.
3. The dataset columns a reward needs are read from its signature (parameters without a default other than the
   ones the trainer always passes), so a missing column is reported before any model is loaded.
4. open-r1's recipes name rewards `format`, `tag_count`, `reasoning_steps` and `soft_overlong_punishment`: the same
   names select the same rules here (`accuracy` already is open-r1's math-verify accuracy).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["REWARD_FUNCS", "accuracy_reward", "copy_digits_reward", "get_reward_func", "length_penalty",
           "reasoning_steps_reward", "required_columns", "strict_format_reward", "tag_count_reward",
           "think_answer_format_reward", "think_format_reward"]

RewardFunc = Callable[..., list]
ALWAYS_PASSED = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra"}
THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
# open-r1's `format`: the tags on lines of their own, in order (MULTILINE: `$` may end any line after </answer>)
OPEN_R1_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
# open-r1's `reasoning_steps`: markers of an enumerated step
STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def _texts(completions: list) -> list[str]:
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def _as_messages(completions: list) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in _texts(completions)]


def accuracy_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer (LaTeX or `\\boxed{}`) equal to `solution`, else 0.0;
    None where `solution` cannot be parsed. Wraps `trl.rewards.accuracy_reward`."""
    from trl.rewards import accuracy_reward as trl_accuracy

    return trl_accuracy(_as_messages(completions), list(solution))


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion opens with one `<think>...</think>` block (wraps `trl.rewards`)."""
    from trl.rewards import think_format_reward as trl_think_format

    return trl_think_format(_as_messages(completions))


def think_answer_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the whole completion is `<think>...</think> <answer>...</answer>` (DeepSeek-R1's format)."""
    return [1.0 if THINK_ANSWER.match(text) else 0.0 for text in _texts(completions)]


def strict_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` with each tag on its own
    line (open-r1's `format` reward), else 0.0."""
    return [1.0 if OPEN_R1_FORMAT.match(text) else 0.0 for text in _texts(completions)]


def tag_count_reward(completions: list, **kwargs: Any) -> list[float]:
    """0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` present exactly once
    (open-r1's `tag_count`): partial credit on the way to the full format."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if text.count(tag) == 1) for text in _texts(completions)]


def reasoning_steps_reward(completions: list, **kwargs: Any) -> list[float]:
    """min(1, steps / 3) where steps counts step markers ("Step 1:", "1.", bullets, "First,", ...), open-r1's
    `reasoning_steps`: three or more steps get the full reward."""
    return [min(1.0, len(STEP_MARKERS.findall(text)) / 3) for text in _texts(completions)]


def length_penalty(max_completion_length: int) -> RewardFunc:
    """-len / max_completion_length, in [-1, 0]: prefers shorter completions; weight it with reward_weights."""

    def length_penalty_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return length_penalty_reward


def copy_digits_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """Fraction of the answer's digits reproduced in place, minus a small penalty per extra character."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        hits = sum(a == b for a, b in zip(text, target))
        extra = max(0, len(text) - len(target))
        rewards.append(hits / len(target) - 0.05 * extra)
    return rewards


def _soft_overlong(max_completion_length: int) -> RewardFunc:
    # DAPO eq. 13: no penalty up to L_max - L_cache tokens, then linear down to -1 at L_max. DAPO's cache is
    # 4k of a 20k budget; a quarter of the budget keeps the band wide enough for short runs.
    from trl.rewards import get_soft_overlong_punishment

    return get_soft_overlong_punishment(max_completion_length, max(1, max_completion_length // 4))


# name -> a factory taking the run's `max_completion_length` (what the length-aware rewards need)
REWARD_FUNCS: dict[str, Callable[[int], RewardFunc]] = {
    "accuracy": lambda length: accuracy_reward,
    "think_format": lambda length: think_format_reward,
    "think_answer_format": lambda length: think_answer_format_reward,
    "length_penalty": length_penalty,
    "soft_overlong": _soft_overlong,
    "copy_digits": lambda length: copy_digits_reward,
    # open-r1's names (decision 4)
    "format": lambda length: strict_format_reward,
    "tag_count": lambda length: tag_count_reward,
    "reasoning_steps": lambda length: reasoning_steps_reward,
    "soft_overlong_punishment": _soft_overlong,
}


def _load_module(name: str) -> Any:
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise ValueError(f"reward file {name!r} does not exist.")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(name))[0], name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:  # a console script does not put the working directory on sys.path
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {name!r} for a reward function ({exc}).") from None


def get_reward_func(spec: str, max_completion_length: int) -> RewardFunc:
    """A reward by registry name (length-aware ones use `max_completion_length`), or `module:function` /
    `file.py:function` for user code."""
    if spec in REWARD_FUNCS:
        return REWARD_FUNCS[spec](max_completion_length)
    if ":" not in spec:
        raise ValueError(f"unknown reward function {spec!r}; choose one of {sorted(REWARD_FUNCS)} or give "
                         "'module:function' / 'path/to/file.py:function' for your own.")
    module_name, _, func_name = spec.rpartition(":")
    func = getattr(_load_module(module_name), func_name, None)
    if not callable(func):
        raise ValueError(f"{module_name!r} has no callable {func_name!r} (reward function {spec!r}).")
    return func


def required_columns(func: Callable) -> set[str]:
    """Dataset columns `func` needs: its parameters without a default, other than the trainer's own."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in ALWAYS_PASSED}
