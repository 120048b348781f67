"""Trainer behaviour on real tiny training runs (offline, CPU, a few steps each).

The pattern (as in TRL's own tests): a high learning rate so every trainable parameter visibly moves, then check
that every parameter changed and the loss is finite — plus what each option specifically promises.
"""

import asyncio
import math
from unittest import mock

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config

from grpo_trainer import GRPOConfig, GRPOTrainer, RLOOAdvantage
from grpo_trainer.algorithms.losses import LOSS_TYPES
from grpo_trainer.cli.toy import copy_digits_reward


def make_args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=6, learning_rate=0.1, max_steps=2, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0)
    settings.update(overrides)
    return GRPOConfig(**settings)


def train(tmp_path, model, tokenizer, dataset, reward_funcs=copy_digits_reward, trainer_kwargs=None, **overrides):
    trainer = GRPOTrainer(model, reward_funcs, args=make_args(tmp_path, **overrides), train_dataset=dataset,
                          processing_class=tokenizer, **(trainer_kwargs or {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    loss = trainer.state.log_history[-1]["train_loss"]
    assert loss is not None and math.isfinite(loss)
    changed = {n: not torch.equal(p, before[n]) for n, p in model.named_parameters()}
    return trainer, changed


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def varied_reward(completions, **kwargs):
    """A reward that always separates the completions of a group, so every step has a gradient."""
    return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]


# The metrics TRL logs for each loss type, besides the common ones.
LOSS_METRICS = {"clip": {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                         "clip_ratio/low_min", "clip_ratio/high_max"},
                "cispo": {"cispo_clip_ratio"}, "sapo": set(), "vespo": {"vespo/phi_seq_mean"}}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_each_loss_type_trains_every_parameter(tmp_path, tiny_model, tokenizer, toy_dataset, loss_type):
    trainer, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, loss_type=loss_type,
                             epsilon_high=5.0 if loss_type == "cispo" else None,
                             importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    assert all(changed.values())
    logged_keys = set(trainer.state.log_history[0])
    surrogate = LOSS_TYPES[loss_type][0]
    assert LOSS_METRICS[surrogate] <= logged_keys
    assert not (set().union(*LOSS_METRICS.values()) - LOSS_METRICS[surrogate]) & logged_keys
    assert not {"policy_loss", "entropy_coef"} & logged_keys  # TRL logs these only with the entropy bonus


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "reinforce_pp_baseline"])
def test_each_advantage_estimator_trains(tmp_path, tiny_model, tokenizer, toy_dataset, estimator):
    _, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, advantage_estimator=estimator)
    assert all(changed.values())


def test_user_estimator_callable_receives_the_gathered_rewards(tmp_path, tiny_model, tokenizer, toy_dataset):
    seen = []

    def sign_of_centred(rewards, num_generations=1, scale="group", reward_weights=None, **kwargs):
        seen.append((tuple(rewards.shape), num_generations, scale))
        total = (rewards * reward_weights).sum(1).view(-1, num_generations)
        return torch.sign(total - total.mean(1, keepdim=True)).view(-1)

    _, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward,
                       trainer_kwargs={"advantage_estimator": sign_of_centred})
    # 4 completions x 1 reward function per round, G = 2, TRL's default scale.
    assert seen == [((4, 1), 2, "group")] * 2
    assert all(changed.values())


def test_advantage_instance_is_accepted(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward,
                             trainer_kwargs={"advantage_estimator": RLOOAdvantage()})
    assert isinstance(trainer.advantage_fn, RLOOAdvantage) and all(changed.values())


def test_beta_zero_has_no_reference_model_and_beta_positive_logs_kl(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, _ = train(tmp_path / "a", tiny_model, tokenizer, toy_dataset, varied_reward, beta=0.0)
    assert trainer.ref_model is None and not logged(trainer, "kl")
    trainer, changed = train(tmp_path / "b", tiny_model, tokenizer, toy_dataset, varied_reward, beta=0.5)
    kl = logged(trainer, "kl")
    assert trainer.ref_model is not None and all(changed.values())
    # Step 1: policy == reference, so k3 KL is exactly 0; step 2 follows an lr-0.1 update, so it is > 0.
    assert kl[0] == 0.0 and kl[1] > 0.0


def test_num_iterations_reuses_the_rollout_with_old_logps(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer = GRPOTrainer(tiny_model, varied_reward, args=make_args(tmp_path, num_iterations=2, max_steps=4),
                          train_dataset=toy_dataset, processing_class=tokenizer)
    with mock.patch.object(trainer, "_generate_and_score", wraps=trainer._generate_and_score) as generate:
        trainer.train()
    assert generate.call_count == 2  # 4 optimizer steps, each round serves 2 iterations
    assert trainer.buffer.parts[0].old_logps is not None  # the 2nd pass follows an optimizer step
    clip = logged(trainer, "clip_ratio/region_mean")
    assert clip[0] == 0.0 and clip[1] > 0.0  # ratio == 1 on the fresh pass; lr 0.1 moves it outside the band


def test_on_policy_rounds_compute_no_old_logps(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, _ = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, gradient_accumulation_steps=2)
    assert trainer.args.steps_per_generation == 2
    assert trainer.buffer.parts[0].old_logps is None and trainer.buffer.parts[0].ref_logps is None


def test_generation_round_serves_steps_per_generation_micro_batches(tmp_path, tiny_model, tokenizer, toy_dataset):
    args = make_args(tmp_path, steps_per_generation=2, max_steps=4)
    trainer = GRPOTrainer(tiny_model, varied_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer)
    with mock.patch.object(trainer, "_generate_and_score", wraps=trainer._generate_and_score) as generate:
        trainer.train()
    assert generate.call_count == 2
    batch = generate.call_args_list[0].args[0]
    assert len(batch) == 8  # 2 micro-batches of 4 completions
    prompts = [row["prompt"] for row in batch]
    assert all(prompts[i] == prompts[i + 1] for i in range(0, 8, 2))  # each prompt's G=2 copies are adjacent
    assert trainer.buffer.parts[0].old_logps is not None  # the second slice is used after an optimizer step


def test_conversational_prompts_use_the_chat_template(tmp_path, tiny_model, tokenizer, toy_conversational_dataset):
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen["prompt"], seen["completion"] = prompts[0], completions[0]
        return varied_reward(completions=[c[0]["content"] for c in completions])

    _, changed = train(tmp_path, tiny_model, tokenizer, toy_conversational_dataset, reward)
    assert seen["prompt"][0]["role"] == "user"
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    assert all(changed.values())


def test_iterable_dataset(tmp_path, tiny_model, tokenizer, toy_dataset):
    _, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset.to_iterable_dataset(), varied_reward)
    assert all(changed.values())


def test_reward_model_mixed_with_a_callable_and_weights(tmp_path, tiny_model, tokenizer, toy_dataset):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    reward_model = AutoModelForSequenceClassification.from_config(config)
    reward_model.config._name_or_path = "tiny/reward-model"
    trainer, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, [reward_model, copy_digits_reward],
                             trainer_kwargs={"reward_processing_classes": [tokenizer, None]},
                             reward_weights=[1.0, 2.0])
    assert all(changed.values())
    assert trainer.reward_names == ["reward-model", "copy_digits_reward"]
    first = trainer.state.log_history[0]
    # reward = 1 x reward-model mean + 2 x copy-digits mean (the same rows feed both)
    expected = first["rewards/reward-model/mean"] + 2.0 * first["rewards/copy_digits_reward/mean"]
    assert first["reward"] == pytest.approx(expected, abs=1e-5)


def test_async_reward_and_none_rewards(tmp_path, tiny_model, tokenizer, toy_dataset):
    async def async_length(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    def only_first_half(completions, **kwargs):  # "not applicable" for half of the batch
        return [1.0 if i < len(completions) // 2 else None for i in range(len(completions))]

    trainer, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, [async_length, only_first_half])
    assert all(changed.values())
    first = trainer.state.log_history[0]
    assert first["rewards/only_first_half/mean"] == 1.0  # None is left out of the mean, not counted as 0
    assert "rewards/async_length/mean" in first


def test_mask_truncated_completions_removes_them_from_the_loss(tmp_path, tiny_model, tokenizer, toy_dataset):
    # One-token completions from a random model almost never end with EOS: every one is truncated, so with the
    # mask on there is nothing to learn from and no parameter may move (AdamW weight decay is 0 by default).
    never_eos = {"suppress_tokens": [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]}
    _, changed = train(tmp_path / "on", tiny_model, tokenizer, toy_dataset, varied_reward, max_completion_length=1,
                       mask_truncated_completions=True, generation_kwargs=never_eos)
    assert not any(changed.values())
    _, changed = train(tmp_path / "off", tiny_model, tokenizer, toy_dataset, varied_reward, max_completion_length=1,
                       mask_truncated_completions=False, generation_kwargs=never_eos)
    assert any(changed.values())


def test_evaluate_reports_rewards_and_pass_at_k(tmp_path, tiny_model, tokenizer, toy_dataset):
    def contains_digit(completions, **kwargs):  # binary: pass@k applies
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    args = make_args(tmp_path, per_device_eval_batch_size=4, num_generations_eval=4)
    trainer = GRPOTrainer(tiny_model, contains_digit, args=args, train_dataset=toy_dataset,
                          eval_dataset=toy_dataset.select(range(4)), processing_class=tokenizer)
    metrics = trainer.evaluate()
    for key in ("eval_reward", "eval_rewards/contains_digit/mean", "eval_pass@1", "eval_pass@2", "eval_pass@4",
                "eval_loss", "eval_completions/mean_length"):
        assert key in metrics, key
    assert 0.0 <= metrics["eval_pass@1"] <= metrics["eval_pass@2"] <= metrics["eval_pass@4"] <= 1.0
    # pass@1 is the plain success rate
    assert metrics["eval_pass@1"] == pytest.approx(metrics["eval_reward"], abs=1e-6)


def test_each_training_step_gets_its_rounds_rows_in_dataset_order_without_shuffle(tmp_path, tiny_model, tokenizer,
                                                                                monkeypatch):
    # 6 prompts, num_generations=2, per_device_train_batch_size=2, steps_per_generation=2: a round is 2 prompts x 2
    # rows; it serves steps_per_generation x num_iterations = 4 micro-steps, each handed the round's rows (TRL's
    # contract for `training_step`), and with shuffle_dataset=False the rounds follow the dataset: 3 rounds, 12 calls.
    from datasets import Dataset

    prompts = ["12", "34", "56", "78", "90", "13"]
    seen, original = [], GRPOTrainer.training_step

    def recording(self, model, inputs, *rest):
        seen.append(inputs)
        return original(self, model, inputs, *rest)

    monkeypatch.setattr(GRPOTrainer, "training_step", recording)
    args = make_args(tmp_path, max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2, steps_per_generation=2,
                     num_iterations=2, gradient_accumulation_steps=2, shuffle_dataset=False)
    GRPOTrainer(tiny_model, varied_reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                processing_class=tokenizer).train()
    rounds = [[{"prompt": a}] * 2 + [{"prompt": b}] * 2 for a, b in zip(prompts[::2], prompts[1::2])]
    assert seen == [rows for rows in rounds for _ in range(4)]


def test_eval_on_start_evaluates_before_the_first_step(tmp_path, tiny_model, tokenizer, toy_dataset):
    args = make_args(tmp_path, loss_type="grpo", eval_strategy="steps", eval_steps=2, eval_on_start=True,
                     per_device_eval_batch_size=4)
    trainer = GRPOTrainer(tiny_model, varied_reward, args=args, train_dataset=toy_dataset,
                          eval_dataset=toy_dataset.select(range(4)), processing_class=tokenizer)
    trainer.train()
    assert [(log["step"], "eval_loss" in log) for log in trainer.state.log_history if "eval_reward" in log] == \
        [(0, True), (2, True)]


def test_processes_generate_once_per_round_and_metrics_use_trl_names(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, _ = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, beta=0.1)
    first = trainer.state.log_history[0]
    for key in ("reward", "reward_std", "rewards/varied_reward/mean", "rewards/varied_reward/std",
                "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio", "num_tokens"):
        assert key in first, key
    assert first["frac_reward_zero_std"] == 0.0  # varied_reward always separates a group


def digit_fraction(completions, **kwargs):
    """Verifiable toy reward: the share of a completion's characters that are digits (random model: ~0.1)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def test_a_random_model_learns_the_toy_task(tmp_path, tokenizer):
    """Learning test: the mean reward of a randomly initialised model rises clearly within ~half a minute.
    Measured: 0.20 -> 0.62 -> 0.89 -> 0.96 over 20 steps (logged every 5)."""
    from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model

    torch.manual_seed(0)
    model = make_tiny_model(tokenizer)
    args = make_args(tmp_path, per_device_train_batch_size=32, num_generations=8, max_completion_length=4,
                     learning_rate=1e-2, max_steps=20, logging_steps=5, gradient_checkpointing=False)
    trainer = GRPOTrainer(model, digit_fraction, args=args, train_dataset=copy_digits_dataset(256),
                          processing_class=tokenizer)
    trainer.train()
    rewards = logged(trainer, "reward")
    assert rewards[-1] > rewards[0] + 0.4, rewards


def test_sync_ref_model_pulls_the_reference_towards_the_policy(tmp_path, tiny_model, tokenizer, toy_dataset):
    # alpha = 1 and a sync every step: after training the reference must equal the policy exactly.
    trainer, _ = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, beta=0.1, sync_ref_model=True,
                       ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    reference = dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in tiny_model.named_parameters())


def test_sequence_level_importance_sampling_trains(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, loss_type="grpo",
                             importance_sampling_level="sequence", num_iterations=2, max_steps=2)
    assert all(changed.values())
    assert logged(trainer, "clip_ratio/region_mean")[1] > 0.0  # the sequence ratio left the band on pass 2


def test_top_entropy_quantile_trains(tmp_path, tiny_model, tokenizer, toy_dataset):
    _, changed = train(tmp_path, tiny_model, tokenizer, toy_dataset, varied_reward, top_entropy_quantile=0.2)
    assert all(changed.values())


def test_disable_dropout(tmp_path, tokenizer, toy_dataset):
    from grpo_trainer.cli.toy import make_tiny_model

    model = make_tiny_model(tokenizer)
    model.dropout = torch.nn.Dropout(0.3)  # a model with a dropout layer
    GRPOTrainer(model, varied_reward, args=make_args(tmp_path, disable_dropout=True), train_dataset=toy_dataset,
                processing_class=tokenizer)
    assert model.dropout.p == 0.0


def test_reward_model_given_as_a_path(tmp_path, tiny_model, tokenizer, toy_conversational_dataset):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")  # the reward tokenizer (with its chat template) is loaded from here
    trainer, changed = train(tmp_path / "run", tiny_model, tokenizer, toy_conversational_dataset,
                             str(tmp_path / "rm"))
    assert trainer.reward_names == ["rm"] and all(changed.values())
    assert trainer.reward_funcs[0].model.config.pad_token_id == tokenizer.pad_token_id  # set for batched scoring
