"""`grpo_trainer.experimental.async_grpo`: TRL 1.16's `AsyncGRPOConfig` / `AsyncGRPOTrainer` with the import swapped.
Every TRL field exists here, each is mapped or refused by name, and a TRL-style script trains (on CPU, in process)."""

import dataclasses

import pytest
import torch

from grpo_trainer.cli.toy import copy_digits_reward, make_tiny_model
from grpo_trainer.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from grpo_trainer.experimental.async_grpo.config import REFUSED_UNLESS_DEFAULT
from grpo_trainer.trainer.producer import AsyncRounds


def test_every_field_of_trls_async_config_exists_here(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    ours = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    theirs = {f.name for f in dataclasses.fields(TRLAsyncGRPOConfig)}
    assert theirs - ours == set()


def test_fields_are_mapped_onto_the_trainer(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", max_staleness=2, heartbeat_stale_after_s=7.5,
                             dtype="bfloat16")
    assert (config.async_rollouts, config.async_rollout_timeout) == (2, 7.5)
    assert config.model_init_kwargs == {"dtype": "bfloat16"}
    assert (config.use_vllm, config.vllm_mode, config.vllm_server_base_url) == (True, "server",
                                                                                 "http://localhost:8000")
    assert (config.learning_rate, config.logging_steps, config.num_generations) == (1e-6, 1, 8)
    assert not config.ignore_data_skip  # exact resume here (TRL forces True)
    kept = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", model_init_kwargs={"dtype": "float16"})
    assert kept.model_init_kwargs == {"dtype": "float16"}


@pytest.mark.parametrize("name", sorted(REFUSED_UNLESS_DEFAULT))
def test_a_field_whose_behaviour_is_not_here_is_refused_by_name(tmp_path, name):
    default = REFUSED_UNLESS_DEFAULT[name][0]
    other = 4096 if default is None else default + 1
    with pytest.raises(ValueError, match=rf"AsyncGRPOConfig\({name}={other!r}\) is not supported: .* Leave {name}"):
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", **{name: other})


def test_a_trl_async_script_trains_with_the_import_swapped(tmp_path, tokenizer, toy_dataset):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_vllm=False,
                             max_staleness=1, per_device_train_batch_size=4, num_generations=2,
                             max_completion_length=6, max_steps=2, learning_rate=0.05, disable_tqdm=True)
    model = make_tiny_model(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = AsyncGRPOTrainer(model, reward_funcs=copy_digits_reward, args=config, train_dataset=toy_dataset,
                               processing_class=tokenizer)
    trainer.train()
    assert isinstance(trainer.source, AsyncRounds) and trainer.state.global_step == 2
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    staleness = [row["async/staleness"] for row in trainer.state.log_history if "async/staleness" in row]
    assert staleness == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"AsyncGRPOTrainer\(rollout_worker=...\) is not supported"):
        AsyncGRPOTrainer(model, reward_funcs=copy_digits_reward, args=config, train_dataset=toy_dataset,
                         processing_class=tokenizer, rollout_worker=object())
