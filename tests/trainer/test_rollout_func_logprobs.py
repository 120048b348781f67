"""A `rollout_func`'s log-probs are the behaviour policy's, as in TRL 1.16: the off-policy mask measures drift against
them. Fed the same completions, `grpo_trainer.GRPOTrainer` and `trl.GRPOTrainer` compute the same first-step loss."""

import os

import pytest
import torch

from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from grpo_trainer.rewards.library import copy_digits_reward


def _rollout_func(tokenizer, offset):
    """Fixed completions: copy i of each prompt answers the prompt's digits (i even) or '9' (i odd), then EOS; the
    log-probs returned are `offset` for every token (a sampler that disagrees with the policy)."""

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        texts = [p.split(" ")[1][:-1] if i % 2 == 0 else "9" for i, p in enumerate(prompts)]
        completion_ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[offset] * len(c) for c in completion_ids]}

    return rollout_func


def _first_loss(impl, tmp_path, tokenizer, model_dir, offset, threshold):
    if impl == "trl":
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo_trainer import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir=str(tmp_path / impl), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, learning_rate=1e-3, loss_type="dapo", seed=0,
                      off_policy_mask_threshold=threshold)
    trainer = GRPOTrainer(str(model_dir), copy_digits_reward, args=args, processing_class=tokenizer,
                          train_dataset=copy_digits_dataset(8), rollout_func=_rollout_func(tokenizer, offset))
    trainer.train()
    return trainer.state.log_history[0]["loss"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("rollout_func_model")
    make_tiny_model(tokenizer, seed=3).save_pretrained(folder)
    return folder


def test_the_off_policy_mask_measures_drift_against_the_rollout_funcs_logprobs(tmp_path, tokenizer, model_dir):
    """On-policy the dapo loss is -sum_i A_i L_i / N (ratio 1; L_i completion tokens, N all of them): the copies
    answering right (4 tokens, A > 0) outweigh the '9' ones (2 tokens, A < 0).

    Log-probs -20 from the sampler (a negative drift against the ~-4.6 of a random 104-token policy): nothing is
    dropped. Log-probs 0.0: every completion's drift, log pi_sampler - log pi_theta ~ 4.6, passes the threshold 0.5,
    so the negative-advantage completions are dropped and only the positive terms remain: a larger |loss|. Measured
    against the old policy instead (drift 0, what grpo_trainer did before), the two would give the same loss. TRL
    computes the same numbers."""
    kept_ours = _first_loss("ours", tmp_path / "kept", tokenizer, model_dir, offset=-20.0, threshold=0.5)
    kept_theirs = _first_loss("trl", tmp_path / "kept", tokenizer, model_dir, offset=-20.0, threshold=0.5)
    dropped_ours = _first_loss("ours", tmp_path / "dropped", tokenizer, model_dir, offset=0.0, threshold=0.5)
    dropped_theirs = _first_loss("trl", tmp_path / "dropped", tokenizer, model_dir, offset=0.0, threshold=0.5)
    assert kept_ours == pytest.approx(kept_theirs, abs=1e-6)
    assert dropped_ours == pytest.approx(dropped_theirs, abs=1e-6)
    assert dropped_ours < kept_ours - 0.1


def test_the_rollout_funcs_logprobs_reach_the_round(tmp_path, tokenizer, toy_dataset):
    """None is kept as NaN (no value: no drift for that token), padding as 0."""
    from grpo_trainer import GRPOConfig, GRPOTrainer

    def rollout_func(prompts, trainer):
        completion_ids = [[20, 21, tokenizer.eos_token_id] if i % 2 else [22, tokenizer.eos_token_id]
                          for i in range(len(prompts))]
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completion_ids,
                "logprobs": [[-1.0, None, -3.0] if i % 2 else [-0.5, -0.25] for i in range(len(prompts))]}

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(make_tiny_model(tokenizer), copy_digits_reward, args=args, processing_class=tokenizer,
                          train_dataset=toy_dataset, rollout_func=rollout_func)
    round_ = trainer._generate_and_score([toy_dataset[i // 2] for i in range(4)], "train")
    expected = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, float("nan"), -3.0]] * 2)
    torch.testing.assert_close(round_.sampler.logps, expected, equal_nan=True)
    assert round_.sampler.kind == "rollout_func" and not round_.sampler.exact
    assert round_.token_weights is None  # no importance-sampling correction without vLLM, as in TRL
