"""How long a completion fits: the longest `max_completion_length` whose plan fits a device, and the settings that
reach longer.

Decisions:

1. The answer is a binary search over the planner itself (`plan_memory`), so it is exactly as right as the plan:
   no second model of memory. The plan grows with T wherever the rollout's replay tensors (`rollout.capture`,
   capped at `REPLAY_MAX_BYTES`) keep the same kinds: every other term is a product of T (or T^2, the padded
   attention mask) with non-negative sizes, or a maximum of such products. Where a kind of replay tensor stops
   fitting its cap, the plan drops by that tensor at the next T. So T splits into at most four segments by what
   the round keeps (layer outputs and softmax, outputs only, softmax only, nothing: `_kept_rank`, which never
   decreases with T), the plan is monotone within each, and the search runs per segment, longest first.
   tests/planning/test_longest.py sweeps T across the segments of several set-ups and checks both claims; the
   search itself checks that its answer fits and the next length does not.
2. "Settings that reach longer" are the levers of `planning.levers` marked `longest`, each pulled alone at its
   strongest (activation checkpointing, micro-batches of one row with the same global batch where the split is
   exact, the sequence-tiled MLP, the recomputed attention, activation offloading on a GPU, smaller LM-head chunks)
   and all together, where the levers' rules allow them (`levers.allowed`: on CUDA only what has run on a GPU, under a
   launch only what a launched test trained); and LoRA (no full gradients and optimizer state: more room for
   activations; trains other parameters, so it is marked as a different objective).
3. The search stops at `MAX_COMPLETION_SEARCH` tokens: a longer answer is reported as "at least" that. The plan
   knows nothing of the model's context length (`max_position_embeddings`); the CLI says when the answer passes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from grpo_trainer.planning import levers
from grpo_trainer.planning.estimate import MemoryPlan, _replay_bytes, plan_memory
from grpo_trainer.planning.settings import DeviceMemory, ModelShape, PlanSettings

__all__ = ["MAX_COMPLETION_SEARCH", "Longest", "longer_settings", "longest_completion"]

MAX_COMPLETION_SEARCH = 1 << 22  # 4,194,304 tokens: the search's upper end (decision 3)


@dataclass(frozen=True)
class Longest:
    """The longest completion length that fits with some settings. `completion_length` 0: not even one token fits;
    `at_least`: the search's upper end fits too (decision 3). `changes`: GRPOConfig field -> value (empty: the
    settings as given)."""

    completion_length: int
    plan: MemoryPlan | None
    changes: dict = dataclasses.field(default_factory=dict)
    same_objective: bool = True
    at_least: bool = False

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.changes.items())


def _with_length(settings: PlanSettings, T: int) -> PlanSettings:
    return dataclasses.replace(settings, completion_length=T)


def _kept_rank(settings: PlanSettings, shape: ModelShape, T: int) -> int:
    """What the round's replay tensors keep at T, ranked: 0 layer outputs and softmax, 1 outputs only, 2 softmax
    only, 3 nothing. Never decreases with T (decision 1): each kind is kept while it fits the cap that remains."""
    outputs, probs = _replay_bytes(_with_length(settings, T), shape)
    return 2 * (outputs == 0) + (probs == 0)


def _last_true(predicate: Callable[[int], bool], low: int, high: int) -> int:
    """The largest T in [low, high] with predicate(T), for a predicate true up to some T and false after; low - 1
    when it is false at low."""
    if not predicate(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        if predicate(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _segments(settings: PlanSettings, shape: ModelShape, high: int) -> list[tuple[int, int]]:
    """[first, last] ranges of T in [1, high] over which the replay tensors keep the same kinds (decision 1)."""
    segments, start = [], 1
    while start <= high:
        rank = _kept_rank(settings, shape, start)
        end = _last_true(lambda T, rank=rank: _kept_rank(settings, shape, T) == rank, start, high)
        segments.append((start, end))
        start = end + 1
    return segments


def longest_completion(settings: PlanSettings, shape: ModelShape, device: DeviceMemory,
                       high: int = MAX_COMPLETION_SEARCH) -> Longest:
    """The longest `max_completion_length` (the prompt length as in `settings`) whose plan fits `device`."""

    def fits(T: int) -> bool:
        return plan_memory(_with_length(settings, T), shape).device_bytes <= device.total_bytes

    for first, last in reversed(_segments(settings, shape, high)):
        T = _last_true(fits, first, last)
        if T >= first:
            if T < last and fits(T + 1):  # the plan is monotone within a segment (decision 1)
                raise AssertionError(f"the memory plan is not monotone in the completion length at T = {T}")
            return Longest(T, plan_memory(_with_length(settings, T), shape), at_least=T == high)
    return Longest(0, None)


def _levers(settings: PlanSettings, split_exact: bool) -> list[tuple[dict, PlanSettings]]:
    """(GRPOConfig changes, settings) for each lever of decision 2 that changes something, then all together."""
    pulls = [pulled[-1] for lever in levers.LEVERS if lever.longest and levers.allowed(lever, settings)
             for pulled in [lever.pulls(settings, split_exact)] if pulled]
    found = [(levers.config_changes(pull), levers.apply(settings, pull)) for pull in pulls]
    if len(pulls) > 1:
        together = {k: v for pull in pulls for k, v in pull.items()}
        found.append((levers.config_changes(together), levers.apply(settings, together)))
    return found


def longer_settings(settings: PlanSettings, shape: ModelShape, device: DeviceMemory, split_exact: bool,
                    lora_shape: ModelShape | None = None, high: int = MAX_COMPLETION_SEARCH) -> list[Longest]:
    """The settings of decision 2 whose longest fitting completion is longer than the given settings' and than that
    of every listed setting with a subset of its changes, longest last; with `lora_shape` (the model with a default
    adapter, for a run without one) LoRA alone and with every other lever."""
    levers = _levers(settings, split_exact)
    tried = [dataclasses.replace(longest_completion(candidate, shape, device, high), changes=changes)
             for changes, candidate in levers]
    if lora_shape is not None and not shape.adapter_parameters:
        for changes, candidate in [({}, settings), *levers[-1:]]:
            longest = longest_completion(candidate, lora_shape, device, high)
            tried.append(dataclasses.replace(longest, changes={"use_peft": True, **changes}, same_objective=False))
    kept = [Longest(longest_completion(settings, shape, device, high).completion_length, None)]
    for candidate in tried:  # fewer changes first
        subsets = [k for k in kept if k.changes.items() <= candidate.changes.items()]
        if candidate.completion_length > max(k.completion_length for k in subsets):
            kept.append(candidate)
    return sorted(kept[1:], key=lambda f: f.completion_length)
