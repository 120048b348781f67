"""`GRPOConfig` -> the typed settings each lower layer takes, built once per run.

Lower layers never read the config: each defines a small frozen dataclass of what it needs (sampling, prompts,
multi-turn turns, rewards, the objective, the engine correction, the training forward's options, the launch) and
this module is the one place that maps the config's field names (TRL's) onto them. The trainer's own parts get
theirs from `trainer.parts`, the memory planner its `PlanSettings` from `trainer.memory`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from grpo_trainer.algorithms.engine_correction import EngineCorrection
from grpo_trainer.algorithms.entropy import EntropyControl
from grpo_trainer.algorithms.losses import LossSettings
from grpo_trainer.algorithms.surrogates import SurrogateParams
from grpo_trainer.algorithms.truncation import Truncation
from grpo_trainer.config.grpo_config import GRPOConfig
from grpo_trainer.modeling import routing
from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.planning import levers
from grpo_trainer.rewards.sources import RewardSettings
from grpo_trainer.rollout.backend import CONTINUOUS_BATCHING, VLLM
from grpo_trainer.rollout.multiturn import TurnSettings
from grpo_trainer.rollout.partial.settings import PartialSettings
from grpo_trainer.rollout.settings import BackendChoice, PromptSettings, SamplingSettings, VLLMSettings
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
from grpo_trainer.rollout.vllm.checks import routed_experts_unavailable
from grpo_trainer.runtime.distributed import Launch

__all__ = ["backend_choice", "device_of", "engine_correction", "entropy_control", "forward_settings", "launch",
           "loss_settings", "memory_verdict", "partial_correction", "partial_settings", "prompt_settings",
           "reward_settings", "routing_replay", "sampling_settings", "speculative_settings", "surrogate_params",
           "truncation", "turn_settings", "vllm_settings"]


def sampling_settings(args: GRPOConfig) -> SamplingSettings:
    return SamplingSettings(args.max_completion_length, args.temperature, args.top_p, args.top_k, args.min_p,
                            args.repetition_penalty, args.cache_implementation, dict(args.generation_kwargs or {}))


def truncation(args: GRPOConfig) -> Truncation:
    """The sampler's top-k / top-p / min-p, `generation_kwargs` overriding the named fields as in the rollout
    (`rollout.settings.make_generation_config`; vLLM's sampling parameters use the same three names)."""
    settings = {"do_sample": True, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
                **{k: v for k, v in (args.generation_kwargs or {}).items() if k in ("do_sample", "top_k", "top_p",
                                                                                     "min_p")}}
    if not settings["do_sample"]:
        return Truncation()
    top_k, top_p = settings["top_k"] or 0, settings["top_p"]
    return Truncation(max(top_k, 0), 1.0 if top_p is None else float(top_p), settings["min_p"])  # vLLM: -1 is off


def prompt_settings(args: GRPOConfig) -> PromptSettings:
    return PromptSettings(args.max_prompt_length, dict(args.chat_template_kwargs or {}), args.pad_to_multiple_of)


def turn_settings(args: GRPOConfig) -> TurnSettings:
    return TurnSettings(prompt_settings(args), args.max_completion_length, args.max_tool_calling_iterations,
                        engine_logprobs=bool(args.use_vllm))


def reward_settings(args: GRPOConfig) -> RewardSettings:
    return RewardSettings(args.reward_error_policy, args.reward_timeout, args.multi_objective_aggregation,
                          args.scale_rewards)


def surrogate_params(args: GRPOConfig) -> SurrogateParams:
    return SurrogateParams(args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high, args.delta,
                           args.sapo_temperature_pos, args.sapo_temperature_neg, args.vespo_k_pos,
                           args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg)


def loss_settings(args: GRPOConfig) -> LossSettings:
    return LossSettings(args.loss_type, args.beta, args.use_bias_correction_kl, surrogate_params(args),
                        args.importance_sampling_level, args.off_policy_mask_threshold)


def entropy_control(args: GRPOConfig) -> EntropyControl:
    return EntropyControl(args.entropy_coef, args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta,
                          args.entropy_coef_min, args.entropy_coef_max)


def engine_correction(args: GRPOConfig) -> EngineCorrection | None:
    """The importance-sampling correction's settings; None when it is off, or when no engine or asynchronous
    producer samples (TRL applies it with `use_vllm` only: a `rollout_func`'s log-probs then feed the off-policy
    mask alone)."""
    if not args.vllm_importance_sampling_correction or not (args.use_vllm or args.async_rollouts):
        return None
    return EngineCorrection(args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
                            args.vllm_importance_sampling_clip_max)


def vllm_settings(args: GRPOConfig) -> VLLMSettings:
    longest = None if args.max_prompt_length is None else args.max_prompt_length + args.max_completion_length
    return VLLMSettings(
        mode=args.vllm_mode, generation_kwargs=args.generation_kwargs,
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        importance_sampling_correction=args.vllm_importance_sampling_correction,
        sync_check_interval=args.vllm_sync_check_interval,
        server_base_url=args.vllm_server_base_url, server_host=args.vllm_server_host,
        server_port=args.vllm_server_port, server_timeout=args.vllm_server_timeout, group_port=args.vllm_group_port,
        enable_sleep_mode=args.vllm_enable_sleep_mode, tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_length=args.vllm_max_model_length,
        model_impl=args.vllm_model_impl, trust_remote_code=args.trust_remote_code,
        rows_per_round=args.per_device_train_batch_size * args.steps_per_generation, longest_sequence=longest,
        max_completion_length=args.max_completion_length)


def backend_choice(args: GRPOConfig) -> BackendChoice:
    """`use_vllm`, then `use_transformers_continuous_batching` (or its deprecated name `use_transformers_paged`,
    which scripts may set after construction), override `generation_backend`."""
    continuous = args.use_transformers_continuous_batching or getattr(args, "use_transformers_paged", False)
    name = VLLM if args.use_vllm else CONTINUOUS_BATCHING if continuous else args.generation_backend
    return BackendChoice(name, vllm_settings(args) if name == VLLM else None,
                         args.transformers_continuous_batching_config, speculative_settings(args),
                         partial=bool(args.partial_rollouts))


def partial_settings(args: GRPOConfig) -> PartialSettings | None:
    """Partial rollouts' options (`partial_rollouts`; None: off, every round waits for its longest row)."""
    if not args.partial_rollouts:
        return None
    return PartialSettings(float(args.partial_rollouts), args.partial_rollout_max_parks,
                           args.partial_rollout_stale_tokens)


def partial_correction(args: GRPOConfig) -> EngineCorrection | None:
    """Partial rollouts' stale-token weights (`partial_rollout_stale_tokens='weight'`): per token, truncated by the
    engine correction's bounds (a sequence mode's product over a row's tokens would discard a whole row for drift
    that a few tokens carry); None otherwise."""
    if not args.partial_rollouts or args.partial_rollout_stale_tokens != "weight":
        return None
    return EngineCorrection("token_truncate", args.vllm_importance_sampling_clip_min,
                            args.vllm_importance_sampling_clip_max)


def speculative_settings(args: GRPOConfig) -> SpeculativeSettings | None:
    """The fast decoder's drafts (`speculative_rollouts`; None: off, the plain loop)."""
    if not args.speculative_rollouts:
        return None
    return SpeculativeSettings(max_draft_tokens=args.speculative_draft_tokens,
                               max_verify_tokens=args.speculative_verify_tokens, policy=args.speculative_policy)


def routing_replay(args: GRPOConfig, model: Any) -> bool:
    """Whether rounds record and replay `model`'s expert routing (`routing_replay`, `modeling.routing`):
    'auto' where it can run (a served Mixture-of-Experts family, a rollout in the process); 'on' refuses a model it
    cannot serve, by name (`config.checks` refused the engines already)."""
    if args.routing_replay == "off":
        return False
    reason = routing.unsupported_reason(causal_lm(model))
    if args.routing_replay == "on" and reason is not None:
        raise ValueError(f"routing_replay='on' but {reason}; use 'auto' (on only for those models) or 'off'.")
    in_process = backend_choice(args).name not in (VLLM, CONTINUOUS_BATCHING)
    if reason is None and not in_process:
        name = backend_choice(args).name
        why = routed_experts_unavailable() if name == VLLM else "its routing is not laid out per row"
        logging.getLogger("grpo_trainer.trainer.grpo_trainer").warning(
            "routing_replay='auto' is off for this Mixture-of-Experts model: its rollouts run in %s, whose routing "
            "is not recorded (%s; docs/MOE.md); the trainer routes every token itself.", name, why)
    return reason is None and in_process


def _deepspeed_config(args: GRPOConfig) -> dict | None:
    """The DeepSpeed config of this launch: `args.deepspeed`, else what `accelerate launch` passes in the env."""
    source = args.deepspeed
    if source is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if not source:
            offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
            params = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
            return {"zero_optimization": {"stage": int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)),
                                          "offload_optimizer": {"device": offload},
                                          "offload_param": {"device": params}}}
    if source is None:
        return None
    if isinstance(source, dict):
        return source
    with open(source) as f:
        return json.load(f)


def launch(args: GRPOConfig) -> Launch:
    """The run's launch (`runtime.distributed.Launch`), from the config and the environment `accelerate launch`
    sets, before any model loads."""
    processes = max(1, int(args.world_size))
    deepspeed = _deepspeed_config(args)
    zero = (deepspeed or {}).get("zero_optimization", {})
    bucket = zero.get("reduce_bucket_size", 500_000_000)
    return Launch(
        processes=processes, processes_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", processes)),
        zero_stage=int(zero.get("stage", 0)), deepspeed=deepspeed is not None,
        zero_reduce_bucket=int(bucket) if not isinstance(bucket, str) else 500_000_000,
        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None),
        offload_parameters=zero.get("offload_param", {}).get("device", "none") not in ("none", None),
        fsdp=bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true",
        sequence_parallel=getattr(args.parallelism_config, "sp_size", None) or 1)


def device_of(args: GRPOConfig) -> str:
    """The device kind the run trains on ("cpu", "cuda", ...): what `planning.levers` decides defaults for."""
    return args.device.type


def forward_settings(args: GRPOConfig, device: str | None = None) -> ForwardSettings:
    """The training forward's options, built once per run and read by the scorer and the memory plan alike, with the
    defaults held back on `device` resolved (`planning.levers`, decision 2). Sequence parallelism's sharded forward
    runs the padded layout: there `padding_free=None` resolves off (`True` is refused by
    `trainer.sequence_group.REFUSALS`)."""
    device = device or device_of(args)
    sharded = launch(args).sequence_parallel > 1
    padding_free = False if sharded and args.padding_free is None else args.padding_free
    return ForwardSettings(
        padding_free=levers.resolve("padding_free", padding_free, device), temperature=args.temperature,
        chunk_size=args.logprob_chunk_size, pad_to_multiple_of=args.pad_to_multiple_of,
        mlp_tile_tokens=args.mlp_tile_tokens, recompute_attention=args.recompute_attention,
        tied_lookup=levers.resolve("tied_embedding_lookup", args.tied_embedding_lookup, device),
        activation_offloading=args.activation_offloading)


def memory_verdict(args: GRPOConfig, device: str | None = None) -> str:
    """What a run whose plan exceeds its device does: `memory_check`, its `'auto'` resolved for `device`
    (`planning.levers`: 'error' where the planner was checked there, else 'warn')."""
    return levers.resolve("memory_check", args.memory_check, device or device_of(args))
