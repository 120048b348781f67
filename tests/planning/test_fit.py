"""Settings that fit: same global batch, same rounds, cheapest first; micro-batch splits only where the loss sums
micro-batches exactly."""

import dataclasses

from grpo_trainer.algorithms.losses import AGGREGATIONS, LOSS_TYPES
from grpo_trainer.planning import SPLIT_EXACT, DeviceMemory, fitting, levers, plan_memory, split_is_exact
from tests.planning.gpu_evidence import ran_on_gpu_now
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
    # checkpointing and the tiling already on: a split is what is left
    settings = dataclasses.replace(SETTINGS, micro_batch=8, checkpointing=True, accumulation_steps=2,
                                   steps_per_generation=2, completion_length=2000).with_forward(mlp_tile_tokens=64)
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


def test_the_tiled_mlp_is_proposed_where_only_it_fits():
    """One row per micro-batch (no split left), checkpointing and the recomputed attention on, 4,000 completion
    tokens: the tiled MLP keeps one tile of the recomputed layer's MLP, and only it fits between the two plans; it
    trains the same objective."""
    settings = dataclasses.replace(SETTINGS, micro_batch=1, completion_length=4_000) \
        .with_forward(recompute_attention=True)
    plain = plan_memory(settings, SHAPE)
    tiled = plan_memory(settings.with_forward(mlp_tile_tokens=1024), SHAPE)
    assert tiled.device_bytes < plain.device_bytes
    fits = fitting(settings, SHAPE, _budget_between(tiled, plain), split_exact=True)
    assert [f.changes for f in fits] == [{"mlp_tile_tokens": 1024}] and fits[0].same_objective


def test_the_recomputed_attention_is_proposed_where_it_fits_and_never_with_sequence_parallelism():
    """The tiled run of the test above, between its plan and the plan with the recomputed attention: that is the
    first fit (it trains the same objective); under sequence parallelism, where it is refused, no fit has it."""
    settings = dataclasses.replace(SETTINGS, micro_batch=1, completion_length=4_000).with_forward(mlp_tile_tokens=1024)
    plain = plan_memory(settings, SHAPE)
    recomputed = plan_memory(settings.with_forward(recompute_attention=True), SHAPE)
    assert recomputed.device_bytes < plain.device_bytes
    fits = fitting(settings, SHAPE, _budget_between(recomputed, plain), split_exact=True)
    assert fits[0].changes == {"recompute_attention": True} and fits[0].same_objective
    sharded = dataclasses.replace(settings, sequence_parallel=2)
    assert all("recompute_attention" not in f.changes
               for f in fitting(sharded, SHAPE, DeviceMemory("cpu", 1 << 40, "test"), split_exact=True, limit=100))


def test_on_a_gpu_activation_offloading_is_proposed_once_it_ran_there_and_never_on_cpu(monkeypatch):
    """The same run on a GPU, between the tiled plan and the tiled and offloaded one. While offloading has not run on
    a GPU at its current code (`planning.levers`, decision 1) no fit offloads; with evidence that it did, the first
    fit offloads (the saved layer inputs leave the device). On CPU no fit offloads."""
    settings = dataclasses.replace(SETTINGS, device="cuda", micro_batch=1, completion_length=4_000) \
        .with_forward(mlp_tile_tokens=1024, recompute_attention=True)
    shape = dataclasses.replace(SHAPE, layers=16)  # many layers: their inputs are the largest term
    tiled = plan_memory(settings, shape)
    offloaded = plan_memory(settings.with_forward(activation_offloading=True), shape)
    assert offloaded.device_bytes < tiled.device_bytes
    budget = DeviceMemory("cuda", (offloaded.device_bytes + tiled.device_bytes) // 2, "test")
    assert all("activation_offloading" not in f.changes for f in fitting(settings, shape, budget, split_exact=True,
                                                                       limit=100))
    offloading = levers.OPTIONS["activation_offloading"]
    monkeypatch.setitem(levers.OPTIONS, "activation_offloading", ran_on_gpu_now(offloading))
    assert fitting(settings, shape, budget, split_exact=True)[0].changes == {"activation_offloading": True}
    on_cpu = dataclasses.replace(settings, device="cpu")
    assert all("activation_offloading" not in f.changes
               for f in fitting(on_cpu, shape, DeviceMemory("cpu", 1 << 40, "test"), split_exact=True, limit=100))
