"""What a training run reports, on real tiny runs: TRL's metric names and values, the reward functions' `log_extra`
and `log_metric`, and the completions files of `log_completions`."""

import math

import pandas as pd
import pytest

from grpo_trainer import GRPOConfig, GRPOTrainer


def make_args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=6, learning_rate=0.1, max_steps=2, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0, reward_weights=[1.0, 2.0])
    settings.update(overrides)
    return GRPOConfig(**settings)


class Rewards:
    """Two reward functions with fixed scores per row of a round of 4 (2 prompts x G=2), None included, that also
    count the tokens they were given and log through `log_extra` / `log_metric`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.round_tokens = tokenizer, []

    def f1(self, prompts, completions, completion_ids, log_extra, log_metric, **kwargs):
        prompt_tokens = sum(len(self.tokenizer(p)["input_ids"]) for p in prompts)
        self.round_tokens.append(prompt_tokens + sum(len(ids) for ids in completion_ids))
        log_extra("first_char", [c[:1] for c in completions])
        log_metric("custom/accuracy", 0.25)
        log_metric("custom/accuracy", 0.75)
        return [1.0, None, 1.0, None]

    def f2(self, completions, **kwargs):
        return [None, None, 0.5, None]


def run(tmp_path, tiny_model, tokenizer, toy_dataset, **overrides):
    rewards = Rewards(tokenizer)
    trainer = GRPOTrainer(tiny_model, [rewards.f1, rewards.f2], args=make_args(tmp_path, **overrides),
                          train_dataset=toy_dataset, processing_class=tokenizer)
    trainer.train()
    return trainer, rewards, [h for h in trainer.state.log_history if "reward" in h]


def test_metrics_have_trls_names_and_values(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, rewards, logs = run(tmp_path, tiny_model, tokenizer, toy_dataset)
    assert len(logs) == 2
    for log in logs:
        # rows: 1 + 2*None = 1, all None (left out), 1 + 2*0.5 = 2, all None -> reward mean(1, 2) = 1.5,
        # reward_std = sample std of (1, 2) = sqrt(0.5); each group has one scored row: no zero std
        assert log["reward"] == 1.5 and log["reward_std"] == pytest.approx(math.sqrt(0.5), abs=1e-6)
        assert log["frac_reward_zero_std"] == 0.0
        assert log["rewards/f1/mean"] == 1.0 and log["rewards/f1/std"] == 0.0
        assert log["rewards/f2/mean"] == 0.5 and log["rewards/f2/std"] is None  # one value: no std, as TRL logs it
        assert log["custom/accuracy"] == 0.5  # (0.25 + 0.75) / 2
        assert log["step_time"] > 0.0
        lengths = [log[f"completions/{s}_length"] for s in ("min", "mean", "max")]
        assert 1 <= lengths[0] <= lengths[1] <= lengths[2] <= 6
        for key in ("clipped_ratio", "mean_terminated_length", "min_terminated_length", "max_terminated_length"):
            assert f"completions/{key}" in log
    # num_tokens is the running total of prompt + completion tokens, not a window mean of it
    assert [log["num_tokens"] for log in logs] == [rewards.round_tokens[0], sum(rewards.round_tokens)]
    assert trainer.state.num_input_tokens_seen == sum(rewards.round_tokens)


def test_window_means_skip_nan_over_several_rounds(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, rewards, logs = run(tmp_path, tiny_model, tokenizer, toy_dataset, logging_steps=2)
    (log,) = logs  # one log over two rounds: each round's value is the same, NaN ones are skipped
    assert log["reward"] == 1.5 and log["rewards/f2/std"] is None and log["custom/accuracy"] == 0.5
    assert log["num_tokens"] == sum(rewards.round_tokens)  # the last value, not the mean over the window


def test_log_completions_writes_trls_parquet_files_with_log_extra_columns(tmp_path, tiny_model, tokenizer,
                                                                          toy_dataset, capsys):
    trainer, _, _ = run(tmp_path, tiny_model, tokenizer, toy_dataset, log_completions=True,
                        num_completions_to_print=2)
    for step in (1, 2):
        frame = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        assert list(frame.columns) == ["step", "prompt", "completion", "f1", "f2", "first_char", "advantage"]
        assert len(frame) == 4 and set(frame["step"]) == {step}
        assert frame["f1"].tolist()[::2] == [1.0, 1.0] and frame["f2"].isna().tolist() == [True, True, False, True]
        assert frame["first_char"].tolist() == [c[:1] for c in frame["completion"]]
        assert (tmp_path / "completions" / f"completions_{step:05d}.jsonl").exists()
    assert "first_char" in trainer._logs["extra"]  # TRL's test reads this
    assert "Step 2" in capsys.readouterr().out


def test_without_log_completions_log_extra_costs_nothing_and_leaves_no_files(tmp_path, tiny_model, tokenizer,
                                                                             toy_dataset):
    trainer, _, _ = run(tmp_path, tiny_model, tokenizer, toy_dataset)
    assert not (tmp_path / "completions").exists() and trainer._logs["extra"] == {}


def test_a_log_extra_column_of_the_wrong_length_is_refused(tmp_path, tiny_model, tokenizer, toy_dataset):
    def short_column(completions, log_extra, **kwargs):
        log_extra("half", completions[:2])
        return [1.0] * len(completions)

    trainer = GRPOTrainer(tiny_model, short_column, args=make_args(tmp_path, log_completions=True, reward_weights=None),
                          train_dataset=toy_dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"log_extra\('half', \.\.\.\) received 2 values in this round for 4"):
        trainer.train()
