"""Environments: one stateful object per rollout, whose public methods are the tools of that rollout.

The contract (TRL's `environment_factory`):

1. `environment_factory` is a callable returning an environment, or a dict of them by name; with a dict each
   dataset row names its environment in an `environment` column, and only that environment's tools are offered in
   its prompt.
2. An environment defines `reset(**row)`, called with the row's columns (less `environment`) when its rollout
   starts. A string it returns is appended to the prompt's last message (with no dataset, the prompt is empty and
   the environment writes it). Its other public methods (no leading underscore) are tools.
3. An optional `get_reward()` (sync or async) makes the environment a reward source, scored once per rollout after
   the last turn, logged under the class name with weight 1, next to `reward_funcs`. One source per class: two
   names for one class share it, and a rollout of another class gets None (no reward from this source).
4. Instances are built once and reused: each environment name keeps a pool, grown only when a batch needs more
   rollouts of it than it holds. One instance is built at start-up to find its tools and check `reset`.
5. Without a dataset the environment owns the data: `max_steps` sets the run's length and a placeholder dataset of
   empty prompts drives the loop (one generation round of rows).

Every check raises before any model is loaded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo_trainer.rollout.multiturn.tools import check_tools, run_async, tool_list, toolbox

__all__ = ["EMPTY_PROMPT", "Environments", "placeholder_dataset"]

EMPTY_PROMPT = [{"role": "user", "content": ""}]
_RESERVED = ("reset", "get_reward")


def _methods(environment: Any) -> list[Callable]:
    """The tools of an environment: its public functions, bound (looked up on the class, so properties are not
    evaluated)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in _RESERVED and not name.startswith("_")]


def _reward_source(cls: type) -> Callable[..., list]:
    """A reward function scoring the rollouts whose environment is exactly `cls` by its `get_reward()`."""
    asynchronous = inspect.iscoroutinefunction(cls.get_reward)

    def environment_reward(environments: list, **kwargs: Any) -> list[float | None]:
        mine = [i for i, env in enumerate(environments) if type(env) is cls]
        if asynchronous:  # on the tools' loop, where the environment's other coroutines ran
            values = run_async([environments[i].get_reward() for i in mine])
            for value in values:
                if isinstance(value, BaseException):
                    raise value
        else:
            values = [environments[i].get_reward() for i in mine]
        rewards: list[float | None] = [None] * len(environments)
        for i, value in zip(mine, values):
            rewards[i] = value
        return rewards

    environment_reward.__name__ = cls.__name__  # the metric name: rewards/<class>/mean
    return environment_reward


class Environments:
    """The factories, each environment's tools, the instance pools and the environment-owned rewards."""

    def __init__(self, factory: Callable | dict[str, Callable], standalone_tools: list[Callable]) -> None:
        self.multiple = isinstance(factory, dict)
        self.factories: dict[str | None, Callable] = dict(factory) if self.multiple else {None: factory}
        if not self.factories:
            raise ValueError("environment_factory is an empty dict; map at least one name to a factory.")
        self.standalone = list(standalone_tools)
        self.tools: dict[str | None, list[Callable]] = {}  # offered in the prompt: standalone, then the methods
        self.method_names: dict[str | None, list[str]] = {}
        self.pools: dict[str | None, list[Any]] = {}
        self.reward_funcs: list[Callable] = []
        rewarded: list[type] = []  # one reward source per class (decision 3)
        for name, make in self.factories.items():
            if not callable(make):
                raise ValueError(f"environment_factory{'' if name is None else f'[{name!r}]'} is not callable; pass "
                                 "a class or a function that returns an environment.")
            probe = make()
            label = type(probe).__name__
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment {label} has no reset method; an environment must define "
                                 "`reset(self, **kwargs)` (returning None or text for the prompt).")
            methods = _methods(probe)
            check_tools(standalone_tools + methods, owner=f"environment {label}")
            self.tools[name] = standalone_tools + methods
            self.method_names[name] = [method.__name__ for method in methods]
            self.pools[name] = [probe]
            if callable(getattr(probe, "get_reward", None)) and type(probe) not in rewarded:
                rewarded.append(type(probe))
                self.reward_funcs.append(_reward_source(type(probe)))

    @classmethod
    def of(cls, factory: Callable | dict[str, Callable] | None, tools: list[Callable] | None) -> Environments | None:
        """The environments of `GRPOTrainer(environment_factory=, tools=)`; None without a factory."""
        return None if factory is None else cls(factory, tool_list(tools))

    @property
    def all_tools(self) -> list[Callable]:
        """Every tool of every environment, each once (standalone tools first)."""
        seen: list[Callable] = []
        for tools in self.tools.values():
            seen += [tool for tool in tools if tool not in seen]
        return seen

    def names(self, rows: list[dict]) -> list[str | None]:
        """Each row's environment name; ValueError for a name no factory has."""
        if not self.multiple:
            return [None] * len(rows)
        names = [row.get("environment") for row in rows]
        for name in dict.fromkeys(names):
            if name not in self.factories:
                raise ValueError(f"a dataset row has environment={name!r}, which is not among the environments "
                                 f"passed to environment_factory: {sorted(self.factories)}.")
        return names

    def instances(self, names: list[str | None]) -> list[Any]:
        """One instance per rollout, from the pools, grown as needed (decision 4)."""
        taken: dict[str | None, int] = {}
        out = []
        for name in names:
            pool, index = self.pools[name], taken.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            taken[name] = index + 1
            out.append(pool[index])
        return out

    def toolboxes(self, environments: list[Any], names: list[str | None]) -> list[dict[str, Callable]]:
        """Each rollout's tools by name: the standalone tools and its own instance's methods."""
        return [toolbox(self.standalone + [getattr(env, method) for method in self.method_names[name]])
                for env, name in zip(environments, names)]

    def reset(self, environments: list[Any], rows: list[dict], prompts: list[list[dict]]) -> list[list[dict]]:
        """Reset each rollout's environment with its row; the prompts with any text `reset` returned appended to
        the last message (new lists: the dataset's rows are left as they are)."""
        out = []
        for environment, row, prompt in zip(environments, rows, prompts):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multiple else row
            observation = environment.reset(**kwargs)
            if observation is not None:
                last = prompt[-1]
                prompt = prompt[:-1] + [{**last, "content": last["content"] + str(observation)}]
            out.append(prompt)
        return out


def placeholder_dataset(environments: Environments | None, max_steps: int, prompts_per_round: int) -> Any:
    """The dataset for a run whose environment owns the data (decision 5), after TRL's checks: one empty prompt
    per prompt of a round (`generation_batch_size // num_generations`)."""
    from datasets import Dataset

    if environments is None:
        raise ValueError("`train_dataset` is required unless an `environment_factory` is provided (an environment "
                         "can own the data: its reset() writes each prompt).")
    if environments.multiple:
        raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                         "`environment` column naming each row's environment; pass a dataset, or a single factory.")
    if max_steps <= 0:
        raise ValueError("Without a `train_dataset` the environment owns the data, so set `max_steps` > 0 to fix the "
                         "run's length, e.g. GRPOConfig(max_steps=1000).")
    return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * prompts_per_round})
