"""Failing reward code, non-finite losses, odd completions, interruption and exact resume."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from unittest import mock

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rewards import RewardError
from grpo_trainer.runtime.checkpoints import latest_complete
from tests.helpers import REPO, StopAt, make_trainer, varied_reward


def test_failing_reward_names_function_sample_and_prompt(tmp_path, tiny_model, tokenizer, toy_dataset):
    # The batch call fails; one-at-a-time calls pin the failure on sample 2 of the batch.
    def broken_on_index_2(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ZeroDivisionError("division by zero")
        broken_on_index_2.calls += 1
        if broken_on_index_2.calls == 3:
            raise ZeroDivisionError("division by zero")
        return [0.0]

    broken_on_index_2.calls = 0
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, broken_on_index_2, tiny_model)
    with pytest.raises(RewardError) as error:
        trainer.train()
    message = str(error.value)
    assert "'broken_on_index_2' failed on sample 2 (ZeroDivisionError" in message
    assert "prompt: 'copy " in message and "reward_error_policy='none'" in message


def test_failing_reward_as_missing_with_policy_none(tmp_path, tiny_model, tokenizer, toy_dataset):
    calls = []

    def flaky(completions, **kwargs):
        calls.append(len(completions))
        if len(completions) > 1:
            raise RuntimeError("service unavailable")
        return [None if len(calls) % 2 else 1.0]  # single calls alternate between "no score" and 1.0

    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, [flaky, varied_reward], tiny_model,
                           reward_error_policy="none")
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.state.log_history[0]["rewards/flaky/mean"] == 1.0  # NaNs left out of the mean


@pytest.mark.parametrize("bad, message", [
    (lambda completions, **kw: [1.0], "returned 1 values for 4 completions"),
    (lambda completions, **kw: [math.inf] * len(completions), "failed on sample 0 (returned inf)"),
    (lambda completions, **kw: [math.nan] * len(completions), "failed on sample 0 (returned nan)"),
])
def test_reward_of_wrong_length_or_infinite(tmp_path, tiny_model, tokenizer, toy_dataset, bad, message):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, bad, tiny_model)
    with pytest.raises(RewardError) as error:
        trainer.train()
    assert message in str(error.value) or message in str(error.value.__cause__)


def test_group_with_all_rewards_missing_gets_zero_advantage_and_a_warning(tmp_path, tiny_model, tokenizer,
                                                                           toy_dataset, caplog):
    def half_missing(completions, **kwargs):  # first group scored, second group all None
        return [float(i) if i < 2 else None for i in range(len(completions))]

    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, half_missing, tiny_model, max_steps=1)
    with caplog.at_level("WARNING", logger="grpo_trainer.trainer.grpo_trainer"):  # TRL's logger warning
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    advantages = trainer.buffer.parts[0].advantages
    assert not torch.isnan(advantages).any()
    # Rows are shuffled within the round; the two missing ones have advantage exactly 0 and the scored group
    # (0, 1) has +-1/(0.7071 + 1e-4) = +-0.70701.
    assert sorted(advantages.tolist()) == pytest.approx([-0.70701, 0.0, 0.0, 0.70701], abs=1e-5)


def test_non_finite_loss_skips_the_step_then_stops(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, max_steps=3,
                           max_nonfinite_steps=1)
    real = trainer.compute_loss
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    with mock.patch.object(trainer, "compute_loss", side_effect=lambda *a, **k: real(*a, **k) * math.nan):
        with pytest.warns(UserWarning, match="non-finite loss or gradient"), \
                pytest.raises(RuntimeError, match="2 micro-steps in a row had a non-finite loss"):
            trainer.train()
    # The first bad step was skipped: its NaN gradients never reached the weights.
    assert all(torch.equal(p, before[n]) for n, p in tiny_model.named_parameters())


def test_empty_and_full_length_completions(tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, max_steps=1,
                           max_completion_length=4, generation_backend="generate")  # completions: a patched generate
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def fake_generate(input_ids, attention_mask, generation_config):
        # Rows 0, 2: EOS first (an empty answer); rows 1, 3: four digits, never EOS (truncated).
        digits = tokenizer.convert_tokens_to_ids(list("1234"))
        rows = [[eos, pad, pad, pad] if i % 2 == 0 else digits for i in range(input_ids.shape[0])]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)

    with mock.patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    first = trainer.state.log_history[0]
    assert first["completions/min_length"] == 1 and first["completions/max_length"] == 4  # EOS counts as a token
    assert first["completions/clipped_ratio"] == 0.5 and math.isfinite(first["loss"])


def run_to(tmp_path, tokenizer, dataset, stop_at, resume=None, max_steps=4, **overrides):
    torch.manual_seed(123)
    model = make_tiny_model(tokenizer, seed=7)
    trainer = make_trainer(tmp_path, tokenizer, dataset, varied_reward, model, max_steps=max_steps, learning_rate=0.01,
                           save_strategy="steps", save_steps=2, **overrides)
    trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("overrides", [
    {"num_iterations": 2, "steps_per_generation": 2},  # the checkpoint falls in the middle of a round
    {"gradient_accumulation_steps": 2, "beta": 0.1},
    # drafts read earlier rounds' completions, which a checkpoint does not keep: the tokens do not depend on them
    {"speculative_rollouts": True, "temperature": 0.3},
])
def test_resume_equals_an_uninterrupted_run(tmp_path, tokenizer, toy_dataset, overrides):
    straight = run_to(tmp_path / "straight", tokenizer, toy_dataset, 4, **overrides)
    run_to(tmp_path / "split", tokenizer, toy_dataset, 2, **overrides)
    resumed = run_to(tmp_path / "split", tokenizer, toy_dataset, 4, resume=True, **overrides)
    worst = max((straight[n] - resumed[n]).abs().max().item() for n in straight)
    assert worst <= 1e-6


def test_half_written_checkpoint_is_never_resumed_from(tmp_path, tokenizer, toy_dataset):
    run_to(tmp_path, tokenizer, toy_dataset, 2)
    partial = tmp_path / "checkpoint-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    (partial / "trainer_state.json").write_text('{"global_step": 4, "log_hi')  # cut off mid-write
    assert latest_complete(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    run_to(tmp_path, tokenizer, toy_dataset, 3, resume=True)  # resumes from checkpoint-2, not the broken one


SIGTERM_SCRIPT = textwrap.dedent('''
    import sys
    from transformers import TrainerCallback
    from grpo_trainer.cli.toy import copy_digits_dataset, make_tokenizer
    from tests.helpers import make_trainer

    class Announce(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"STEP {state.global_step}", flush=True)

    trainer = make_trainer(sys.argv[1], make_tokenizer(), copy_digits_dataset(64), max_completion_length=4,
                           max_steps=10000, callbacks=[Announce()])
    trainer.train()
    print(f"STOPPED AT {trainer.state.global_step}", flush=True)
''')


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    deadline, seen = time.time() + 240, []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("STEP 2") or time.time() > deadline:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, ("".join(seen) + rest)[-2000:]
    stopped = int(next(line for line in rest.splitlines() if line.startswith("STOPPED AT")).split()[-1])
    assert 2 <= stopped < 10000
    assert latest_complete(str(tmp_path / "out")) == str(tmp_path / "out" / f"checkpoint-{stopped}")
