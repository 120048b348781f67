"""environment_factory: tools per environment, pooled instances, reset with the row, environment-owned rewards, and
TRL's set-up errors."""

import asyncio

import pytest

from grpo_trainer.rollout.multiturn.environments import EMPTY_PROMPT, Environments, placeholder_dataset
from tests.tool_helpers import multiply


class Counter:
    built = 0

    def __init__(self):
        Counter.built += 1
        self.count, self.seen = 0, None

    def reset(self, **row):
        self.count, self.seen = 0, row
        return " Count."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _helper(self):
        return None

    @property
    def expensive(self):  # must not be evaluated when the tools are looked up
        raise AssertionError("a property was evaluated")


class Echo:
    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Shout.

        Args:
            text: What to shout.
        """
        return text.upper()


class AsyncScored(Echo):
    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return 0.5


def test_public_methods_are_the_tools_reserved_and_private_ones_are_not():
    environments = Environments(Counter, [multiply])
    assert [t.__name__ for t in environments.tools[None]] == ["multiply", "increment"]
    assert len(environments.pools[None]) == 1  # the probe instance seeds the pool


def test_an_environment_without_reset_is_refused():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A value.
            """
            return x

    with pytest.raises(ValueError, match="environment NoReset has no reset method"):
        Environments(NoReset, [])


def test_an_environment_method_without_a_docstring_is_refused_naming_the_environment():
    class Sloppy:
        def reset(self, **row):
            return None

        def act(self, x):
            return x

    with pytest.raises(ValueError, match="environment Sloppy: tool 'act' cannot be described"):
        Environments(Sloppy, [])


def test_instances_are_pooled_and_grown_only_when_a_batch_needs_more():
    Counter.built = 0
    environments = Environments({"counter": Counter, "echo": Echo}, [])
    first = environments.instances(["counter", "counter", "echo"])
    assert Counter.built == 2 and len(environments.pools["counter"]) == 2
    second = environments.instances(["counter", "echo", "counter"])
    assert Counter.built == 2  # reused, not rebuilt
    assert second[0] is first[0] and second[2] is first[1] and second[1] is first[2]


def test_rows_name_their_environment_and_an_unknown_name_is_an_error():
    environments = Environments({"counter": Counter, "echo": Echo}, [])
    assert environments.names([{"environment": "echo"}, {"environment": "counter"}]) == ["echo", "counter"]
    with pytest.raises(ValueError, match="environment='unknown', which is not among the environments"):
        environments.names([{"environment": "unknown"}])


def test_reset_gets_the_row_less_environment_and_appends_its_text_to_the_prompt():
    environments = Environments({"counter": Counter, "echo": Echo}, [])
    rows = [{"environment": "counter", "prompt": [{"role": "user", "content": "Go."}], "target": 3},
            {"environment": "echo", "prompt": [{"role": "user", "content": "Hi."}]}]
    instances = environments.instances(environments.names(rows))
    prompts = environments.reset(instances, rows, [row["prompt"] for row in rows])
    assert instances[0].seen == {"prompt": [{"role": "user", "content": "Go."}], "target": 3}
    assert prompts == [[{"role": "user", "content": "Go. Count."}], [{"role": "user", "content": "Hi."}]]
    assert rows[0]["prompt"] == [{"role": "user", "content": "Go."}]  # the dataset's row is left as it was


def test_a_single_environment_gets_the_whole_row():
    environments = Environments(Counter, [])
    (instance,) = environments.instances([None])
    environments.reset([instance], [{"prompt": EMPTY_PROMPT, "environment": "x"}], [EMPTY_PROMPT])
    assert instance.seen == {"prompt": EMPTY_PROMPT, "environment": "x"}


def test_toolboxes_bind_each_rollouts_own_instance():
    environments = Environments(Counter, [multiply])
    instances = environments.instances([None, None])
    boxes = environments.toolboxes(instances, [None, None])
    boxes[1]["increment"](step=5)
    assert (instances[0].count, instances[1].count) == (0, 5)
    assert boxes[0]["multiply"] is multiply


def test_owned_rewards_one_per_class_scored_only_on_their_own_rollouts():
    environments = Environments({"a": Counter, "b": Counter, "echo": Echo, "scored": AsyncScored}, [])
    assert [f.__name__ for f in environments.reward_funcs] == ["Counter", "AsyncScored"]
    counter, echo, scored = Counter(), Echo(), AsyncScored()
    counter.count = 3
    by_counter, by_async = environments.reward_funcs
    assert by_counter(environments=[counter, echo, scored]) == [3.0, None, None]
    assert by_async(environments=[counter, echo, scored]) == [None, None, 0.5]


def test_without_a_dataset_the_environment_owns_the_data_under_trls_rules():
    dataset = placeholder_dataset(Environments(Counter, []), max_steps=5, prompts_per_round=4)
    assert dataset["prompt"] == [EMPTY_PROMPT] * 4  # one generation round of prompts
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory`"):
        placeholder_dataset(None, 5, 4)
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):
        placeholder_dataset(Environments({"a": Counter, "b": Echo}, []), 5, 4)
    with pytest.raises(ValueError, match="set `max_steps` > 0"):
        placeholder_dataset(Environments(Counter, []), max_steps=-1, prompts_per_round=4)
