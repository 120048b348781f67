"""Choice fields are `Literal` types (`config.choices`): the annotation, the check and the command line's choices
come from one place, so they cannot disagree."""

import typing

import pytest

from grpo_trainer import GRPOConfig
from grpo_trainer.cli.command import UsageError, parse_args
from grpo_trainer.config import choices as kinds

CHOICE_FIELDS = {
    "loss_type": kinds.LossType, "importance_sampling_level": kinds.ImportanceSamplingLevel,
    "multi_objective_aggregation": kinds.MultiObjectiveAggregation, "reward_error_policy": kinds.RewardErrorPolicy,
    "zero_variance_groups": kinds.ZeroVarianceGroups, "memory_check": kinds.MemoryCheck,
    "async_correction": kinds.AsyncCorrection, "vllm_mode": kinds.VLLMMode, "vllm_model_impl": kinds.VLLMModelImpl,
    "vllm_importance_sampling_mode": kinds.VLLMImportanceSamplingMode,
}


def test_each_choice_field_is_annotated_with_its_literal():
    hints = typing.get_type_hints(GRPOConfig)
    assert {name: hints[name] for name in CHOICE_FIELDS} == CHOICE_FIELDS
    # the registries' own names: a loss added to algorithms.losses is a choice at once
    from grpo_trainer.algorithms.losses import LOSS_TYPES

    assert kinds.choices(kinds.LossType) == tuple(LOSS_TYPES)


@pytest.mark.parametrize("name", sorted(CHOICE_FIELDS))
def test_every_admitted_value_builds_and_any_other_is_refused_by_name(name):
    for value in kinds.choices(CHOICE_FIELDS[name]):
        settings = {"vllm_importance_sampling_clip_min": 0.5} if value.endswith("_truncate") else {}
        assert getattr(GRPOConfig(output_dir="unused", report_to="none", **{name: value}, **settings), name) == value
    with pytest.raises(ValueError, match=name):
        GRPOConfig(output_dir="unused", report_to="none", **{name: "no-such-choice"})


def test_the_command_line_offers_the_choices():
    with pytest.raises(UsageError, match="invalid choice: 'nope'.*'colocate', 'server'"):
        parse_args(["--demo", "--vllm_mode", "nope"])
    _, config = parse_args(["--demo", "--async_correction", "recompute"])
    assert config.async_correction == "recompute"
