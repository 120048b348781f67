"""`routing_replay` in real tiny training runs of Mixture-of-Experts models: the mismatch report catches a sampler
whose routers choose other experts and replay removes it (b); replay reaches every forward of the round (old,
reference, policy; checkpointed; packed); the routers train; 'on' is refused where it cannot run; resume."""

import contextlib

import pytest
import torch

from grpo_trainer.modeling import routing
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.backend import BACKENDS, register_backend
from grpo_trainer.rollout.fast.forward import ForwardBackend
from tests.helpers import StopAt, make_args, make_trainer, train_and_compare, varied_reward
from tests.toy_lengths import LogNormalLengths, install_lengths
from tests.trainer.test_model_options import moe_model


class _NoisyRouters(ForwardBackend):
    """The forward tier with routers that break near-ties another way, as an engine's top-k kernel in another
    precision does: each router picks its top k of logits + noise (std 0.3), and weighs them by its family's rule
    from its true logits. Only the choice of experts differs from the trainer's forward."""

    def generate(self, model, prompts, config, capture=None):
        lm = causal_lm(model)
        rule = routing.moe_family(lm)
        generator = torch.Generator().manual_seed(0)

        def noisy(module, args, output):
            logits, _, own = output
            noise = 0.3 * torch.randn(logits.shape, generator=generator).to(logits.device)
            chosen = torch.topk(logits.float() + noise, own.shape[-1], dim=-1).indices
            return logits, rule(logits, chosen), chosen

        # prepended: the capture's hooks, registered before this rollout, see the experts actually used
        handles = [r.module.register_forward_hook(noisy, prepend=True) for r in routing.find_routers(lm)]
        try:
            return super().generate(model, prompts, config, capture)
        finally:
            for handle in handles:
                handle.remove()


@pytest.fixture
def noisy_routers():
    register_backend("noisy_routers")(_NoisyRouters)
    yield
    del BACKENDS["noisy_routers"]


@contextlib.contextmanager
def replay_calls():
    """Every `routing.replaying` call of the run (the real function runs): (grad enabled, routes shape, packed)."""
    calls, real = [], routing.replaying

    @contextlib.contextmanager
    def spy(lm, routes, layout=None, stats=None):
        calls.append((torch.is_grad_enabled(), tuple(routes.shape), layout is not None))
        with real(lm, routes, layout, stats):
            yield

    routing.replaying = spy
    try:
        yield calls
    finally:
        routing.replaying = real


def _mismatch(tmp_path, tokenizer, toy_dataset, replay: str) -> list[float]:
    trainer = make_trainer(tmp_path / replay, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer),
                           generation_backend="noisy_routers", routing_replay=replay, sampling_mismatch_report=True,
                           per_device_train_batch_size=8, num_generations=4, max_steps=2, learning_rate=0.0)
    trainer.train()
    reports = sorted((tmp_path / replay / "sampling_mismatch").glob("*.json"))
    assert reports
    flips = [e["sampling/routing_flipped_fraction"] for e in trainer.state.log_history
             if "sampling/routing_flipped_fraction" in e]
    assert len(flips) == (2 if replay == "on" else 0)  # logged where replay runs
    assert all(0.1 < f <= 1.0 for f in flips), flips  # measured 0.79-0.81: this model's logits are small
    return [e["sampling/sampling_logp_difference/mean"] for e in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in e]


def test_mismatch_report_catches_flipped_routes_and_replay_removes_them(tmp_path, tokenizer, toy_dataset,
                                                                        noisy_routers):
    """(b) The sampler's routers choose other experts for some tokens: without replay the trainer's log-probs at the
    sampling weights differ from the sampler's by far more than float rounding, and the report says so; with replay
    the trainer routes as the sampler did and the difference is rounding (the KV-cache decode's summation order).
    The report then counts the routes replay changed (`sampling/routing_flipped_fraction`)."""
    off = _mismatch(tmp_path, tokenizer, toy_dataset, "off")
    on = _mismatch(tmp_path, tokenizer, toy_dataset, "on")
    assert min(off) > 1e-4, off  # measured 3.0e-4 on this model (hidden 16, 4 experts): routes flipped
    assert max(on) < 1e-6, on  # measured 9e-8: float32 rounding
    assert max(on) * 100 < min(off)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_training_with_replay_trains_every_parameter_routers_included(tmp_path, tokenizer, toy_dataset, kind):
    """Replay in every forward of the round: the reference model's (beta), the old log-probs' (num_iterations 2,
    the generate backend keeps no sampler log-probs, so the old ones are a forward), and the policy's with its
    gradient under activation checkpointing (on by default). Finite loss; every parameter, router weights included,
    moves."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer, kind),
                           routing_replay="on", beta=0.1, num_iterations=2, generation_backend="generate",
                           max_steps=4)
    assert trainer.rounds.settings.routing_replay
    assert trainer.args.gradient_checkpointing
    with replay_calls() as calls:
        changed = train_and_compare(trainer)
    assert [n for n, moved in changed.items() if not moved] == []
    no_grad = [c for c in calls if not c[0]]
    with_grad = [c for c in calls if c[0]]
    # per round (2 of them): reference + old log-probs without grad, 2 iterations of the policy with it
    assert len(no_grad) == 4 and len(with_grad) == 4, calls
    assert all(shape[2:] == (2, 2) for _, shape, _ in calls)


def test_packed_forwards_replay_the_routes_in_the_packed_order(tmp_path, tokenizer, toy_dataset):
    """padding_free (no aux loss, which refuses packing): the forwards run packed, with the routes gathered into
    the packed layout; the run trains."""
    model = moe_model(tokenizer)
    install_lengths(model, LogNormalLengths(maximum=12, median=3, sigma=0.8, minimum=1))  # ragged completions
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, model, routing_replay="on",
                           router_aux_loss_coef=0.0, padding_free=True, beta=0.1, max_completion_length=12,
                           per_device_train_batch_size=8, num_generations=4)
    with replay_calls() as calls:
        changed = train_and_compare(trainer)
    assert any(packed for _, _, packed in calls), calls
    assert any(moved for n, moved in changed.items() if "gate" in n)


def test_auto_is_on_for_a_moe_model_and_off_for_a_dense_one(tmp_path, tokenizer, toy_dataset, tiny_model):
    assert make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer)).rounds.settings \
        .routing_replay
    assert not make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model).rounds.settings \
        .routing_replay
    off = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer), routing_replay="off")
    assert not off.rounds.settings.routing_replay


def test_on_is_refused_for_a_dense_model_by_name(tmp_path, tokenizer, toy_dataset, tiny_model):
    with pytest.raises(ValueError, match="routing_replay='on' but .*model_type 'qwen2'.* is not a Mixture-of-Experts"):
        make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, tiny_model, routing_replay="on")


@pytest.mark.parametrize("engine", [{"use_vllm": True}, {"use_transformers_continuous_batching": True}])
def test_on_is_refused_where_the_rollout_runs_outside_the_process(tmp_path, engine):
    with pytest.raises(ValueError, match="routing_replay='on' needs the rollout's routing"):
        make_args(tmp_path, routing_replay="on", **engine)
    with pytest.raises(ValueError, match="routing_replay must be 'auto', 'on' or 'off'"):
        make_args(tmp_path, routing_replay="yes")


def _run_to(output_dir, tokenizer, dataset, stop_at, resume=None):
    model = moe_model(tokenizer)
    torch.manual_seed(123)
    trainer = make_trainer(output_dir, tokenizer, dataset, varied_reward, model, routing_replay="on", max_steps=4,
                           learning_rate=0.01, save_strategy="steps", save_steps=2, num_iterations=2,
                           steps_per_generation=2, generation_backend="generate")
    trainer.add_callback(StopAt(stop_at))
    with replay_calls() as calls:
        trainer.train(resume_from_checkpoint=resume)
    assert calls
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_resume_with_replay_equals_an_uninterrupted_run(tmp_path, tokenizer, toy_dataset):
    """(d) Saved at step 2, in the middle of a round (num_iterations 2), and resumed: the round buffer's rounds keep
    their routes through the checkpoint, and the weights at step 4 are the uninterrupted run's."""
    straight = _run_to(tmp_path / "straight", tokenizer, toy_dataset, 4)
    _run_to(tmp_path / "split", tokenizer, toy_dataset, 2)
    resumed = _run_to(tmp_path / "split", tokenizer, toy_dataset, 4, resume=True)
    worst = max((straight[n] - resumed[n]).abs().max().item() for n in straight)
    assert worst <= 1e-6


def test_auto_is_off_with_a_warning_where_the_rollout_runs_outside_the_process(tmp_path, tokenizer, caplog):
    from grpo_trainer.config.settings import routing_replay

    args = make_args(tmp_path, use_transformers_continuous_batching=True)
    with caplog.at_level("WARNING"):
        assert not routing_replay(args, moe_model(tokenizer))
    assert "routing_replay='auto' is off for this Mixture-of-Experts model" in caplog.text
    assert routing_replay(make_args(tmp_path), moe_model(tokenizer))


def test_asynchronous_rounds_record_on_the_producer_thread_and_replay_on_the_trainers(tmp_path, tokenizer,
                                                                                      toy_dataset):
    """async_rollouts=1: a producer thread samples the next round with the model the main thread trains. Hooks act
    only in the thread that registered them, so the producer records its own rollouts (every round carries routes)
    and the trainer's replay never reaches the producer's forwards; the run trains, routers included."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer), routing_replay="on",
                           async_rollouts=1, max_steps=4, beta=0.1)
    with replay_calls() as calls:
        changed = train_and_compare(trainer)
    assert len([c for c in calls if c[0]]) == 4  # the policy's forward of every step replayed
    assert any(moved for n, moved in changed.items() if "gate" in n)


def test_lora_on_a_partly_dense_qwen2_moe_replays_its_moe_layers(tmp_path, tokenizer, toy_dataset):
    """Qwen2-MoE with a dense middle layer (`mlp_only_layers`) under LoRA: the routes cover the 2 MoE layers (the
    reference is the adapter-disabled policy, replayed too) and the adapters train."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id))
    assert [r.layer for r in routing.find_routers(model)] == [0, 2]
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, model, routing_replay="on", beta=0.1,
                           peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with replay_calls() as calls:
        changed = train_and_compare(trainer)
    assert calls and all(shape[2] == 2 for _, shape, _ in calls)
    assert any(not grad for grad, _, _ in calls)  # the reference forward
    assert any(moved for n, moved in changed.items() if "lora" in n)


def test_the_report_counts_no_flips_where_sampler_and_trainer_route_alike(tmp_path, tokenizer, toy_dataset):
    """The default backend (the forward tier for MoE models) at the trainer's float32 weights: no route differs."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, moe_model(tokenizer), routing_replay="on",
                           sampling_mismatch_report=True, learning_rate=0.0)
    trainer.train()
    flips = [e["sampling/routing_flipped_fraction"] for e in trainer.state.log_history
             if "sampling/routing_flipped_fraction" in e]
    assert flips == [0.0, 0.0]


def test_dynamic_sampling_concatenates_the_routes_of_its_generation_rounds(tmp_path, tokenizer, toy_dataset):
    """zero_variance_groups='resample' builds a round from several generation rounds (`Round.concat`, widened to
    the widest prompt and completion with the free code 0): the replayed forwards get routes of the round's shape
    and the run trains."""
    from grpo_trainer.rewards.library import copy_digits_reward

    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, copy_digits_reward, moe_model(tokenizer),
                           routing_replay="on", zero_variance_groups="resample", max_resample_rounds=2,
                           per_device_train_batch_size=8, num_generations=4)
    with replay_calls() as calls:
        train_and_compare(trainer)
    assert calls and all(shape[0] == 8 and shape[2:] == (2, 2) for _, shape, _ in calls)
    extra = [e["zero_variance_groups/extra_rounds"] for e in trainer.state.log_history
             if "zero_variance_groups/extra_rounds" in e]
    assert sum(extra) > 0, extra  # several generation rounds were concatenated
