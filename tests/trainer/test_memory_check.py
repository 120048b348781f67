"""The trainer's memory check: an over-budget run stops before any weight is read, with the itemised estimate and
settings that fit; `auto_find_batch_size=True` applies the first of them and trains the same objective.

The device is simulated with `GRPO_TRAINER_DEVICE_MEMORY`: a budget between the plans of two settings."""

import dataclasses
import logging

import pytest
import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.algorithms.losses import LOSS_TYPES
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model
from grpo_trainer.planning import DEVICE_MEMORY_ENV, SPLIT_EXACT, plan_memory
from grpo_trainer.trainer import memory


def make_args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=12, learning_rate=1e-2, max_steps=1, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0, gradient_checkpointing=True, loss_type="dapo", disable_dropout=True)
    return GRPOConfig(**{**settings, **overrides})


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def budget_between_splits(model_dir, args, tokenizer, dataset) -> int:
    """Bytes between the plan of `args` and that of half its micro-batch with twice the accumulation."""
    run = memory.plan_run(str(model_dir), args, dataset, tokenizer, with_device=False)
    s = run.settings
    half = dataclasses.replace(s, micro_batch=s.micro_batch // 2, accumulation_steps=s.accumulation_steps * 2,
                               steps_per_generation=s.steps_per_generation * 2)
    low, high = plan_memory(half, run.shape).device_bytes, run.plan.device_bytes
    assert low < high
    return (low + high) // 2


def test_an_over_budget_run_stops_before_reading_any_weight(tmp_path, tokenizer, model_dir, monkeypatch):
    dataset = copy_digits_dataset(num_prompts=16)
    args = make_args(tmp_path / "out")
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str(budget_between_splits(model_dir, args, tokenizer, dataset)))
    (model_dir / "model.safetensors").write_bytes(b"not weights")  # reading it would fail with another error
    with pytest.raises(memory.MemoryPlanError) as raised:
        GRPOTrainer(str(model_dir), copy_digits_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    message = str(raised.value)
    assert "it would run out of memory" in message
    for item in ("weights", "optimizer state", "gradients", "KV cache", "activations"):  # the itemised table
        assert item in message
    # the same 8 completions per optimizer step and 8 per round, in micro-batches of 4
    assert "the same global batch (8 completions per optimizer step)" in message
    assert "per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=2" in message


def test_a_loaded_model_is_checked_before_the_trainer_is_built(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "64MiB")  # less than the process itself
    with pytest.raises(memory.MemoryPlanError, match="No smaller micro-batch"):
        GRPOTrainer(make_tiny_model(tokenizer), copy_digits_reward, args=make_args(tmp_path),
                    train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)


def test_warn_trains_anyway_and_off_skips_the_plan(tmp_path, tokenizer, monkeypatch, caplog):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "64MiB")
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        GRPOTrainer(make_tiny_model(tokenizer), copy_digits_reward, args=make_args(tmp_path, memory_check="warn"),
                    train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
    assert "it would run out of memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="grpo_trainer.trainer.grpo_trainer"):
        GRPOTrainer(make_tiny_model(tokenizer), copy_digits_reward, args=make_args(tmp_path, memory_check="off"),
                    train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
    assert "Memory plan" not in caplog.text and "out of memory" not in caplog.text


def test_memory_check_names_its_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown memory_check 'maybe'"):
        make_args(tmp_path, memory_check="maybe")


def _trained(model_dir, tokenizer, args) -> tuple[dict, GRPOTrainer]:
    trainer = GRPOTrainer(str(model_dir), copy_digits_reward, args=args,
                          train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def test_auto_find_batch_size_trains_what_its_settings_train_by_hand(tmp_path, tokenizer, model_dir, monkeypatch,
                                                                     caplog):
    dataset = copy_digits_dataset(num_prompts=16)
    cheaper = {"mlp_tile_tokens": 1024, "recompute_attention": True}  # on already: a split is what is left
    budget = budget_between_splits(model_dir, make_args(tmp_path / "probe", **cheaper), tokenizer, dataset)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, str(budget))
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        auto, trainer = _trained(model_dir, tokenizer, make_args(tmp_path / "auto", max_steps=2,
                                                                 auto_find_batch_size=True, **cheaper))
    assert "auto_find_batch_size" in caplog.text and "per_device_train_batch_size=4" in caplog.text
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation,
            args.generation_batch_size) == (4, 2, 2, 8)
    assert args.auto_find_batch_size is False  # the Trainer's own retry-on-OOM would break rounds: off
    monkeypatch.delenv(DEVICE_MEMORY_ENV)
    by_hand, _ = _trained(model_dir, tokenizer, make_args(tmp_path / "hand", max_steps=2,
                                                           per_device_train_batch_size=4,
                                                           gradient_accumulation_steps=2, steps_per_generation=2,
                                                           **cheaper))
    assert all(torch.equal(auto[name], by_hand[name]) for name in auto)


def _trained_with_lengths(model_dir, tokenizer, args) -> dict:
    """`_trained` with completions of 2 to 12 tokens (`tests/toy_lengths.py`: the random model never samples EOS):
    with equal lengths every aggregation gives the split the same gradient, `bnpo` too, and nothing would be shown."""
    from transformers import AutoModelForCausalLM

    from tests.toy_lengths import LogNormalLengths, install_lengths

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    install_lengths(model, LogNormalLengths(maximum=12, median=5, sigma=0.8, minimum=2))
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=16),
                          processing_class=tokenizer)
    trainer.train()
    lengths = [entry["completions/min_length"] < entry["completions/max_length"] for entry in trainer.state.log_history
               if "completions/min_length" in entry]
    assert lengths and all(lengths), "the completions must differ in length"
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "luspo", "bnpo"])
def test_the_chosen_split_trains_the_objective_of_the_original_settings(tmp_path, tokenizer, model_dir, loss_type):
    """One SGD step (the update is lr x the gradient, which AdamW's normalisation would not show): the same round
    (generated whole either way), its gradient summed over 2 micro-batches of 4 instead of 1 of 8, completions of
    different lengths. Equal up to float rounding for every aggregation the planner may split (`planning.SPLIT_EXACT`:
    `dapo` divides by the window's tokens; `grpo`, `dr_grpo`, `luspo` by per-sequence or constant normalisers and the
    accumulation steps), and the step really moved the weights; `bnpo` (a token mean per micro-batch) differs, which
    is why the planner never splits it."""
    sgd = dict(optim="sgd", learning_rate=1.0, max_grad_norm=0.0, loss_type=loss_type)
    before = {n: p.detach().clone() for n, p in GRPOTrainer(
        str(model_dir), copy_digits_reward, args=make_args(tmp_path / "init"),
        train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer).model.named_parameters()}
    whole = _trained_with_lengths(model_dir, tokenizer, make_args(tmp_path / "whole", **sgd))
    split = _trained_with_lengths(model_dir, tokenizer, make_args(tmp_path / "split", per_device_train_batch_size=4,
                                                                  gradient_accumulation_steps=2, steps_per_generation=2,
                                                                  **sgd))
    moved = max((whole[n] - before[n]).abs().max().item() for n in whole)
    assert moved > 1e-3
    largest = max(((split[n] - before[n]) - (whole[n] - before[n])).abs().max().item() for n in whole)
    if SPLIT_EXACT[LOSS_TYPES[loss_type][1]]:
        for name in whole:
            torch.testing.assert_close(split[name] - before[name], whole[name] - before[name], rtol=1e-4, atol=1e-7)
    else:
        assert largest > 1e-4 * moved, f"bnpo's split update equals the whole one ({largest})"
