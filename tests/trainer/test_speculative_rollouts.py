"""GRPOTrainer with `speculative_rollouts`: an SGD step with drafts equals one without (the same completions, so the
same update), the round's decoding costs logged, the combinations it serves training with it (asynchronous rounds,
dynamic sampling, tool calls), and the ones it cannot refused by name before any model loads."""

import pytest
import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model
from tests.helpers import TWO_GROUPS_OF_4, logged, make_trainer, sgd_step_args, varied_reward

METRICS = ("speculative/decode_steps", "speculative/forwards_per_token", "speculative/drafted_tokens",
           "speculative/accepted_tokens", "speculative/acceptance_rate", "speculative/mean_accepted_length",
           "speculative/draft_share")


def _sgd_step(path, tokenizer, args) -> tuple[dict, list]:
    """{name: weight change} of one SGD step from the model saved at `path`, and the run's log history."""
    trainer = GRPOTrainer(str(path), copy_digits_reward, args=args, train_dataset=copy_digits_dataset(num_prompts=16),
                          processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer.state.log_history


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_a_step_with_drafts_equals_one_without(tmp_path, tokenizer, padding_free):
    """`speculative_verify_tokens=1` leaves no room for a draft: the same loop, every token drawn one forward at a
    time from the same uniforms. Drafts then change the forward count and not the update (SGD, so float noise in
    near-zero gradients stays small), with packed and padded log-prob forwards."""
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    common = dict(speculative_rollouts=True, temperature=0.2, max_completion_length=24, padding_free=padding_free)
    drafted, drafted_log = _sgd_step(path, tokenizer, sgd_step_args(tmp_path / "drafts", **common))
    plain, plain_log = _sgd_step(path, tokenizer,
                                 sgd_step_args(tmp_path / "none", speculative_verify_tokens=1, **common))
    assert drafted_log[0]["speculative/accepted_tokens"] > 0 and plain_log[0]["speculative/drafted_tokens"] == 0
    assert max(plain[n].abs().max().item() for n in plain) > 1e-4  # the step moved the weights
    for name in plain:
        torch.testing.assert_close(drafted[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_rounds_decoding_costs_are_logged(tmp_path, tokenizer):
    run = make_trainer(tmp_path, tokenizer, reward_funcs=varied_reward, speculative_rollouts=True, temperature=0.3,
                       max_completion_length=16, **TWO_GROUPS_OF_4)
    run.train()
    for key in METRICS:
        assert len(logged(run, key)) == 2, key
    assert all(value > 0 for value in logged(run, "speculative/drafted_tokens"))
    assert all(0 < value <= 1 for value in logged(run, "speculative/forwards_per_token"))
    off = make_trainer(tmp_path / "off", tokenizer, reward_funcs=varied_reward, max_completion_length=16,
                       **TWO_GROUPS_OF_4)
    off.train()
    assert logged(off, "speculative/decode_steps") == []  # off: the plain loop, which counts nothing


@pytest.mark.parametrize("settings", [dict(async_rollouts=1), dict(zero_variance_groups="resample")],
                         ids=["async", "dynamic_sampling"])
def test_it_trains_with_asynchronous_rounds_and_dynamic_sampling(tmp_path, tokenizer, settings):
    run = make_trainer(tmp_path, tokenizer, speculative_rollouts=True, temperature=0.5, **TWO_GROUPS_OF_4,
                       **settings)
    before = {n: p.clone() for n, p in run.model.named_parameters()}
    run.train()
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    assert len(logged(run, "speculative/decode_steps")) >= 1


def test_it_trains_with_tool_calls(tmp_path):
    from tests.tool_helpers import get
    from tests.trainer.test_multiturn import CALL, trainer

    run = trainer(tmp_path, tools=[get], speculative_rollouts=True)
    before = {n: p.clone() for n, p in run.model.named_parameters()}
    run.train()
    entry = run.state.log_history[0]
    assert entry["tools/call_frequency"] == 1.0
    assert entry["completions/mean_length"] == 2 * len(CALL)
    assert entry["speculative/decode_steps"] > 0  # every turn through the decoder with drafts
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters())


@pytest.mark.parametrize(("settings", "message"), [
    (dict(use_vllm=True), "speculative_rollouts=True drafts and verifies inside the fast decoder, but use_vllm=True"),
    (dict(use_transformers_continuous_batching=True), "but use_transformers_continuous_batching=True"),
    (dict(generation_backend="generate"), "but generation_backend='generate'"),
    (dict(speculative_draft_tokens=0), "speculative_draft_tokens must be >= 1"),
    (dict(speculative_verify_tokens=0), "speculative_verify_tokens must be >= 1"),
    (dict(speculative_policy="fastest"), "speculative_policy must be 'fixed' or 'measured'"),
])
def test_what_it_cannot_serve_is_refused_by_name(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), speculative_rollouts=True, **settings)
