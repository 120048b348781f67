"""The trainer's update is the one-page reference step's (`examples/reference_grpo_step.py`): fed the same completions
and rewards, one SGD step of each moves every weight by the same amount, to float32 rounding.

The trainer samples one round itself (its own backend, temperature 0.7); a reward function records the round's
prompts, completion ids and the rewards it returns, and the reference trains on exactly those. Under SGD (no
momentum, no weight decay, no gradient clipping, learning rate 1 at the first step of the linear schedule) the
change of each weight is -lr x its gradient, so equal updates mean equal gradients of equal losses; Adam would
turn float noise into full steps. `max_grad_norm=0`: a clipped step keeps only the gradient's direction, which
would hide a wrong normaliser.

Everything else is the trainer's default: loss_type='dapo', scale_rewards='group', num_iterations=1 (on-policy),
use_bias_correction_kl=True, and on CPU its packed (padding_free) forwards, the tied-embedding lookup and activation
checkpointing. Cases: beta=0; beta=0.1 (the reference model moved off the policy, or the k3 term has no gradient);
beta=0.1 with the round split into two micro-batches (gradient accumulation). Measured (2026-12-01): the weights
move by up to 0.4, the two updates differ by at most 2.1e-7. The tolerance catches, among others, log-probs at
temperature 1, the KL without the factor rho, the population std, and an advantage eps of 1e-8 instead of 1e-4
(1.6e-5 apart).
"""

import importlib.util
import os
import sys

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from tests.helpers import make_trainer

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "reference_grpo_step.py")
SEED, LR, TEMPERATURE = 3, 1.0, 0.7
ATOL = 1e-6  # float32 rounding of a weight change; the changes themselves are >= 1e-3 (asserted)


def _reference():
    spec = importlib.util.spec_from_file_location("reference_grpo_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def _policy(tokenizer):
    """The tiny model (seed 3) with its EOS embedding row turned towards its hidden states, so that some completions end
    early and others run to max_completion_length: lengths differ, which is what tells 'dapo' (one token, one vote)
    apart from a per-completion mean. The embedding is tied, so this is the LM head's EOS row too."""
    model = make_tiny_model(tokenizer, seed=SEED)
    with torch.no_grad():
        hidden = model(torch.tensor([tokenizer("copy 123: 4567 abc")["input_ids"]]),
                       output_hidden_states=True).hidden_states[-1][0].mean(0)
        weight = model.get_input_embeddings().weight
        weight[tokenizer.eos_token_id] += 3.0 * hidden / hidden.norm() * weight.norm(dim=1).mean()
    return model


def _perturb(model) -> None:
    """Move the reference model away from the policy (seeded, by parameter name), so that the KL term's gradient is
    not 0: at pi_ref = pi_theta both k3 and its gradient vanish."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def _trainer_step(tmp_path, tokenizer, beta, **settings):
    """One optimizer step of the trainer: (the round it trained on, {name: weight before}, {name: weight after},
    the trainer)."""
    round_ = {}

    def recorded_reward(prompts, completion_ids, **kwargs):
        rewards = [float(sum(ids) % 7) + 0.1 * i for i, ids in enumerate(completion_ids)]  # varied within groups
        assert not round_, "one round only"
        round_.update(prompts=list(prompts), completion_ids=[list(c) for c in completion_ids], rewards=rewards)
        return rewards

    settings = {"optim": "sgd", "learning_rate": LR, "max_grad_norm": 0.0, "max_steps": 1, "beta": beta,
                "temperature": TEMPERATURE, "per_device_train_batch_size": 8, "num_generations": 4,
                "max_completion_length": 8, **settings}
    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=recorded_reward,
                           model=_policy(tokenizer), **settings)
    if beta:
        _perturb(trainer.ref_model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return round_, before, after, trainer


def _reference_step(tokenizer, round_, beta, G):
    """The reference's step on the trainer's round, from the same initial weights."""
    ref = _reference()
    policy = _policy(tokenizer)
    reference = None
    if beta:
        reference = _policy(tokenizer)
        _perturb(reference)
        reference.eval().requires_grad_(False)
    prompts, completions = round_["prompts"], round_["completion_ids"]
    groups = []
    for start in range(0, len(prompts), G):
        assert len(set(prompts[start:start + G])) == 1  # each prompt's G completions are contiguous
        prompt_ids = torch.tensor(tokenizer(prompts[start])["input_ids"])
        groups.append(ref.Group(prompt_ids, [torch.tensor(c) for c in completions[start:start + G]]))
    rewards = torch.tensor(round_["rewards"]).view(-1, G)
    settings = ref.Settings(num_generations=G, max_completion_length=8, temperature=TEMPERATURE, beta=beta,
                            max_grad_norm=0.0)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    metrics = ref.train_on_round(policy, reference, torch.optim.SGD(policy.parameters(), lr=LR), groups, rewards,
                                 settings)
    return before, {n: p.detach().clone() for n, p in policy.named_parameters()}, metrics


@pytest.mark.parametrize("beta, settings", [
    pytest.param(0.0, {}, id="defaults"),
    pytest.param(0.1, {}, id="kl_k3"),
    pytest.param(0.1, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
                 id="kl_k3-two_micro_batches"),
])
def test_the_trainers_update_is_the_reference_steps(tmp_path, tokenizer, beta, settings):
    round_, trainer_before, trainer_after, trainer = _trainer_step(tmp_path, tokenizer, beta, **settings)
    G = trainer.args.num_generations
    assert len(round_["completion_ids"]) == 8 and trainer.state.global_step == 1
    lengths = [len(c) for c in round_["completion_ids"]]
    assert 8 in lengths and min(lengths) < 8, lengths  # truncated completions and ones that ended at EOS
    reference_before, reference_after, metrics = _reference_step(tokenizer, round_, beta, G)
    assert trainer_before.keys() == reference_before.keys()
    step, worst = 0.0, 0.0
    for name, start in trainer_before.items():
        assert torch.equal(start, reference_before[name]), f"{name} starts elsewhere"
        trainer_delta = trainer_after[name] - start
        reference_delta = reference_after[name] - start
        step = max(step, trainer_delta.abs().max().item())
        worst = max(worst, (trainer_delta - reference_delta).abs().max().item())
        torch.testing.assert_close(trainer_delta, reference_delta, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    assert step > 1e-3, f"a vacuous step: no weight moved by more than {step:.2e}"  # 1000 x ATOL at least
    assert metrics["completion_tokens"] == sum(len(c) for c in round_["completion_ids"])
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert logged["loss"] == pytest.approx(metrics["loss"], abs=1e-4)
    print(f"lengths {lengths}, max weight change {step:.3e}, max difference {worst:.3e}")
