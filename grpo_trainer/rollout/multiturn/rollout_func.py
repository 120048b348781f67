"""A user-owned rollout: `rollout_func(prompts, trainer) -> dict`, TRL's contract.

The function receives this process's prompts for the round, one per completion to produce (each prompt already
repeated `num_generations` times, as the dataset rows are), untokenised (chat messages or text), and the trainer. It
returns a dict with, per prompt:

- `prompt_ids`, `completion_ids`: token ids (lists of ints), the completion as the loss should score it;
- `logprobs`: one float (or None) per completion token, the sampler's log-probabilities: the behaviour policy's, as
  in TRL. They are what the off-policy mask (`off_policy_mask_threshold`) measures drift against, what vLLM's
  importance-sampling correction weighs by (with `use_vllm`), and the sampler's side of the mismatch report; the
  loss computes its own log-probs. (When tools write part of a completion the rollout is rebuilt from the tool loop
  and keeps none of them.)
- optionally `env_mask`: one 0/1 per completion token, 0 for tokens the policy did not sample (an environment's
  feedback); they stay in the context but not in the loss;
- any other key: passed to the reward functions as a keyword argument: a list holds one value per prompt, any
  other value is given to every prompt.

A missing key or a list of the wrong length raises a ValueError naming it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["REQUIRED_KEYS", "RolloutFuncOutput", "call_rollout_func"]

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncOutput(NamedTuple):
    """A rollout_func's result, checked. Indexing follows TRL's `_generate` (prompt ids, completion ids, mask)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    env_mask: list[list[int]] | None
    logprobs: list[list[float]]
    extra: dict[str, list]  # reward-function keyword arguments


def _rows(value: Any, key: str, count: int) -> list:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
        raise ValueError(f"rollout_func returned {got} for {key!r}; it must return a list with one entry per prompt "
                         f"({count}).")
    return [list(v) if isinstance(v, (list, tuple)) else v for v in value]


def call_rollout_func(rollout_func: Callable, prompts: list, trainer: Any) -> RolloutFuncOutput:
    """Run `rollout_func` on a copy of `prompts` (it may edit them) and check what it returns."""
    output = rollout_func(copy.deepcopy(prompts), trainer)
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func must return a dict, not a {type(output).__name__}.")
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict (it returned "
                         f"{sorted(output)}).")
    count = len(prompts)
    prompt_ids, completion_ids, logprobs = (_rows(output[key], key, count) for key in REQUIRED_KEYS)
    env_mask = _rows(output["env_mask"], "env_mask", count) if output.get("env_mask") is not None else None
    for i, ids in enumerate(completion_ids):
        if len(logprobs[i]) != len(ids) or (env_mask is not None and len(env_mask[i]) != len(ids)):
            raise ValueError(f"rollout_func returned, for prompt {i}, {len(ids)} completion_ids but "
                             f"{len(logprobs[i])} logprobs" + ("" if env_mask is None else
                                                               f" and {len(env_mask[i])} env_mask values")
                             + "; give one per completion token.")
    skip = {*REQUIRED_KEYS, "env_mask"}
    # A list is one value per prompt; anything else is the same value for every prompt.
    extra = {key: _rows(value, key, count) if isinstance(value, (list, tuple)) else [value] * count
             for key, value in output.items() if key not in skip}
    return RolloutFuncOutput(prompt_ids, completion_ids, env_mask, logprobs, extra)
