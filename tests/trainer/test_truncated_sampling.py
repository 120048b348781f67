"""Exact log-probs under top-k / top-p sampling (`keep_sampling_mask`) in the trainer: the fast decoder's kept
supports and log-probs against the model's own forward, a scripted engine's supports, the option off, and the
logged kept mass."""

import dataclasses

import pytest
import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.algorithms.truncation import pack, unpack
from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.backend import BACKENDS, RolloutBackend, register_backend
from grpo_trainer.rollout.fast.backend import FastBackend

TRUNCATION = {"top_k": 8, "top_p": 0.9}


def _trainer(tmp_path, tokenizer, dataset, **overrides):
    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 4,
                "max_completion_length": 6, "report_to": "none", "save_strategy": "no", "temperature": 0.9,
                "seed": 0, **TRUNCATION}
    return GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward,
                       args=GRPOConfig(**{**settings, **overrides}), train_dataset=dataset, processing_class=tokenizer)


def _round(trainer, dataset):
    return trainer._generate_and_score([dataset[i // 4] for i in range(8)], "train")


def _forward(trainer, round_):
    """The model's own forward over the round (no rollout values standing in), through the trainer's scorer."""
    plain = dataclasses.replace(round_, sampler=round_.sampler.without_stand_ins()).trimmed()
    with torch.no_grad():
        return trainer.scorer.logps(trainer.model, plain)


def _with_kept(value, mask):
    """`value` (a rollout or a round) whose sampler record holds the kept supports `mask`, nothing standing in."""
    record = value.sampler.without_stand_ins()
    return dataclasses.replace(value, sampler=dataclasses.replace(record, kept=dataclasses.replace(record.kept,
                                                                                                   mask=mask)))


def test_with_the_mask_the_ratio_to_the_sampler_is_one_at_the_first_iteration(tmp_path, tokenizer, toy_dataset):
    """keep_sampling_mask (the default): the decoder returns each position's kept support; the forward at the
    sampling weights scores over it, so exp(trainer - sampler) = 1 on every token: against the log-probs the
    decoder sampled from (`KeptSupports.drawn_logps`) and against the ones it kept for the loss
    (`SamplerRecord.logps`)."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset)
    round_ = _round(trainer, toy_dataset)
    assert round_.sampler.kept.mask is not None and round_.sampler.kept.drawn_logps is not None
    active = round_.completion_mask.bool()
    V = trainer.model.config.vocab_size
    kept = unpack(round_.sampler.kept.mask, V)[active]  # [tokens, V]
    assert (kept.sum(-1) <= 8).all() and (kept.sum(-1) < V).all()  # top_k 8 (then top_p) cut every position
    out = _forward(trainer, round_)
    width = out.logps.shape[1]
    ratio = torch.exp(out.logps - round_.sampler.kept.drawn_logps[:, :width])[active[:, :width]]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.logps[active[:, :width]], round_.sampler.logps[:, :width][active[:, :width]],
                               atol=2e-5, rtol=0)
    # real mass was cut: without the mask the ratio is not 1
    assert (round_.sampler.kept.log_mass[active] < -1e-3).any()


def test_without_the_mask_the_mean_ratio_is_the_mean_kept_mass(tmp_path, tokenizer, toy_dataset):
    """keep_sampling_mask=False (TRL's behaviour): the trainer scores the full softmax, so on every token
    exp(trainer - sampler) = p(a) / (p(a) / p(S)) = p(S), the mass the truncation kept; the mean ratio is the mean
    kept mass (well below 1 here), and the trainer's forward measures that same mass."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, keep_sampling_mask=False)
    round_ = _round(trainer, toy_dataset)
    assert round_.sampler.kept.mask is None  # not needed: the loss scores the full softmax
    active = round_.completion_mask.bool()
    out = _forward(trainer, round_)
    width = out.logps.shape[1]
    on = active[:, :width]
    ratio = torch.exp(out.logps - round_.sampler.kept.drawn_logps[:, :width])[on]
    kept_mass = torch.exp(round_.sampler.kept.log_mass[:, :width])[on]
    assert ratio.mean().item() == pytest.approx(kept_mass.mean().item(), abs=2e-5)
    torch.testing.assert_close(ratio, kept_mass, atol=2e-5, rtol=0)
    assert kept_mass.mean().item() < 0.95
    torch.testing.assert_close(out.log_kept_mass[on], round_.sampler.kept.log_mass[:, :width][on], atol=2e-5, rtol=0)
    # the sampler's values for the loss are the full softmax's, as the loss computes them
    torch.testing.assert_close(out.logps[on], round_.sampler.logps[:, :width][on], atol=2e-5, rtol=0)


class _ScriptedEngine(RolloutBackend):
    """An engine that samples with the fast decoder and returns, as its kept supports, the 3 tokens after each
    sampled token (a support no truncation rule gives), and no log-probs for the loss."""

    capabilities = FastBackend.capabilities

    def generate(self, model, prompts, config, capture=None):
        out = FastBackend().generate(model, prompts, config)
        V = model.config.vocab_size
        ids = out.completion_ids
        kept = torch.zeros(*ids.shape, V, dtype=torch.bool)
        for offset in range(1, 4):
            kept.scatter_(-1, ((ids + offset) % V)[..., None], True)
        out = _with_kept(out, pack(kept))
        return dataclasses.replace(out, sampler=dataclasses.replace(out.sampler, logps=None))


@pytest.fixture
def scripted_engine():
    register_backend("scripted_support")(_ScriptedEngine)
    yield "scripted_support"
    del BACKENDS["scripted_support"]


def test_a_scripted_engines_supports_are_what_every_forward_scores_over(tmp_path, tokenizer, toy_dataset,
                                                                        scripted_engine):
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, generation_backend=scripted_engine)
    round_ = _round(trainer, toy_dataset)
    out = _forward(trainer, round_)
    width = out.logps.shape[1]
    ids = round_.completion_ids[:, :width]
    with torch.no_grad():  # dense reference: the 3 given tokens and the sampled one, tempered softmax over them
        input_ids = torch.cat([round_.prompt_ids, round_.completion_ids], 1)
        attention = torch.cat([round_.prompt_mask, round_.completion_mask], 1)
        logits = trainer.model(input_ids=input_ids, attention_mask=attention,
                               position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
        T = round_.completion_ids.shape[1]
        z = logits[:, -T - 1:-1][:, :width].float() / 0.9
        kept = unpack(round_.sampler.kept.mask[:, :width], z.shape[-1]).scatter(-1, ids[..., None], True)
        expected = torch.log_softmax(z.masked_fill(~kept, -torch.inf), -1).gather(-1, ids[..., None])[..., 0]
    on = round_.completion_mask[:, :width].bool()
    torch.testing.assert_close(out.logps[on], expected[on], atol=2e-5, rtol=0)


def test_the_kept_mass_is_logged_and_training_runs_both_ways(tmp_path, tokenizer, toy_dataset):
    """A few real steps per setting: `sampling/log_kept_mass/mean` is logged (negative: mass was cut), and the
    loss trains on-policy with the decoder's values standing in (with the mask) and off-policy."""
    for name, settings in {"on": {}, "off": {"keep_sampling_mask": False},
                           "off_policy": {"num_iterations": 2}}.items():
        trainer = _trainer(tmp_path / name, tokenizer, toy_dataset, max_steps=2, logging_steps=1, **settings)
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        assert len(logs) == 2
        assert all(e["sampling/log_kept_mass/mean"] < 0 for e in logs), name


def test_the_reference_and_old_log_probs_score_over_the_same_supports(tmp_path, tokenizer, toy_dataset):
    """beta > 0 and off-policy (num_iterations 2): the micro-batch's reference log-probs (the reference model's) and
    old log-probs (the decoder's, standing in) are both over the sampler's kept supports: a dense truncated softmax
    of each model's logits over the round's supports. And any support the round carries is the one used: with the
    3 tokens after each sampled one instead, the reference forward follows it."""
    trainer = _trainer(tmp_path, tokenizer, toy_dataset, beta=0.04, num_iterations=2)
    part = trainer.scorer.prepare(_round(trainer, toy_dataset), "train", trainer.model)
    assert part.sampler.kept.mask is not None and part.ref_logps is not None and part.old_logps is not None
    input_ids = torch.cat([part.prompt_ids, part.completion_ids], 1)
    attention = torch.cat([part.prompt_mask, part.completion_mask], 1)
    T = part.completion_ids.shape[1]
    on = part.completion_mask.bool()

    def dense(model, packed):
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention,
                           position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits[:, -T - 1:-1]
        z = logits.float() / 0.9
        tokens = part.completion_ids[..., None]
        kept = unpack(packed, z.shape[-1]).scatter(-1, tokens, True)
        return torch.log_softmax(z.masked_fill(~kept, -torch.inf), -1).gather(-1, tokens)[..., 0]

    reference, old = dense(trainer.ref_model, part.sampler.kept.mask), dense(trainer.model, part.sampler.kept.mask)
    torch.testing.assert_close(part.ref_logps[on], reference[on], atol=2e-5, rtol=0)
    torch.testing.assert_close(part.old_logps[on], old[on], atol=2e-5, rtol=0)
    V = trainer.model.config.vocab_size
    other = torch.zeros(*part.completion_ids.shape, V, dtype=torch.bool)
    for offset in range(1, 4):
        other.scatter_(-1, ((part.completion_ids + offset) % V)[..., None], True)
    other = pack(other)
    with torch.no_grad():
        ref = trainer.scorer.no_grad_logps(trainer.ref_model, _with_kept(part, other))
    torch.testing.assert_close(ref[on], dense(trainer.ref_model, other)[on], atol=2e-5, rtol=0)
    assert (ref[on] - part.ref_logps[on]).abs().max() > 0.1
