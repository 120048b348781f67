"""The rollout's own log-probs in the loss: on-policy they stand in for the loss forward's (same loss, metrics and
gradients), off-policy they are the old log-probs, and rows whose advantage is exactly 0 skip the forward."""

import dataclasses

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.runtime import compat
from tests.helpers import TWO_GROUPS_OF_4, make_trainer


def _trainer(tmp_path, tokenizer, dataset, seed=2, **overrides):
    """Rounds of 2 prompts x G=4 on the tiny model of `seed` (no training step: the tests drive the loss)."""
    return make_trainer(tmp_path, tokenizer, dataset, model=make_tiny_model(tokenizer, seed=seed),
                        **{**TWO_GROUPS_OF_4, **overrides})


def _micro_batch(trainer, dataset):
    """One 8-row micro-batch of two prompts' groups, as `_prepare_inputs` serves it (trimmed, with its old and
    reference log-probs)."""
    round_ = trainer._generate_and_score([dataset[i // 4] for i in range(8)], "train")
    return trainer.scorer.prepare(round_, "train", trainer.model)


def _without_rollout_values(inputs):
    return dataclasses.replace(inputs, sampler=SamplerRecord())


@pytest.mark.parametrize(("beta", "entropy_coef"), [(0.0, 0.0), (0.04, 0.0), (0.0, 0.3)])
def test_loss_and_gradients_with_rollout_logps_equal_a_full_forward(tmp_path, tokenizer, toy_dataset, beta,
                                                                    entropy_coef):
    """On-policy, compute_loss with the sampler's log-probs and entropies (the forward skips the LM head) gives
    the loss, the metrics and the gradients of the plain forward, also with the entropy bonus (whose gradient
    goes through the rollout's entropies)."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, beta=beta, temperature=0.9, entropy_coef=entropy_coef)
    model = trainer.model
    inputs = _micro_batch(trainer, toy_dataset)
    assert inputs.sampler.stand_ins[0] is not None

    def loss_and_grads(batch):
        model.zero_grad()
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        return loss.detach(), {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}, \
            [p.grad.clone() for p in model.parameters()]

    if beta:  # the reference log-probs are the reference model's, whatever the round carries
        with torch.no_grad():
            reference = trainer.scorer.no_grad_logps(trainer.ref_model, _without_rollout_values(inputs))
        torch.testing.assert_close(inputs.ref_logps, reference, atol=0, rtol=0)
    fast = loss_and_grads(inputs)
    plain = loss_and_grads(_without_rollout_values(inputs))
    torch.testing.assert_close(fast[0], plain[0], atol=1e-6, rtol=0)
    assert fast[1].keys() == plain[1].keys()
    for key in fast[1]:
        assert fast[1][key] == pytest.approx(plain[1][key], abs=1e-5), key
    for got, want in zip(fast[2], plain[2]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_off_policy_rounds_take_the_rollout_logps_as_old_logps(tmp_path, tokenizer, toy_dataset):
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, num_iterations=2)
    inputs = _micro_batch(trainer, toy_dataset)
    # The losses after the first optimizer step must recompute the current log-probs: no sampling values left.
    assert inputs.sampler.stand_ins == (None, None, None) and inputs.old_logps is not None
    with torch.no_grad():
        recomputed = trainer.scorer.no_grad_logps(trainer.model, inputs)
    active = inputs.completion_mask.bool()
    torch.testing.assert_close(inputs.old_logps[active], recomputed[active], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("loss_type", "num_iterations"), [("dapo", 1), ("grpo", 1), ("bnpo", 2), ("dr_grpo", 2),
                                                         ("luspo", 1), ("luspo", 2)])
def test_zero_advantage_rows_skip_the_forward_with_the_same_loss_and_gradients(tmp_path, tokenizer, toy_dataset,
                                                                               monkeypatch, loss_type,
                                                                               num_iterations):
    """zero_variance_groups='skip', beta = 0: a completion with advantage exactly 0 adds nothing to the loss or its
    gradient, so only the other rows run forward; they still count in every normaliser (grpo's 1/B, bnpo's tokens,
    dr_grpo's B * T, dapo's window, luspo's mean over the B sequences' token sums). With num_iterations = 2 the
    round carries old log-probs, used as the skipped rows' values."""
    # padding_free=False: the rows of each forward are counted (packed forwards have other shapes).
    level = "sequence" if loss_type == "luspo" else "token"  # LUSPO's own setting: sequence-level sums
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, seed=3, loss_type=loss_type, num_iterations=num_iterations,
                       zero_variance_groups="skip", padding_free=False, importance_sampling_level=level)
    model = trainer.model
    inputs = dataclasses.replace(_micro_batch(trainer, toy_dataset),
                                 advantages=torch.tensor([0.5, 0.0, 0.0, -1.0, 0.25, 0.0, 1.5, -0.75]))
    rows_seen = []
    model.register_forward_pre_hook(lambda module, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)

    def loss_and_grads():
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    skipped = loss_and_grads()
    assert rows_seen == [5]  # the three zero-advantage rows never ran
    skipping = trainer.scorer.policy_logps
    monkeypatch.setattr(trainer.scorer, "policy_logps",
                        lambda m, batch, skip, aux=False: skipping(m, batch, False, aux))  # never skip
    plain = loss_and_grads()
    assert rows_seen == [5, 8]
    torch.testing.assert_close(skipped[0], plain[0], atol=1e-7, rtol=1e-6)
    for got, want in zip(skipped[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in skipped[1])


def test_zero_advantage_rows_run_by_default_as_in_trl(tmp_path, tokenizer, toy_dataset):
    """zero_variance_groups='train' (the default): every row runs forward, as TRL's trainer runs them."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, seed=3, padding_free=False)  # rows counted
    inputs = dataclasses.replace(_micro_batch(trainer, toy_dataset), advantages=torch.zeros(8))
    rows_seen = []
    trainer.model.register_forward_pre_hook(lambda module, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                            with_kwargs=True)
    trainer.compute_loss(trainer.model, inputs)
    assert rows_seen == [8]


def test_skip_computes_old_logps_only_for_rows_that_train(tmp_path, tokenizer, toy_dataset):
    """Off-policy with 'skip' (generate backend: no rollout log-probs to take as old ones): the old-log-prob forward
    runs on the rows with a non-zero advantage only; the others get 0, which their loss never reads."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, seed=3, num_iterations=2, zero_variance_groups="skip",
                       generation_backend="generate", padding_free=False)  # rows counted per forward
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    round_ = dataclasses.replace(round_, advantages=torch.tensor([0.5, 0.0, 0.0, -1.0, 0.25, 0.0, 1.5, -0.75]))
    rows_seen = []
    trainer.model.register_forward_pre_hook(lambda module, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                            with_kwargs=True)
    part = trainer.scorer.prepare(round_, "train", trainer.model)
    assert rows_seen == [5]
    assert (part.old_logps[[1, 2, 5]] == 0).all()
    with torch.no_grad():
        full = trainer.scorer.no_grad_logps(trainer.model, part)
    kept = torch.tensor([0, 3, 4, 6, 7])
    active = part.completion_mask[kept].bool()
    torch.testing.assert_close(part.old_logps[kept][active], full[kept][active], atol=1e-5, rtol=0)


def test_a_micro_batch_drops_its_replay_tensors_after_its_last_loss(tmp_path, tokenizer, toy_dataset):
    """On-policy with 2 micro-batches per round, each used twice (4 accumulation steps): every micro-step gets its
    softmax and layer outputs; the buffer lets them go at a micro-batch's second (last) use, so a `[B, T, V]`
    softmax never outlives its backward pass (nor sits in the buffer through the optimizer step)."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, per_device_train_batch_size=4, num_generations=2,
                       gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2)
    assert trainer.buffer.schedule.on_policy("train")
    compat.enable_checkpointing(trainer.model, {"use_reentrant": False})  # as train() does: layer outputs kept
    trainer.model.train()
    batch = [toy_dataset[i // 2] for i in range(8)]
    kept = []
    for _ in range(4):
        served = trainer._prepare_inputs(batch)
        assert served.sampler.replay.probs is not None and served.sampler.replay.layer_outputs is not None
        kept.append([part.sampler.replay.probs is not None and part.sampler.replay.layer_outputs is not None
                     for part in trainer.buffer.parts])
    assert kept == [[True, True], [True, True], [False, True], [False, False]]
