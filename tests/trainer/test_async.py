"""Asynchronous rollouts (`async_rollouts`, `trainer.producer`): round n + k is sampled with the weights of step n on
a producer thread, deterministically, resumably, with the off-policy correction chosen, and refused where unsafe.
Real tiny training runs on the copy task."""

import copy
import dataclasses
import hashlib
import random
import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from transformers import TrainerCallback

from grpo_trainer.cli.toy import copy_digits_reward, make_tiny_model
from grpo_trainer.rewards.scoring import RewardError
from grpo_trainer.trainer import parts, round_builder
from grpo_trainer.trainer.producer import ProducerError, round_seed
from tests.helpers import TWO_GROUPS_OF_4, make_trainer

# What these runs were written with (the copy-task builder's settings): 4 completion tokens, lr 0.01, the tiny
# model of seed 7.
COPY_TASK = dict(max_completion_length=4, learning_rate=0.01)


def _digest(model) -> str:
    values = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha1(values.numpy().tobytes()).hexdigest()


class WeightLog(TrainerCallback):
    """The weights' digest after each optimizer step (version v = the weights after v steps)."""

    def __init__(self, model):
        self.model, self.versions = model, {0: _digest(model)}

    def on_step_end(self, args, state, control, **kwargs):
        self.versions[state.global_step] = _digest(self.model)


@pytest.fixture
def sampled_log(monkeypatch):
    """Every round `RoundBuilder.sample` makes: (version, the digest of the weights it sampled with, the
    completions' token ids)."""
    log = []
    sample = round_builder.RoundBuilder.sample

    def recording(self, batch, mode, policy, state):
        with policy.for_generation() as model:
            weights = _digest(model)
        out = sample(self, batch, mode, policy, state)
        log.append((policy.version, weights, out.rollout.completion_ids.clone()))
        return out

    monkeypatch.setattr(round_builder.RoundBuilder, "sample", recording)
    return log


def _run(tmp_path, tokenizer, dataset, reward=None, **overrides):
    settings = dict(async_rollouts=1, max_steps=4, **TWO_GROUPS_OF_4, max_completion_length=6, learning_rate=0.05)
    settings.update(overrides)
    trainer = make_trainer(tmp_path, tokenizer, dataset, reward, make_tiny_model(tokenizer, seed=7), **settings)
    weights = WeightLog(trainer.model)
    trainer.add_callback(weights)
    trainer.train()
    return trainer, weights


def jittery_reward(completions, **kwargs):
    """The copy reward after a random pause (not seeded): the producer's timing differs from run to run."""
    time.sleep(random.random() * 0.05)
    return copy_digits_reward(completions, **kwargs)


@pytest.mark.parametrize("backend", ["fast", "generate"])
def test_round_n_plus_1_is_sampled_with_the_weights_of_step_n(tmp_path, tokenizer, toy_dataset, sampled_log,
                                                              backend):
    trainer, weights = _run(tmp_path, tokenizer, toy_dataset, generation_backend=backend)
    # round 0 is sampled before any step (version 0); round r + 1 while round r trains, with the weights after r
    # steps; the run of 4 steps samples no round past its last
    assert [version for version, _, _ in sampled_log] == [0, 0, 1, 2]
    for version, digest, _ in sampled_log:
        assert digest == weights.versions[version]
    staleness = [row["async/staleness"] for row in trainer.state.log_history if "async/staleness" in row]
    assert staleness == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("backend", ["fast", "generate"])
def test_the_same_seed_gives_the_same_run_whatever_the_timing(tmp_path, tokenizer, toy_dataset, sampled_log,
                                                              backend):
    first, _ = _run(tmp_path / "a", tokenizer, toy_dataset, jittery_reward, generation_backend=backend)
    rounds_a = [ids for _, _, ids in sampled_log]
    sampled_log.clear()
    second, _ = _run(tmp_path / "b", tokenizer, toy_dataset, jittery_reward, generation_backend=backend)
    rounds_b = [ids for _, _, ids in sampled_log]
    assert len(rounds_a) == 4 and all(torch.equal(a, b) for a, b in zip(rounds_a, rounds_b))
    assert _digest(first.model) == _digest(second.model)
    # and the rounds are not all alike: each has its own sampling seed
    assert round_seed(0, 1) != round_seed(0, 2) and not torch.equal(rounds_a[1], rounds_a[2])


def test_two_rounds_ahead_are_at_most_two_steps_stale(tmp_path, tokenizer, toy_dataset, sampled_log):
    trainer, weights = _run(tmp_path, tokenizer, toy_dataset, async_rollouts=2, max_steps=5)
    # rounds 0, 1 and 2 go out before step 0 (version 0); round r + 2 at the start of round r
    assert [version for version, _, _ in sampled_log] == [0, 0, 0, 1, 2]
    assert [digest for _, digest, _ in sampled_log] == [weights.versions[v] for v, _, _ in sampled_log]
    assert max(row["async/staleness_max"] for row in trainer.state.log_history if "async/staleness_max" in row) == 2


def test_behaviour_mode_takes_the_samplers_log_probs_as_the_old_ones(tmp_path, tokenizer, toy_dataset,
                                                                    monkeypatch):
    prepared = []
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7), **COPY_TASK,
                           **TWO_GROUPS_OF_4, async_rollouts=1, async_correction="behaviour", max_steps=2)
    finish = trainer.source.builder.finish

    def finishing(sampled, mode, policy, state):
        round_, log = finish(sampled, mode, policy, state)
        prepared.append((sampled.rollout.sampler.logps.clone(), round_))
        return round_, log

    monkeypatch.setattr(trainer.source.builder, "finish", finishing)
    trainer.train()
    behaviour, _ = prepared[1]
    served = trainer.buffer.parts[0]  # round 1's micro-batch, trimmed
    width = served.completion_ids.shape[1]
    assert served.token_weights is None and not served.sampler.exact
    assert torch.equal(served.old_logps, behaviour[:, :width])


def test_recompute_mode_weighs_old_against_behaviour_with_the_truncation(tmp_path, tokenizer, toy_dataset):
    """'recompute': old log-probs under the round's start weights (the weights after step r for round r + 1), and a
    token-level truncated weight min(exp(old - behaviour), 3) (vllm_importance_sampling_mode='token_truncate')."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7), **COPY_TASK,
                           **TWO_GROUPS_OF_4, async_rollouts=1, max_steps=2, async_correction="recompute",
                           vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0)
    trainer.train()
    served = trainer.buffer.parts[0]  # round 1: sampled with the weights after step 0, trained at step 1
    with torch.no_grad():
        recomputed = trainer.scorer.no_grad_logps(trainer.model, dataclasses.replace(
            served, old_logps=None, token_weights=None))
    # the model has since taken step 1: the old log-probs are those of the weights the round started with, which a
    # recomputation now does not reproduce; the ratio is rebuilt from the round's own old and behaviour values
    mask = served.loss_mask.bool()
    expected = torch.exp(served.old_logps - served.sampler.logps).clamp(max=3.0)
    torch.testing.assert_close(served.token_weights[mask], expected[mask], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(recomputed[mask], served.old_logps[mask])
    logged = trainer.state.log_history[1]
    assert {"async/importance_ratio_raw_mean", "async/importance_ratio_raw_min",
            "async/importance_ratio_raw_max", "sampling/importance_sampling_ratio/mean"} <= set(logged)
    assert logged["async/importance_ratio_raw_min"] <= logged["async/importance_ratio_raw_mean"] \
        <= logged["async/importance_ratio_raw_max"]


def test_recompute_mode_old_log_probs_are_a_forward_at_the_rounds_start_weights(tmp_path, tokenizer, toy_dataset):
    """'recompute' is named for one property: round 1 (sampled with the weights after 0 steps) gets old log-probs
    from the weights it starts training with (after 1 step). Checked against an independent forward of a copy of the
    model holding those weights, and shown to differ from the sampling weights' forward, so old log-probs taken under
    the wrong weights fail here."""
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model = make_tiny_model(tokenizer, seed=7)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **COPY_TASK, **TWO_GROUPS_OF_4,
                           async_rollouts=1, max_steps=2, async_correction="recompute", callbacks=[Snapshot()])
    trainer.train()
    served = trainer.buffer.parts[0]  # round 1's micro-batch, trained at step 1
    unscored = dataclasses.replace(served, old_logps=None, token_weights=None)
    mask = served.loss_mask.bool()

    def forward_at(weights):
        frozen = copy.deepcopy(trainer.model)
        frozen.load_state_dict(weights)
        frozen.eval()
        with torch.no_grad():
            return trainer.scorer.no_grad_logps(frozen, unscored)

    torch.testing.assert_close(served.old_logps[mask], forward_at(snapshots[1])[mask], rtol=1e-5, atol=1e-5)
    at_sampling = forward_at(initial)[mask]  # the behaviour weights: what a wrong recomputation would have used
    assert (at_sampling - served.old_logps[mask]).abs().max() > 1e-3


def test_no_optimizer_step_runs_while_an_in_process_round_is_sampled(tmp_path, tokenizer, toy_dataset, monkeypatch):
    """`drain`: an in-process backend reads the live weights, so each optimizer step waits for the round in flight.
    A slow reward keeps every job running longer than a training step: without the drain (the negative control,
    `drain` made a no-op) a step lands inside a job; with it, none does."""
    from grpo_trainer.trainer.producer import RoundProducer

    def slow_reward(completions, **kwargs):
        time.sleep(0.25)
        return copy_digits_reward(completions, **kwargs)

    def overlaps(tmp):
        jobs, steps = [], []
        sample = round_builder.RoundBuilder.sample

        def timed(self, batch, mode, policy, state):
            started = time.perf_counter()
            out = sample(self, batch, mode, policy, state)
            jobs.append((started, time.perf_counter()))
            return out

        # the optimizer's own step, timed by torch's global step hooks (callbacks would run beside the drain's)
        before = register_optimizer_step_pre_hook(lambda *_: steps.append([time.perf_counter(), None]))
        after = register_optimizer_step_post_hook(lambda *_: steps[-1].__setitem__(1, time.perf_counter()))
        try:
            with monkeypatch.context() as patch:
                patch.setattr(round_builder.RoundBuilder, "sample", timed)
                _run(tmp, tokenizer, toy_dataset, slow_reward, max_steps=3)
        finally:
            before.remove()
            after.remove()
        assert len(jobs) == 3 and len(steps) == 3
        return [(s, j) for s in steps for j in jobs if s[0] < j[1] and j[0] < s[1]]

    assert overlaps(tmp_path / "drained") == []
    with monkeypatch.context() as patch:
        patch.setattr(RoundProducer, "drain", lambda self: None)
        assert overlaps(tmp_path / "undrained")  # the check sees an undrained step


@pytest.mark.parametrize("overrides", [{}, {"num_iterations": 2, "steps_per_generation": 2}])
def test_two_steps_save_resume_two_steps_equals_four_straight(tmp_path, tokenizer, toy_dataset, sampled_log,
                                                              overrides):
    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2 or control.should_training_stop

    def run(output_dir, stop=False, resume=None):
        torch.manual_seed(123)
        trainer = make_trainer(output_dir, tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7),
                               **TWO_GROUPS_OF_4, max_completion_length=4, learning_rate=0.05, async_rollouts=1,
                               max_steps=4, save_strategy="steps", save_steps=2, **overrides)
        if stop:
            trainer.add_callback(StopAt())
        trainer.train(resume_from_checkpoint=resume)
        return _digest(trainer.model)

    straight = run(tmp_path / "straight")
    straight_rounds = [ids for _, _, ids in sampled_log]
    sampled_log.clear()
    run(tmp_path / "split", stop=True)
    resumed = run(tmp_path / "split", resume=True)
    split_rounds = [ids for _, _, ids in sampled_log]
    assert resumed == straight
    # the round sampled ahead before the save came from the checkpoint: no round was sampled twice
    assert len(split_rounds) == len(straight_rounds)
    assert all(torch.equal(a, b) for a, b in zip(split_rounds, straight_rounds))


def test_a_producer_failure_surfaces_on_the_main_thread_with_its_round(tmp_path, tokenizer, toy_dataset):
    def fails_on_round_2(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:  # round 2 is submitted at the start of round 1
            raise KeyError("the judge's answer had no 'score'")
        return copy_digits_reward(completions, **kwargs)

    failed = r"sampling round 2 on the producer thread failed: RewardError: reward function 'fails_on_round_2'"
    with pytest.raises(ProducerError, match=failed) as raised:
        _run(tmp_path, tokenizer, toy_dataset, fails_on_round_2)
    assert isinstance(raised.value.__cause__, RewardError)  # the original error and its traceback, chained
    assert "KeyError" in str(raised.value.__cause__) and raised.value.__cause__.__traceback__ is not None


def test_a_round_past_the_time_limit_stops_the_run(tmp_path, tokenizer, toy_dataset):
    def slow_after_round_1(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 1:
            time.sleep(3)
        return copy_digits_reward(completions, **kwargs)

    started = time.monotonic()
    with pytest.raises(ProducerError, match="took more than async_rollout_timeout=0.5 s"):
        _run(tmp_path, tokenizer, toy_dataset, slow_after_round_1, async_rollout_timeout=0.5)
    assert time.monotonic() - started < 60


def test_the_producer_thread_ends_with_the_run(tmp_path, tokenizer, toy_dataset):
    trainer, _ = _run(tmp_path, tokenizer, toy_dataset, max_steps=2)
    thread = trainer.source.producer._thread
    assert thread.daemon and not thread.is_alive()


def test_unsafe_combinations_are_refused_before_any_model_loads(tmp_path, tokenizer, toy_dataset, monkeypatch):
    from datasets import IterableDataset

    from grpo_trainer import GRPOConfig
    from grpo_trainer.runtime import models

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))

    def trainer(dataset=toy_dataset, **settings):
        return make_trainer(tmp_path, tokenizer, dataset, model="unused-model-id", async_rollouts=1, **settings)

    with pytest.raises(ValueError, match="a rollout_func receives the trainer"):
        trainer(rollout_func=lambda prompts, trainer: None)
    stream = IterableDataset.from_generator(lambda: iter(toy_dataset))
    with pytest.raises(ValueError, match="a streamed train_dataset cannot be read rounds ahead"):
        trainer(stream)
    with pytest.raises(ValueError, match="continuous batching switches the model between train and eval"):
        trainer(use_transformers_continuous_batching=True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="which FSDP shards.*vllm_mode='server'"):
        trainer()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    # A vLLM server's refusals come before the backend is built, which would contact the server (none listens at
    # this port: building the backend first would wait for it, then fail on the connection instead)
    monkeypatch.setattr("grpo_trainer.rollout.vllm.server.wait_for_server",
                        lambda *a, **k: pytest.fail("the server was contacted before the refusal"))
    with pytest.raises(ValueError, match="sampling_mismatch_report compares the sampler's log-probs"):
        trainer(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9",
                sampling_mismatch_report=True)
    with pytest.raises(ValueError, match="async_rollouts must be an integer >= 0"):
        GRPOConfig(output_dir=str(tmp_path), async_rollouts=-1, report_to="none")
    with pytest.raises(ValueError, match="async_correction must be 'recompute' or 'behaviour'"):
        GRPOConfig(output_dir=str(tmp_path), async_correction="new", report_to="none")


def test_active_dropout_is_refused_with_an_in_process_backend(tmp_path, tokenizer, toy_dataset):
    model = make_tiny_model(tokenizer)
    model.model.layers[0].mlp.extra = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"needs dropout off, but model\.layers\.0\.mlp\.extra drops"):
        make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **COPY_TASK, async_rollouts=1)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **COPY_TASK, async_rollouts=1,
                           disable_dropout=True)
    assert trainer.model.model.layers[0].mlp.extra.p == 0.0
    model.model.layers[1].self_attn.attention_dropout = 0.1  # Qwen2's attention dropout, a float the forward reads
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn drops with p > 0"):
        make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **COPY_TASK, async_rollouts=1, disable_dropout=True)


def test_one_round_source_interface_for_both_schedules(tmp_path, tokenizer, toy_dataset):
    """The trainer takes rounds from a `RoundSource`: the synchronous one samples nothing ahead and checkpoints the
    buffer alone; the asynchronous one checkpoints the rounds it sampled ahead beside it, and paces the optimizer."""
    from grpo_trainer.trainer.producer import AsyncRounds, ProducerPacing
    from grpo_trainer.trainer.source import SyncRounds

    plain = make_trainer(tmp_path / "sync", tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7),
                         **COPY_TASK, **TWO_GROUPS_OF_4, max_steps=1)
    ahead = make_trainer(tmp_path / "async", tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=7),
                         **COPY_TASK, **TWO_GROUPS_OF_4, async_rollouts=1, max_steps=1)
    assert isinstance(plain.source, SyncRounds) and plain.source.callbacks() == []
    assert plain.source.sampled_ahead(parts.source_settings(plain.args, plain.launch)) == (0, None)
    assert not plain.buffer.schedule.rounds_ahead
    assert isinstance(ahead.source, AsyncRounds)
    assert ahead.source.sampled_ahead(parts.source_settings(ahead.args, ahead.launch)) == (1, "behaviour")
    assert any(isinstance(c, ProducerPacing) for c in ahead.callback_handler.callbacks)
    plain.train()
    ahead.train()
    assert plain.run_parts.state_dict().keys() == {"buffer", "micro_step"}
    state = ahead.run_parts.state_dict()
    # max_steps=1: round 0 trained, round 1 never submitted (past the run's last round)
    assert state.keys() == {"buffer", "micro_step", "producer"} and state["producer"]["done"] == {}


def test_every_async_refusal_fires_alone_by_its_name():
    """Each row of `trainer.producer.REFUSALS` on facts that break it alone; none with async_rollouts=0."""
    import dataclasses

    from grpo_trainer.config.refusals import first
    from grpo_trainer.rollout.backend import CONTINUOUS_BATCHING
    from grpo_trainer.runtime.distributed import Launch
    from grpo_trainer.trainer.producer import REFUSALS, AsyncFacts
    from grpo_trainer.trainer.source import SourceSettings

    fine = AsyncFacts(SourceSettings(rounds_ahead=1), "fast", own_weights=False, streamed=False, rollout_func=False)
    engine = dataclasses.replace(fine, backend="vllm", own_weights=True)
    assert first(REFUSALS, fine) is None and first(REFUSALS, engine) is None

    def settings(**fields):
        return dataclasses.replace(fine.settings, **fields)

    breaking = {
        "rollout_func": dataclasses.replace(fine, rollout_func=True),
        "streamed": dataclasses.replace(fine, streamed=True),
        "continuous_batching": dataclasses.replace(fine, backend=CONTINUOUS_BATCHING),
        "server_processes": dataclasses.replace(engine, settings=settings(vllm_mode="server",
                                                                          launch=Launch(processes=2))),
        "colocated_tensor_parallel": dataclasses.replace(engine, settings=settings(vllm_tensor_parallel_size=2)),
        "in_process_sharded": dataclasses.replace(fine, settings=settings(launch=Launch(processes=2, zero_stage=3))),
        "engine_mismatch_report": dataclasses.replace(engine, settings=settings(mismatch_report=True)),
    }
    assert set(breaking) == {r.name for r in REFUSALS}
    for name, facts in breaking.items():
        refused = first(REFUSALS, facts)
        assert refused is not None and refused.name == name, name
        assert refused.message(facts).startswith("async_rollouts=1 is not supported here: ")
        off = dataclasses.replace(facts, settings=dataclasses.replace(facts.settings, rounds_ahead=0))
        assert first(REFUSALS, off) is None
    fsdp = dataclasses.replace(fine, settings=settings(launch=Launch(processes=2, fsdp=True)))
    assert "FSDP shards" in first(REFUSALS, fsdp).message(fsdp)
