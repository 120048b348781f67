"""Settings that fit: same global batch, same rounds, cheapest first; micro-batch splits only where the loss sums
micro-batches exactly."""

import dataclasses

from grpo_trainer.algorithms.losses import AGGREGATIONS, LOSS_TYPES
from grpo_trainer.planning import SPLIT_EXACT, DeviceMemory, fitting, plan_memory, split_is_exact
from tests.planning.shapes import SETTINGS, SHAPE


def test_every_aggregation_is_classified():
    assert set(SPLIT_EXACT) == set(AGGREGATIONS)
    assert split_is_exact("dapo", 1.0) and split_is_exact("grpo", 1.0) and split_is_exact("dr_grpo", 1.0)
    assert not split_is_exact("bnpo", 1.0)  # a token mean per micro-batch
    assert not split_is_exact("dapo", 0.2)  # an entropy quantile per micro-batch
    assert all(split_is_exact(name, 1.0) == SPLIT_EXACT[agg] for name, (_, agg) in LOSS_TYPES.items())


def _budget_between(smaller, larger):
    return DeviceMemory("cpu", (smaller.device_bytes + larger.device_bytes) // 2, "test")


def test_a_smaller_micro_batch_keeps_the_global_batch_and_the_round():
    settings = dataclasses.replace(SETTINGS, micro_batch=8, checkpointing=True, accumulation_steps=2,
                                   steps_per_generation=2, completion_length=200)
    full = plan_memory(settings, SHAPE)
    half = plan_memory(dataclasses.replace(settings, micro_batch=4, accumulation_steps=4, steps_per_generation=4),
                       SHAPE)
    assert half.device_bytes < full.device_bytes
    fits = fitting(settings, SHAPE, _budget_between(half, full), split_exact=True)
    first = fits[0]
    assert first.changes == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                             "steps_per_generation": 4}
    # 8 rows x 2 accumulation steps = 4 x 4 completions per optimizer step; 8 x 2 = 4 x 4 rows per round
    assert first.plan.settings.micro_batch * first.plan.settings.accumulation_steps == 16
    assert first.plan.settings.round_rows == settings.round_rows == 16
    assert all(f.plan.device_bytes <= _budget_between(half, full).total_bytes for f in fits)


def test_checkpointing_comes_before_a_split_and_bnpo_never_splits():
    settings = dataclasses.replace(SETTINGS, micro_batch=8, checkpointing=False, completion_length=200)
    no_ckpt = plan_memory(settings, SHAPE)
    ckpt = plan_memory(dataclasses.replace(settings, checkpointing=True), SHAPE)
    budget = _budget_between(ckpt, no_ckpt)
    fits = fitting(settings, SHAPE, budget, split_exact=True)
    assert fits[0].changes == {"gradient_checkpointing": True}  # 1.33 x the compute, less than 2 micro-steps
    assert all("per_device_train_batch_size" not in f.changes
               for f in fitting(settings, SHAPE, budget, split_exact=False))


def test_nothing_fits_a_device_smaller_than_the_weights():
    assert fitting(SETTINGS, SHAPE, DeviceMemory("cpu", 1000, "test"), split_exact=True) == []


def test_lora_is_listed_never_as_the_same_objective():
    adapter = dataclasses.replace(SHAPE, adapter_parameters=2_000)
    full = plan_memory(SETTINGS, SHAPE)
    lora = plan_memory(SETTINGS, adapter)
    fits = fitting(SETTINGS, SHAPE, _budget_between(lora, full), split_exact=True, lora_shape=adapter)
    assert [f.same_objective for f in fits][-1] is False and fits[-1].changes["use_peft"] is True
