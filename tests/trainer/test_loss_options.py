"""The trainer's wiring of TRL's loss options on real tiny training runs: the entropy bonus (static and adaptive,
with its checkpointed state), the off-policy sequence mask, the cross-process high-entropy mask, GDPO's
`normalize_then_sum`, and the warnings TRL logs for odd loss settings."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer import GRPOTrainer
from grpo_trainer.algorithms.entropy import EntropyControl
from grpo_trainer.algorithms.losses import LossSettings
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.trainer.loss import GRPOLoss, LossPartSettings
from tests.helpers import logged, make_args, make_trainer, train_and_compare, varied_reward


def constant_reward(completions, **kwargs):
    """Every completion scores the same: every advantage is 0."""
    return [1.0] * len(completions)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo", "vespo"])
def test_entropy_bonus_is_coef_times_entropy_for_every_loss_type(tmp_path, tiny_model, tokenizer, toy_dataset,
                                                                 loss_type):
    """TRL's test_entropy_bonus_scale, exact: with one micro-batch per step, the logged loss is the logged
    policy_loss minus entropy_coef x the logged entropy (the mean over the loss's tokens), whatever the loss type."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, loss_type=loss_type,
                           entropy_coef=0.5, max_steps=3,
                           importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    changed = train_and_compare(trainer)
    assert all(changed.values())
    logs = [entry for entry in trainer.state.log_history if "policy_loss" in entry and "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert entry["policy_loss"] - entry["loss"] == pytest.approx(0.5 * entry["entropy"], rel=1e-5, abs=1e-6)
        assert entry["entropy_coef"] == 0.5


def test_entropy_bonus_trains_completions_whose_advantage_is_zero(tmp_path, tokenizer, toy_dataset):
    """With every advantage 0 the policy term has no gradient, and zero-advantage rows skip the forward; the
    bonus must still train (a differentiable entropy, no row skipped). Without it nothing moves."""
    without = train_and_compare(make_trainer(tmp_path / "a", tokenizer, toy_dataset, constant_reward))
    assert not any(without.values())
    with_bonus = train_and_compare(make_trainer(tmp_path / "b", tokenizer, toy_dataset, constant_reward,
                                                entropy_coef=0.1))
    assert all(with_bonus.values())


def test_entropy_bonus_covers_every_row_when_advantages_are_zero(tmp_path, tiny_model, tokenizer, toy_dataset):
    """All advantages 0 (the policy term is 0): the loss is exactly -c x the mean entropy over every completion
    token, as a plain forward computes it; a skipped row would count with entropy 0."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, constant_reward, tiny_model, entropy_coef=0.1,
                           loss_type="grpo")
    trainer.model.train()
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(4)], "train")
    inputs = trainer.scorer.prepare(round_, "train", trainer.model)
    assert not inputs.advantages.any()
    loss = trainer.compute_loss(trainer.model, inputs)
    plain = dataclasses.replace(inputs, sampler=SamplerRecord())
    with torch.no_grad():
        entropy = trainer.scorer.logps(trainer.model, plain, with_entropy=True).entropy
    mask = inputs.completion_mask.float()
    assert loss.item() == pytest.approx(-0.1 * ((entropy * mask).sum() / mask.sum()).item(), rel=1e-5)


def test_adaptive_entropy_steps_once_per_optimizer_step_and_resumes(tmp_path, tiny_model, tokenizer, toy_dataset):
    """Target above any entropy of this vocabulary (ln 102 = 4.6 nats): the coefficient rises by one delta per
    optimizer step (not per micro-batch) from 0.01; the first window applies 0 (nothing measured yet). Its state
    goes into every checkpoint and a resumed run continues from it."""
    settings = dict(loss_type="grpo", entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=15.0,
                    entropy_coef_delta=0.005, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                    save_strategy="steps", save_steps=1)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, max_steps=2, **settings)
    changed = train_and_compare(trainer)
    assert all(changed.values())
    assert trainer.entropy_coef == pytest.approx(0.01 + 2 * 0.005)
    assert logged(trainer, "entropy_coef") == pytest.approx([0.015, 0.02])  # the value after each step's update
    state = json.loads((tmp_path / "checkpoint-1" / "entropy_ctrl_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.015) and state["last_world_entropy"] < 15.0
    first_window_policy, first_loss = logged(trainer, "policy_loss")[0], logged(trainer, "loss")[0]
    assert first_window_policy == pytest.approx(first_loss, abs=1e-6)  # coefficient 0 in the first window

    resumed = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, max_steps=3, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.entropy_coef == pytest.approx(0.01 + 3 * 0.005)  # restarted from 0.01 it would be 0.015


def test_off_policy_mask_trains(tmp_path, tiny_model, tokenizer, toy_dataset):
    # Two passes over each round: the second is off-policy, so old log-probs exist and the mask can act.
    changed = train_and_compare(make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model,
                                             off_policy_mask_threshold=0.01, num_iterations=2, max_steps=2))
    assert all(changed.values())


def test_off_policy_mask_drops_a_drifted_negative_completion(tmp_path, tiny_model, tokenizer, toy_dataset):
    """compute_loss on an off-policy micro-batch: old log-probs far above the current ones on the negative-
    advantage rows (a drift of 10 nats) drop those rows, which changes the loss; positive rows are never dropped."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, off_policy_mask_threshold=0.5,
                           num_iterations=2, loss_type="grpo")
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(4)], "train")
    inputs = trainer.scorer.prepare(round_, "train", trainer.model)
    assert inputs.old_logps is not None and (inputs.advantages < 0).any()
    drifted = dataclasses.replace(inputs, old_logps=inputs.old_logps + 10.0 * (inputs.advantages < 0)[:, None])
    with torch.no_grad():
        logps = trainer.scorer.logps(trainer.model, inputs).logps
    per_row = torch.exp(logps - inputs.old_logps)  # ratio 1 here: the policy has not moved yet
    assert torch.allclose(per_row, torch.ones_like(per_row))
    # drifted: the negative rows' surrogate is dropped; their ratio e^-10 would otherwise clip to 0.8 * |A|
    loss_kept = trainer.compute_loss(trainer.model, inputs).item()
    loss_dropped = trainer.compute_loss(trainer.model, drifted).item()
    mask = inputs.completion_mask.float()
    positive = (inputs.advantages > 0).float()
    # grpo: mean over rows of each row's token mean of -A (ratio 1), keeping only the positive rows when dropped
    assert loss_kept == pytest.approx(-(inputs.advantages * (mask.sum(1) > 0)).sum().item() / 4, abs=1e-5)
    assert loss_dropped == pytest.approx(-(inputs.advantages * positive * (mask.sum(1) > 0)).sum().item() / 4,
                                         abs=1e-5)


def test_get_off_policy_mask_is_trls_static_method_with_its_keyword_names():
    # drift = mean of (sampling - current) over the active tokens, threshold 0.5:
    #   row 0: A = -1, tokens (0 - (-1)) and (0 - 0) -> drift (1 + 0) / 2 = 0.5 <= 0.5: kept
    #   row 1: A = -1, one active token 0 - (-2) = 2 (the second is padding)  -> 2 > 0.5: dropped
    #   row 2: A = +2, drift 2, but a positive advantage is always kept
    kept = GRPOTrainer.get_off_policy_mask(
        advantages=torch.tensor([[-1.0], [-1.0], [2.0]]),
        per_token_logps=torch.tensor([[-1.0, 0.0], [-2.0, -9.0], [-2.0, -2.0]]),
        sampling_per_token_logps=torch.zeros(3, 2),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        off_policy_threshold=0.5)
    assert kept.tolist() == [[1.0], [0.0], [1.0]]


def test_high_entropy_mask_pools_every_process(tmp_path, tiny_model, tokenizer, toy_dataset):
    """`GRPOLoss.high_entropy_mask` (TRL's `get_high_entropy_mask`) pads the local entropies to a common length,
    gathers them and drops the padding before taking the quantile. Here the gather is a stand-in that appends a
    second process's padded entropies (a real 2-process run is in tests/distributed/test_collectives.py)."""
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # 7.0 and 9.0 are padding, never pooled nor kept
    other = torch.tensor([2.0, 3.0, -1e9, -1e9, -1e9, -1e9])  # the other process: 2 tokens, padded to 6

    def pad(x, dim, pad_index):
        assert pad_index < 0  # a sentinel no entropy can equal
        return x

    accelerator = SimpleNamespace(pad_across_processes=pad, gather=lambda x: torch.cat([x, other]))
    objective = GRPOLoss(LossPartSettings(LossSettings()), scorer=None, entropy=EntropyControl(),
                         accelerator=accelerator, metrics_window=MetricsWindow())
    kept = objective.high_entropy_mask(entropy, mask, 0.5)
    # pooled: 0.1 0.2 0.3 0.5 0.7 0.9 2 3 -> the 0.5 quantile is 0.5 + 0.5 * (0.7 - 0.5) = 0.6: keep 0.9, 0.7
    # (this process alone: 0.4, which would also keep 0.5)
    assert kept.int().tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]
    # the trainer's own accelerator (1 process): the quantile of this process's tokens, 0.4
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model)
    assert trainer.get_high_entropy_mask(entropy, mask, 0.5).int().tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]


def test_normalize_then_sum_runs_the_estimator_per_reward_function(tmp_path, tiny_model, tokenizer, toy_dataset):
    calls = []

    def estimator(rewards, num_generations, scale, **kwargs):
        calls.append((tuple(rewards.shape), scale))
        grouped = rewards.view(-1, num_generations)
        return (grouped - grouped.mean(1, keepdim=True)).reshape(-1)

    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = make_args(tmp_path, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(tiny_model, [varied_reward, length_reward], args=args, train_dataset=toy_dataset,
                          processing_class=tokenizer, advantage_estimator=estimator)  # the trainer's argument
    changed = train_and_compare(trainer)
    assert all(changed.values())
    assert calls == [((4,), "group")] * 4  # one call per reward function and round, each on its own column


@pytest.mark.parametrize(("level", "loss_type", "warned"), [
    ("sequence", "dapo", True), ("sequence", "bnpo", True), ("sequence", "grpo", False), ("token", "dapo", False)])
def test_sequence_level_with_a_token_summing_loss_warns(caplog, tmp_path, tiny_model, tokenizer, toy_dataset, level,
                                                       loss_type, warned):
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, importance_sampling_level=level,
                     loss_type=loss_type)
    assert ("weights each sequence by its completion length" in caplog.text) == warned


def test_metrics_hold_no_autograd_graph(tmp_path, tiny_model, tokenizer, toy_dataset):
    """The entropy is differentiable now: what compute_loss records for logging must not keep its graph alive."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, entropy_coef=0.1,
                           top_entropy_quantile=0.5)
    trainer.model.train()
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(4)], "train")
    inputs = trainer.scorer.prepare(round_, "train", trainer.model)
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.requires_grad
    window = trainer._metrics["train"]
    assert {"entropy", "policy_loss", "clip_ratio/low_min"} <= set(window)
    for key, values in window.items():
        assert not any(isinstance(v, torch.Tensor) and v.requires_grad for v in values), key
