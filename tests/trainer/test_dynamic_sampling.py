"""`zero_variance_groups`: 'resample' (DAPO's dynamic sampling) in real tiny training runs, and 'skip' / 'train'.

The reward used here makes the kept batch exact: a prompt whose answer starts with 0-4 is saturated (every completion
gets 1.0: a zero-variance group), any other gets each completion's position in the reward call (0, 1, 2, ...: its
group's rewards always differ). So which groups are kept depends only on the prompts, never on the sampled text.
"""

import copy
import logging
import math

import pytest
import torch
from transformers import TrainerCallback

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from grpo_trainer.data.sampler import PromptDraws, RepeatSampler


def saturated(answer: str) -> bool:
    return answer[0] in "01234"


def split_reward(completions, answer, **kwargs):
    return [1.0 if saturated(a) else float(i) for i, a in enumerate(answer)]


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=4, learning_rate=0.01, max_steps=3, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0, disable_tqdm=True, zero_variance_groups="resample")
    settings.update(overrides)
    return GRPOConfig(**settings)


class KeptRounds:
    """Records the prompts (by answer) of every round `RoundBuilder.build` returns, one list of G-row groups per
    round, and the rounds themselves."""

    def __init__(self, trainer, dataset, tokenizer):
        self.answers, self.rounds = [], []
        by_prompt = {row["prompt"]: row["answer"] for row in dataset}
        build = trainer.rounds.build
        G = trainer.args.num_generations

        def recording(batch, mode, policy, state):
            round_, log = build(batch, mode, policy, state)
            if mode == "train":
                texts = tokenizer.batch_decode(round_.prompt_ids, skip_special_tokens=True)
                self.answers.append([by_prompt[texts[i]] for i in range(0, len(texts), G)])
                self.rounds.append(round_)
            return round_, log

        trainer.rounds.build = recording


def _expected_kept_answers(dataset, args, steps: int) -> list[list[str]]:
    """The kept groups by the rules of `trainer.resample` for one process: the main sampler's round, each saturated
    place filled in order by the first unused informative prompt of the extra-prompt stream, an extra round drawing
    ceil(empty places / informative share so far) prompts (at least 1, at most the round's groups)."""
    P = args.per_device_train_batch_size // args.num_generations
    order = list(RepeatSampler(dataset, 1, batch_size=P, shuffle=True, seed=args.seed))
    draws = PromptDraws(len(dataset), args.seed)
    kept = []
    for step in range(steps):
        answers = [dataset[i]["answer"] for i in order[step * P:(step + 1) * P]]
        seen, informative = P, sum(not saturated(a) for a in answers)
        extra = 0
        while any(saturated(a) for a in answers) and extra < args.max_resample_rounds:
            empty = [p for p, a in enumerate(answers) if saturated(a)]
            count = P if informative == 0 else min(max(math.ceil(len(empty) / (informative / seen)), 1), P)
            fresh = [dataset[i]["answer"] for i in draws.draw(count)]
            extra, seen, informative = extra + 1, seen + count, informative + sum(not saturated(a) for a in fresh)
            useful = [a for a in fresh if not saturated(a)]
            for p in empty[:len(useful)]:
                answers[p] = useful.pop(0)
        kept.append(answers)
    return kept


def test_a_deterministic_reward_gives_an_exact_repeatable_kept_batch(tmp_path, tokenizer):
    dataset = copy_digits_dataset(num_prompts=24, seed=4)
    runs = []
    for name in ("a", "b"):
        args = _args(tmp_path / name)
        trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=7), split_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        kept = KeptRounds(trainer, dataset, tokenizer)
        trainer.train()
        runs.append(kept.answers)
    expected = _expected_kept_answers(dataset, args, 3)
    assert runs[0] == runs[1] == expected
    assert all(not saturated(a) for answers in expected for a in answers)
    main_round = [dataset[i]["answer"] for i in list(RepeatSampler(dataset, 1, batch_size=2, seed=0))[:6]]
    assert any(saturated(a) for a in main_round)  # the test exercises replacement


def test_a_constant_reward_hits_the_cap_warns_and_trains_on(tmp_path, tokenizer, toy_dataset, caplog):
    trainer = GRPOTrainer(make_tiny_model(tokenizer), constant_reward, args=_args(tmp_path, max_resample_rounds=2),
                          train_dataset=toy_dataset, processing_class=tokenizer)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        trainer.train()
    assert trainer.state.global_step == 3
    logs = [e for e in trainer.state.log_history if "zero_variance_groups/extra_rounds" in e]
    assert len(logs) == 3
    for entry in logs:
        # 2 prompts per round; nothing is ever informative, so each of the 2 extra rounds is a full round of 2
        assert entry["zero_variance_groups/extra_rounds"] == 2
        assert entry["zero_variance_groups/prompts_generated"] == 6
        assert entry["zero_variance_groups/kept"] == 2 and entry["zero_variance_groups/fraction"] == 1.0
        assert entry["frac_reward_zero_std"] == 1.0
    assert caplog.text.count("2 of 2 groups still have equal rewards after 2 extra generation rounds") == 3


class _GradientsBeforeStep(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = [p.grad.detach().clone() for p in self.model.parameters()]


def _reference_loss_and_grads(model, round_, temperature):
    """The dapo loss of a whole round on-policy, written out: ratio exp(logp - logp.detach()) = 1, so the loss is
    -sum_i A_i sum_t ratio_it / N, N the round's completion tokens; its gradient -sum_i A_i sum_t grad logp_it / N."""
    input_ids = torch.cat([round_.prompt_ids, round_.completion_ids], 1)
    attention = torch.cat([round_.prompt_mask, round_.completion_mask], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    T = round_.completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits[:, -T - 1:-1]
    logps = torch.log_softmax(logits.float() / temperature, -1).gather(-1, round_.completion_ids[..., None])[..., 0]
    mask = round_.completion_mask.float()
    ratio = torch.exp(logps - logps.detach())
    loss = -(round_.advantages[:, None] * ratio * mask).sum() / mask.sum()
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_the_loss_is_the_reference_loss_on_the_kept_groups(tmp_path, tokenizer, accumulation):
    """One optimizer step over a resampled round of 4 groups (steps_per_generation = gradient_accumulation_steps, so
    the round is cut into that many micro-batches): the summed micro-batch losses and the accumulated gradients
    equal the dapo loss of the kept round as a whole, normalised by its own token count."""
    dataset = copy_digits_dataset(num_prompts=24, seed=4)
    model = make_tiny_model(tokenizer, seed=5)
    initial = copy.deepcopy(model)
    args = _args(tmp_path, per_device_train_batch_size=16 // accumulation, gradient_accumulation_steps=accumulation,
                 max_steps=1, max_grad_norm=0.0, temperature=0.9)
    trainer = GRPOTrainer(model, split_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    kept = KeptRounds(trainer, dataset, tokenizer)
    grads = _GradientsBeforeStep(trainer.model)
    trainer.add_callback(grads)
    losses = []
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: losses.append(compute_loss(*a, **k)) or losses[-1]
    trainer.train()
    round_ = kept.rounds[0]
    assert all(not saturated(a) for a in kept.answers[0]) and len(kept.answers[0]) == 4
    assert trainer.state.log_history[0]["zero_variance_groups/extra_rounds"] >= 1  # groups were replaced
    assert len(losses) == accumulation
    loss, reference = _reference_loss_and_grads(initial, round_, 0.9)
    torch.testing.assert_close(sum(losses).detach(), loss, atol=1e-6, rtol=1e-5)
    for got, want in zip(grads.grads, reference):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_resume_draws_the_same_extra_prompts(tmp_path, tokenizer):
    """A run interrupted after step 2 and resumed trains on the same kept rounds at steps 3 and 4 as the run that
    was not interrupted: the extra-prompt stream's position is in the checkpoint."""
    dataset = copy_digits_dataset(num_prompts=24, seed=4)
    constant = {"lr_scheduler_type": "constant"}  # the same learning rate whatever max_steps says
    whole = GRPOTrainer(make_tiny_model(tokenizer, seed=7), split_reward,
                        args=_args(tmp_path / "whole", max_steps=4, **constant), train_dataset=dataset,
                        processing_class=tokenizer)
    uninterrupted = KeptRounds(whole, dataset, tokenizer)
    whole.train()
    first = GRPOTrainer(make_tiny_model(tokenizer, seed=7), split_reward,
                        args=_args(tmp_path / "parts", max_steps=2, save_strategy="steps", save_steps=2, **constant),
                        train_dataset=dataset, processing_class=tokenizer)
    first.train()
    second = GRPOTrainer(make_tiny_model(tokenizer, seed=7), split_reward,
                         args=_args(tmp_path / "parts", max_steps=4, **constant), train_dataset=dataset,
                         processing_class=tokenizer)
    resumed = KeptRounds(second, dataset, tokenizer)
    second.train(resume_from_checkpoint=str(tmp_path / "parts" / "checkpoint-2"))
    assert resumed.answers == uninterrupted.answers[2:]
    for got, want in zip(resumed.rounds, uninterrupted.rounds[2:]):
        assert torch.equal(got.completion_ids, want.completion_ids)
    assert second.rounds.resampler.state_dict() == whole.rounds.resampler.state_dict()


def test_resample_needs_a_dataset_it_can_index(tmp_path, tokenizer, toy_dataset):
    with pytest.raises(ValueError, match="draws its extra prompts from train_dataset by index"):
        GRPOTrainer(make_tiny_model(tokenizer), split_reward, args=_args(tmp_path),
                    train_dataset=toy_dataset.to_iterable_dataset(), processing_class=tokenizer)
