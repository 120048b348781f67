"""`padding_free=True` trains exactly as padded: a real run on completions of spread lengths (ended by EOS at seeded
log-normal lengths, `tests/toy_lengths.py`) ends with the same weights and losses within 1e-5, while its forwards really
ran packed; on-policy (replay), off-policy with a reference model, and with LoRA."""

import math

import pytest
import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_reward, make_tiny_model
from grpo_trainer.modeling import forwards
from tests.toy_lengths import LogNormalLengths, install_lengths

TOL = 1e-5
PACKED_LOGPROBS = forwards.packed_logprobs


def spread_model(tokenizer):
    """The toy model, its completions ended at lengths log-normal around 4 in [1, 12]."""
    model = make_tiny_model(tokenizer, seed=2)
    install_lengths(model, LogNormalLengths(maximum=12, median=4, sigma=0.8, minimum=1))
    return model


def _run(tmp_path, tokenizer, dataset, padding_free: bool, packed_calls: list, monkeypatch, **overrides):
    forwards._VERDICTS.clear()
    real = PACKED_LOGPROBS

    def counted(model, packed, *args, **kwargs):  # (packed rows, sequences in them)
        packed_calls.append((packed.input_ids.shape[0], packed.target_cells[0].unique().numel()))
        return real(model, packed, *args, **kwargs)

    monkeypatch.setattr(forwards, "packed_logprobs", counted)
    peft_config = overrides.pop("peft_config", None)
    settings = dict(output_dir=str(tmp_path / f"packed_{padding_free}"), per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=12, learning_rate=0.1, max_steps=3, report_to="none",
                    save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, padding_free=padding_free,
                    # SGD: an update linear in the gradient. Adam turns float rounding on a zero gradient (the
                    # embedding rows of tokens outside every kept support: 0 padded, ~1e-9 packed) into a whole
                    # learning-rate step, which compares the layouts' rounding, not their gradients.
                    optim="sgd")
    args = GRPOConfig(**{**settings, **overrides})
    trainer = GRPOTrainer(spread_model(tokenizer), copy_digits_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    return before, after, losses, lengths


@pytest.mark.parametrize("overrides", [
    {},  # on-policy, beta 0: replay of the rollout's layer outputs and softmax
    {"zero_variance_groups": "skip"},  # zero-advantage rows out of the forwards
    {"keep_sampling_mask": False},  # the full softmax, the length processor's supports only measured
    {"beta": 0.04, "num_iterations": 2},  # reference and old log-probs, off-policy
    {"lora": True},
], ids=["on_policy_replay", "skip", "full_softmax", "reference_and_old", "lora"])
def test_padding_free_training_gives_the_padded_weights(tmp_path, tokenizer, toy_dataset, monkeypatch, overrides):
    if overrides.pop("lora", False):
        from peft import LoraConfig

        overrides = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                     "learning_rate": 0.1}
    padded_calls, packed_calls = [], []
    before, padded, padded_losses, padded_lengths = _run(tmp_path, tokenizer, toy_dataset, False, padded_calls,
                                                         monkeypatch, **overrides)
    _, packed, packed_losses, packed_lengths = _run(tmp_path, tokenizer, toy_dataset, True, packed_calls, monkeypatch,
                                                    **overrides)
    assert padded_calls == []
    # The self-check's two packed forwards, then the micro-batches' log-prob forwards (a step whose every advantage
    # is 0 scores one row: padded), packed with rows shared.
    assert len(packed_calls) >= 2 + 2 and all(sequences > rows for rows, sequences in packed_calls)
    assert packed_lengths == padded_lengths and min(padded_lengths) < 11  # same rollouts, spread lengths
    assert all(math.isfinite(x) for x in padded_losses)
    for got, want in zip(packed_losses, padded_losses, strict=True):
        assert abs(got - want) <= TOL
    changed = [n for n in before if not torch.equal(before[n], padded[n])]
    assert changed  # it trained
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=TOL, rtol=0, msg=name)
