"""What TRL 1.16 users and TRL's own tests rely on around the datasets and rewards a trainer gets: every eval
container TRL accepts (at construction and in `evaluate`), streamed datasets' loader settings, the warning for a
completion no reward function scored, reward processing classes, and the Liger kernel option."""

import logging
import warnings

import pytest
from datasets import Dataset, DatasetDict, IterableDatasetDict

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward
from tests.helpers import make_args, make_trainer

LOGGER = "grpo_trainer.trainer.grpo_trainer"
# Construction and evaluation, one training step at most: short completions, eval batches of 2 prompts x G=2.
SETTINGS = dict(per_device_eval_batch_size=4, max_completion_length=4, max_steps=1)


def eval_container(kind: str):
    """Each eval_dataset container TRL accepts: a (streamed) dataset, a (streamed) dataset dict, a plain dict."""
    streaming = "iterable" in kind
    split = copy_digits_dataset(num_prompts=2, seed=1)
    split = split.to_iterable_dataset() if streaming else split
    if kind in ("dataset", "iterable_dataset"):
        return split
    if kind in ("dataset_dict", "iterable_dataset_dict"):
        return (IterableDatasetDict if streaming else DatasetDict)({"data1": split, "data2": split})
    return {"data1": split, "data2": split}


KINDS = ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
         "dict_of_iterable_dataset"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_eval_container_is_accepted_at_construction(tmp_path, tokenizer, kind):
    eval_dataset = eval_container(kind)
    trainer = make_trainer(tmp_path, tokenizer, eval_dataset=eval_dataset, **SETTINGS)
    if isinstance(eval_dataset, dict):
        assert set(trainer.eval_dataset) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset
    assert trainer.args.accelerator_config.dispatch_batches is (False if "iterable" in kind else None)


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_takes_every_container_and_names_the_losses(tmp_path, tokenizer, kind):
    """`evaluate(eval_dataset=...)` with a set first seen there (a stream included): one `eval_loss`, or one
    `eval_<name>_loss` per named set, with our metrics alongside."""
    trainer = make_trainer(tmp_path, tokenizer, **SETTINGS)
    metrics = trainer.evaluate(eval_dataset=eval_container(kind))
    names = ["eval"] if kind in ("dataset", "iterable_dataset") else ["eval_data1", "eval_data2"]
    for name in names:
        assert isinstance(metrics[f"{name}_loss"], float)
    assert "eval_reward" in metrics


def test_streamed_datasets_refuse_dispatch_batches(tmp_path, tokenizer):
    args = make_args(tmp_path, **{**SETTINGS, "max_steps": -1}, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        make_trainer(tmp_path, tokenizer, copy_digits_dataset(num_prompts=8).to_iterable_dataset(), args=args)


def test_a_streamed_train_set_is_read_by_one_worker(tmp_path, tokenizer, caplog):
    args = make_args(tmp_path, **SETTINGS, dataloader_num_workers=4)
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_path, tokenizer, copy_digits_dataset(num_prompts=8).to_iterable_dataset(), args=args)
    assert trainer.args.dataloader_num_workers == 0
    assert "Iterable datasets require `dataloader_num_workers=0`" in caplog.text


def test_a_streamed_eval_set_keeps_a_map_style_train_sets_workers(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, eval_dataset=eval_container("iterable_dataset"), **SETTINGS,
                           dataloader_num_workers=2)
    assert trainer.args.dataloader_num_workers == 2
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0  # only the stream's loader, only while it is built
    assert trainer.args.dataloader_num_workers == 2


def test_a_completion_no_reward_scored_is_logged_with_its_inputs(tmp_path, tokenizer, caplog):
    """TRL's wording, through the trainer module's logger (TRL's test reads it with caplog), naming the sample."""
    def abstains(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=abstains, **SETTINGS)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert records and "All reward functions returned None for the following kwargs:" in records[0].getMessage()
    assert "'answer': " in records[0].getMessage() and "'prompt': 'copy " in records[0].getMessage()


def test_reward_processing_classes_pair_with_reward_funcs(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=[copy_digits_reward], reward_processing_classes=tokenizer,
                           **SETTINGS)
    assert trainer.reward_processing_classes == [tokenizer]  # one tokenizer for one reward, as TRL allows
    with pytest.raises(ValueError, match=r"The number of reward processing classes \(1\) must match"):
        make_trainer(tmp_path, tokenizer, reward_funcs=[copy_digits_reward] * 2, reward_processing_classes=tokenizer,
                     **SETTINGS)


def test_use_liger_kernel_is_deprecated_and_keeps_the_models_forward(tmp_path, tokenizer):
    with pytest.warns(FutureWarning, match="use_liger_kernel=True is deprecated"):
        trainer = make_trainer(tmp_path, tokenizer, **SETTINGS, use_liger_kernel=True)
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    args = make_args(tmp_path, **SETTINGS, use_liger_kernel=True,
                     liger_kernel_config={"fused_linear_cross_entropy": True})
    with warnings.catch_warnings(), pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        warnings.simplefilter("ignore", FutureWarning)
        make_trainer(tmp_path, tokenizer, args=args)


def test_no_reward_source_is_an_error_before_any_model_loads(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer("an-org/never-downloaded", args=make_args(tmp_path, **SETTINGS),
                    train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=tokenizer)
