"""The trainer's owned parts, each built from a `GRPOConfig` and what the trainer has made by then (its accelerator,
prepared models, metrics window): `GRPOTrainer._build_parts` calls these in order. Each part's constructor takes its
own typed settings, never the config, so a part can be built without a trainer; tests do so for `OffPolicy`
(tests/trainer/test_off_policy_alone.py), `PolicyScorer` (tests/trainer/test_policy_scorer_alone.py), `GRPOLoss`
(tests/trainer/test_loss_options.py) and `Resampler` (tests/trainer/test_resample.py); the others (`RoundBuilder`,
`MismatchReport`, the round sources) are tested through a trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from trl.models.utils import prepare_deepspeed, prepare_fsdp

from grpo_trainer import rollout
from grpo_trainer.algorithms.zero_variance import zero_variance_groups
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config import settings as typed
from grpo_trainer.data.sampler import RoundSource as PromptRows
from grpo_trainer.diagnosis.monitor import HealthMonitor
from grpo_trainer.diagnosis.settings import HealthSettings, RunFacts
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.rewards.sources import RewardSources
from grpo_trainer.rollout import multimodal, multiturn
from grpo_trainer.rollout.partial.parking import PartialRollouts
from grpo_trainer.runtime.distributed import Launch
from grpo_trainer.trainer.health import TrainingHealth
from grpo_trainer.trainer.loss import GRPOLoss, LossPartSettings
from grpo_trainer.trainer.mismatch import MismatchReport, MismatchSettings
from grpo_trainer.trainer.off_policy import OffPolicy, OffPolicySettings
from grpo_trainer.trainer.producer import AsyncRounds
from grpo_trainer.trainer.resample import Layout, Resampler, ResampleSettings
from grpo_trainer.trainer.round_builder import PolicyView, RoundBuilder, RoundSettings
from grpo_trainer.trainer.schedule import RoundBuffer, Schedule
from grpo_trainer.trainer.scoring import PolicyScorer, ScoringSettings
from grpo_trainer.trainer.sequence_group import ShardingSettings
from grpo_trainer.trainer.source import RoundSource, SourceSettings, SyncRounds

__all__ = ["corrections", "mismatch_report", "objective", "partial_rollouts", "prepare_auxiliary", "resampler",
           "round_builder", "round_source", "schedule", "scoring_settings", "sharding_settings", "source_settings",
           "source_type", "training_health"]


def scoring_settings(args: GRPOConfig) -> ScoringSettings:
    """The log-prob forwards' settings (`trainer.scoring`; the layout's scorer: `SequenceGroup.scorer`)."""
    return ScoringSettings(typed.forward_settings(args), args.per_device_train_batch_size, args.beta,
                           skip_zero_advantages=args.zero_variance_groups == "skip",
                           truncation=typed.truncation(args), keep_sampling_mask=args.keep_sampling_mask)


def sharding_settings(args: GRPOConfig, launch: Launch, processing_class: Any, multi_turn: bool) -> ShardingSettings:
    """What the sequence-parallel group and its refusals read (`trainer.sequence_group`)."""
    engine = "DeepSpeed" if launch.deepspeed else "FSDP" if launch.fsdp else None
    return ShardingSettings(launch.sequence_parallel, launch.processes, engine, args.loss_type,
                            args.top_entropy_quantile, args.padding_free, bool(args.use_vllm),
                            typed.truncation(args).active, args.routing_replay, args.async_rollouts,
                            args.activation_offloading, args.recompute_attention, multi_turn,
                            multimodal.is_processor(processing_class))


def objective(args: GRPOConfig, policy_scorer: PolicyScorer, router_aux_loss_coef: float, accelerator: Accelerator,
              metrics: MetricsWindow) -> GRPOLoss:
    """The loss (`trainer.loss`); refuses `zero_variance_groups='skip'` under a router loss, which covers every row."""
    skip = args.zero_variance_groups == "skip"
    if skip and router_aux_loss_coef != 0.0:
        raise ValueError(f"zero_variance_groups='skip' leaves the gradient unchanged only when a zero-advantage "
                         f"completion adds nothing to the loss, but this Mixture-of-Experts model's router loss "
                         f"(router_aux_loss_coef={router_aux_loss_coef}) covers every row; use 'train', or "
                         "set router_aux_loss_coef=0.")
    settings = LossPartSettings(typed.loss_settings(args), args.gradient_accumulation_steps,
                                args.max_completion_length, args.top_entropy_quantile, router_aux_loss_coef, skip)
    return GRPOLoss(settings, policy_scorer, typed.entropy_control(args), accelerator, metrics)


def resampler(args: GRPOConfig, dataset: Any, accelerator: Accelerator, reward_weights: list[float]
              ) -> Resampler | None:
    """Dynamic sampling's part (`zero_variance_groups='resample'`): extra prompts from the training set."""
    if args.zero_variance_groups != "resample":
        return None
    G, aggregation = args.num_generations, args.multi_objective_aggregation
    return Resampler(ResampleSettings(args.max_resample_rounds), dataset,
                     Layout(accelerator.num_processes, accelerator.process_index, G), args.seed,
                     lambda rewards: zero_variance_groups(rewards.cpu(), G, reward_weights, aggregation))


def partial_rollouts(args: GRPOConfig, dataset: Any, accelerator: Accelerator, processing_class: Any,
                     multi_turn: bool, routing_replay: bool) -> PartialRollouts | None:
    """Partial rollouts' part (`rollout.partial`): the parked groups and the extra prompts' stream; refuses what the
    config's own check cannot see (the model's processor, multi-turn rollouts, the rows per process)."""
    settings = typed.partial_settings(args)
    if settings is None:
        return None
    why = ("multi-turn rollouts (tools, an environment or a rollout_func) are sampled turn by turn, and a turn is "
           "not parked" if multi_turn else "a vision-language model's image prompts are not parked"
           if multimodal.is_processor(processing_class) else "routing replay records a rollout's routing in one pass, "
           "and a parked row's prefix was routed by an earlier rollout" if routing_replay else None)
    rows = args.generation_batch_size // accelerator.num_processes
    if why is None and rows % args.num_generations:
        why = (f"each process's {rows} rows of a round are not whole groups of num_generations="
               f"{args.num_generations}, and only whole groups are parked")
    if why is not None:
        raise ValueError(f"partial_rollouts={args.partial_rollouts}: {why}; set partial_rollouts=0 "
                         "(docs/PARTIAL.md).")
    return PartialRollouts(settings, dataset, args.num_generations, args.max_completion_length, args.seed,
                           accelerator.process_index)


def mismatch_report(args: GRPOConfig, model: nn.Module, tokenizer: Any, accelerator: Accelerator,
                    metrics: MetricsWindow) -> MismatchReport:
    """The sampler/trainer mismatch report (`trainer.mismatch`), at the dtype the trainer computes in."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    settings = MismatchSettings(args.sampling_mismatch_report, args.sampling_mismatch_threshold,
                                typed.truncation(args).active and not args.keep_sampling_mask, dtype, args.output_dir)
    return MismatchReport(settings, tokenizer, accelerator, metrics)


def round_builder(args: GRPOConfig, schedule: Schedule, processing_class: Any, backend: rollout.RolloutBackend,
                  reward_sources: RewardSources, estimator: Any, accelerator: Accelerator, metrics: MetricsWindow,
                  completions: CompletionLog, multi_turn: multiturn.MultiTurn | None, first_turn: Callable | None,
                  dataset: Any, model: nn.Module) -> RoundBuilder:
    """Prompts -> rollout -> rewards -> advantages -> `Round` (`trainer.round_builder`), with dynamic sampling's
    resampler."""
    settings = RoundSettings(typed.sampling_settings(args), typed.prompt_settings(args), args.num_generations,
                             args.num_generations_eval or args.num_generations, args.mask_truncated_completions,
                             args.log_completions, args.log_multimodal, args.keep_sampling_mask,
                             routing_replay=typed.routing_replay(args, accelerator.unwrap_model(model)))
    partial = partial_rollouts(args, dataset, accelerator, processing_class,
                               multi_turn is not None or first_turn is not None, settings.routing_replay)
    return RoundBuilder(settings=settings, schedule=schedule, processing_class=processing_class, backend=backend,
                        rewards=reward_sources, estimator=estimator, accelerator=accelerator,
                        metrics_window=metrics, completions=completions, multi_turn=multi_turn,
                        first_turn=first_turn, resampler=resampler(args, dataset, accelerator, reward_sources.weights),
                        partial=partial)


def corrections(args: GRPOConfig, launch: Launch, schedule: Schedule, rounds: RoundBuilder,
                policy_scorer: PolicyScorer, accelerator: Accelerator, metrics: MetricsWindow, model: nn.Module
                ) -> OffPolicy:
    """Old log-probs, importance weights and the mismatch report (`trainer.off_policy`); the sampler's dtype is read
    from the builder's backend when asked (a test or the trainer may swap it)."""
    settings = OffPolicySettings(typed.engine_correction(args),
                                 source_type(args).sampled_ahead(source_settings(args, launch))[1],
                                 args.partial_rollout_stale_tokens if args.partial_rollouts else None,
                                 typed.partial_correction(args))
    report = mismatch_report(args, model, multimodal.text_tokenizer(rounds.processing_class), accelerator, metrics)
    return OffPolicy(settings, schedule, policy_scorer.sampling_scores, accelerator, metrics, report,
                     lambda lm: rounds.backend.sampler_dtype(causal_lm(lm)))


def training_health(args: GRPOConfig, reward_sources: RewardSources, main_process: bool) -> TrainingHealth:
    """The training-health checks (`trainer.health`, docs/HEALTH.md): a monitor over the logged metrics with the run's
    settings its rules read and its fixes name; none with `health_checks=False` (nor on other processes)."""
    if not args.health_checks:
        return TrainingHealth(None, main_process)
    facts = RunFacts(max_completion_length=args.max_completion_length, num_generations=args.num_generations,
                     learning_rate=args.learning_rate, beta=args.beta, epsilon=args.epsilon,
                     num_iterations=args.num_iterations, max_grad_norm=args.max_grad_norm,
                     zero_variance_groups=args.zero_variance_groups, reward_error_policy=args.reward_error_policy,
                     reward_names=tuple(reward_sources.names), reward_weights=tuple(reward_sources.weights.tolist()),
                     multi_objective_aggregation=args.multi_objective_aggregation)
    return TrainingHealth(HealthMonitor(HealthSettings.of(args.health_thresholds), facts), main_process)


def schedule(args: GRPOConfig, launch: Launch) -> Schedule:
    """Which micro-step trains on which micro-batch of which round (`trainer.schedule`)."""
    return Schedule(args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps,
                    source_type(args).sampled_ahead(source_settings(args, launch))[0])


def source_settings(args: GRPOConfig, launch: Launch) -> SourceSettings:
    """What the round source and its refusals read of the run (`trainer.source`, decision 3)."""
    return SourceSettings(args.async_rollouts, args.async_correction, args.seed, args.async_rollout_timeout,
                          launch, args.vllm_mode, args.vllm_tensor_parallel_size, args.sampling_mismatch_report)


def source_type(args: GRPOConfig) -> type[RoundSource]:
    """The round source the config asks for (`trainer.source`, decision 3): the one place that chooses."""
    return AsyncRounds if args.async_rollouts else SyncRounds


def round_source(args: GRPOConfig, launch: Launch, dataset: Any, accelerator: Accelerator, rounds: RoundBuilder,
                 off_policy: OffPolicy, policy_scorer: PolicyScorer, buffer: RoundBuffer,
                 generate: Callable[[list[dict], str], Any], model: nn.Module, backend: rollout.RolloutBackend,
                 metrics: MetricsWindow, global_step: Callable[[], int], signal_stop: Any) -> RoundSource:
    """Where the trainer takes its rounds from (`trainer.source`). The asynchronous one (`trainer.producer`,
    docs/ASYNC.md) has a producer over this process's share of the prompts, seeded per process as
    `set_seed(..., device_specific=True)` seeds the synchronous path."""
    if source_type(args) is SyncRounds:
        return SyncRounds(rounds, off_policy, policy_scorer, buffer, generate)
    rows = PromptRows(dataset, args.num_generations, args.generation_batch_size // args.num_generations,
                      args.shuffle_dataset, args.seed, accelerator.process_index, accelerator.num_processes)

    def view(version: int) -> PolicyView:  # the bare model; grad mode (per thread) keeps checkpointing out
        return PolicyView(model, lambda: contextlib.nullcontext(accelerator.unwrap_model(model)), version,
                          plain_single_process=False)

    def push() -> None:
        backend.sync_weights(accelerator.unwrap_model(model), global_step())

    backend.sample_off_main_thread()
    return AsyncRounds(AsyncRounds.settings(source_settings(args, launch), accelerator.process_index), rounds,
                       off_policy, policy_scorer,
                       buffer, generate, rows, view, push if backend.capabilities.own_weights else None, metrics,
                       signal_stop)


def activation_offloading(args: GRPOConfig, model: nn.Module) -> contextlib.AbstractContextManager:
    """The context the training step runs in: TRL's activation offloading (`activation_offloading`, the saved
    tensors of the loss forward to pinned host memory on a side stream and back in the backward), or nothing. A
    context for the whole step, forward and backward, as TRL's SFT trainer uses it: its manager pairs each saved
    tensor's copy with its return, and leaving the context waits for both streams."""
    if not typed.forward_settings(args).activation_offloading:
        return contextlib.nullcontext()
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    return get_act_offloading_ctx_manager(model)


def prepare_auxiliary(module: nn.Module, accelerator: Accelerator, deepspeed: bool, fsdp: bool,
                      shard_under_fsdp: bool = False) -> nn.Module:
    """A reference or reward model put where the policy is: a DeepSpeed engine under DeepSpeed, sharded under FSDP
    when asked (the reference), else on the device in evaluation mode."""
    if deepspeed:
        return prepare_deepspeed(module, accelerator)
    if shard_under_fsdp and fsdp:
        return prepare_fsdp(module, accelerator)
    # device_placement: accelerate does not move models under FSDP by default
    return accelerator.prepare_model(module, evaluation_mode=True, device_placement=True)
