"""The run's memory plan (`grpo_trainer.planning`) from a `GRPOConfig`, and the check the trainer makes with it
before loading any weight.

Decisions:

1. `plan_settings` is the one place a `GRPOConfig` becomes the planner's `PlanSettings`; the launch (processes, ZeRO
   stage, FSDP, processes per machine, sp_size) is the trainer's one `Launch` (`config.settings.launch`).
2. The prompt length is the longest of the first `PROMPT_SAMPLE` prompts as the rollout tokenises them (chat
   template and a VLM's images included: `data.images.row_prompts`), at most `max_prompt_length`; the completion
   length is `max_completion_length` (a rollout can always reach it).
3. `check_memory` (the trainer's one call) stops a run whose plan exceeds the device with the itemised estimate
   and the settings that fit (`planning.fit`); with `auto_find_batch_size=True` it applies the first of them to
   `args` instead and logs it. The Trainer's own `auto_find_batch_size` (retrying smaller batches after an
   out-of-memory error) is then turned off: it would change the micro-batch without the generation round.
   `memory_check='warn'` only logs, `'off'` skips the plan; `'auto'` is `'error'` where the planner's figures were
   checked on the device kind at the planner's current code, else `'warn'` (`planning.levers`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_trainer import planning
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config import settings as typed
from grpo_trainer.config.checks import check_config
from grpo_trainer.data.images import row_prompts
from grpo_trainer.modeling.forwards import is_varlen
from grpo_trainer.rollout.backend import memory_profile
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.runtime import compat, host_memory, models
from grpo_trainer.runtime.distributed import Launch
from grpo_trainer.trainer.parts import source_settings, source_type

__all__ = ["ASSUMED_PROMPT_TOKENS", "PROMPT_SAMPLE", "MemoryPlanError", "RunPlan", "apply_fit", "check_memory",
           "plan_run", "plan_settings", "prompt_length"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")

PROMPT_SAMPLE = 256  # prompts tokenised to find the longest (decision 2)
ASSUMED_PROMPT_TOKENS = 128  # where no prompt can be read and max_prompt_length is None
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class MemoryPlanError(ValueError):
    """The run's memory plan exceeds the device (the message has the itemised estimate and what fits)."""


@dataclass(frozen=True)
class RunPlan:
    """A run's plan with what it was made from."""

    plan: planning.MemoryPlan
    settings: planning.PlanSettings
    shape: planning.ModelShape
    device: planning.DeviceMemory | None
    lora_shape: planning.ModelShape | None = None  # the model with a default LoRA adapter (for the suggestions)


def _distribution(launch: Launch) -> dict:
    """The PlanSettings fields of multi-process training."""
    return {"processes": launch.processes, "processes_per_node": launch.processes_per_node,
            "zero_stage": launch.zero_stage, "zero_reduce_bucket": launch.zero_reduce_bucket,
            "offload_optimizer": launch.offload_optimizer, "offload_parameters": launch.offload_parameters,
            "fsdp": launch.fsdp, "sequence_parallel": launch.sequence_parallel}


def _sgd_momentum(args: GRPOConfig) -> float:
    """`optim_args`' momentum (transformers passes "momentum=0.9,..." to SGD); 0 when unset."""
    for pair in (args.optim_args or "").replace(" ", "").split(","):
        if pair.startswith("momentum="):
            return float(pair.split("=", 1)[1])
    return 0.0


def _sampler_scored(args: GRPOConfig) -> bool:
    """Whether `trainer.off_policy` scores each round at its sampling weights (decision 1 there): a vLLM round under
    the engine correction (synchronous: a round sampled ahead with 'behaviour' takes the sampler's log-probs as
    old), a round sampled ahead with 'recompute', or the mismatch report's own forward."""
    engine = args.use_vllm and not args.async_rollouts and typed.engine_correction(args) is not None
    return bool(engine or (args.async_rollouts and args.async_correction == "recompute")
                or args.sampling_mismatch_report)


def plan_settings(args: GRPOConfig, *, prompt_length: int, weight_dtype: str = "float32",
                  quantization: str | None = None, device: str = "cpu", device_total_bytes: int = 0,
                  attention: str = "sdpa", launch: Launch | None = None) -> planning.PlanSettings:
    """The planner's settings for `args` on `device` (decision 1); `attention`: the model's attention
    implementation (what a packed forward's mask is); `launch`: the trainer's (read from `args` and the
    environment when not given)."""
    launch = launch or typed.launch(args)
    rollout = memory_profile(typed.backend_choice(args), device)  # the runtime's own choice (`rollout.select`)
    mixed = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
    generation_kwargs = args.generation_kwargs or {}
    return planning.PlanSettings(
        device=device, micro_batch=args.per_device_train_batch_size,
        accumulation_steps=args.gradient_accumulation_steps, steps_per_generation=args.steps_per_generation,
        num_iterations=args.num_iterations, num_generations=args.num_generations, prompt_length=prompt_length,
        completion_length=args.max_completion_length, weight_dtype=weight_dtype,
        mixed_precision=mixed if mixed != weight_dtype else None,
        checkpointing=bool(args.gradient_checkpointing), beta=args.beta, quantization=quantization,
        optimizer=str(getattr(args.optim, "value", args.optim)),
        sgd_momentum=_sgd_momentum(args), max_grad_norm=args.max_grad_norm or 0.0,
        forward=typed.forward_settings(args, device),
        routing_replay=args.routing_replay != "off" and rollout.in_process,
        temperature_matches="temperature" not in generation_kwargs and generation_kwargs.get("do_sample", True),
        entropy_gradient=args.entropy_coef != 0.0 or args.use_adaptive_entropy, rollout=rollout,
        sampler_scored=_sampler_scored(args),
        vllm_memory_fraction=args.vllm_gpu_memory_utilization, vllm_max_model_length=args.vllm_max_model_length,
        vllm_sleep=args.vllm_enable_sleep_mode, gather_for_generation=args.ds3_gather_for_generation,
        device_total_bytes=device_total_bytes, heap_held=device != "cpu" or host_memory.would_hold(),
        rounds=source_type(args).held(source_settings(args, launch)),
        varlen_attention=is_varlen(attention),
        resample_rounds=args.max_resample_rounds if args.zero_variance_groups == "resample" else 0,
        partial_alpha=float(args.partial_rollouts or 0.0),
        **_distribution(launch))


def prompt_length(args: GRPOConfig, dataset: Any, processing_class: Any) -> int:
    """The longest of the first `PROMPT_SAMPLE` prompts of `dataset`, tokenised as the rollout does (decision 2);
    `max_prompt_length` for a stream or where no prompt can be read (environments write them), else
    `ASSUMED_PROMPT_TOKENS`."""
    streamed = dataset is not None and not hasattr(dataset, "__len__")
    prompts = []
    if dataset is not None and processing_class is not None and not (streamed and args.max_prompt_length):
        rows = itertools.islice(iter(dataset), PROMPT_SAMPLE) if streamed \
            else (dataset[i] for i in range(min(PROMPT_SAMPLE, len(dataset))))
        rows = [row for row in rows if row.get("prompt") is not None]
        prompts = row_prompts(rows) if rows else []  # a VLM's prompts with their images, as the rollout has them
    if not prompts:
        return args.max_prompt_length or ASSUMED_PROMPT_TOKENS
    batch = tokenize_prompts(processing_class, prompts, args.max_prompt_length, args.chat_template_kwargs,
                             args.pad_to_multiple_of)
    return int(batch.ids.shape[1])


def _weight_dtype(model: str | nn.Module, config: Any, args: GRPOConfig) -> str:
    if isinstance(model, nn.Module):
        return _DTYPE_NAMES.get(next(model.parameters()).dtype, "float32")
    dtype = models.init_kwargs(args.model_init_kwargs, args.trust_remote_code)["dtype"]
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return _DTYPE_NAMES.get(dtype, "float32")


def _quantization(model: str | nn.Module, args: GRPOConfig, quantization_config: Any) -> str | None:
    config = quantization_config or (args.model_init_kwargs or {}).get("quantization_config")
    if isinstance(model, nn.Module):
        return "4bit" if getattr(model, "is_loaded_in_4bit", False) else \
            "8bit" if getattr(model, "is_loaded_in_8bit", False) else None
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    return "4bit" if get("load_in_4bit", False) else "8bit" if get("load_in_8bit", False) else None


def _attention(model: str | nn.Module, config: Any, args: GRPOConfig) -> str:
    """The attention implementation the model runs with: a loaded model's, else the one asked for at load time
    (transformers' default, SDPA, where none is)."""
    text = config.get_text_config()
    chosen = getattr(text, "_attn_implementation", None) if isinstance(model, nn.Module) else None
    return str(chosen or (args.model_init_kwargs or {}).get("attn_implementation") or "sdpa")


def _model_config(model: str | nn.Module, args: GRPOConfig) -> Any:
    if isinstance(model, nn.Module):
        return models.causal_lm(model).config
    from transformers import AutoConfig

    kwargs = models.init_kwargs(args.model_init_kwargs, args.trust_remote_code)
    try:
        models.check_remote_code(model, kwargs["trust_remote_code"], kwargs.get("revision"))
        return AutoConfig.from_pretrained(model, revision=kwargs.get("revision"),
                                          trust_remote_code=kwargs["trust_remote_code"])
    except OSError as exc:  # not cached while offline, gated, not on the Hub: one line naming the model and the fix
        message = models.hub_failure(model, exc)
        if message is None:
            raise
        raise OSError(message) from exc


def _device(args: GRPOConfig) -> str | None:
    kind = args.device.type
    return kind if kind in ("cpu", "cuda") else None


def plan_run(model: str | nn.Module, args: GRPOConfig, train_dataset: Any = None, processing_class: Any = None,
             peft_config: Any = None, quantization_config: Any = None, device: str | None = None,
             with_device: bool = True, launch: Launch | None = None) -> RunPlan:
    """The memory plan of training `model` with `args` (no weights are loaded; a loaded model is only read)."""
    config = _model_config(model, args)
    if isinstance(model, nn.Module) and models.is_peft_model(model):
        shape = planning.shape_of(model, config)
    else:
        shape = planning.model_shape(config, peft_config, args.trust_remote_code)
    device = device or _device(args) or "cpu"
    launch = launch or typed.launch(args)
    budget = planning.device_memory(device, launch.processes_per_node) if with_device else None
    total = 0
    if device == "cuda" and torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
    settings = plan_settings(args, prompt_length=prompt_length(args, train_dataset, processing_class),
                             weight_dtype=_weight_dtype(model, config, args),
                             quantization=_quantization(model, args, quantization_config),
                             device=device, device_total_bytes=total, attention=_attention(model, config, args),
                             launch=launch)
    return RunPlan(planning.plan_memory(settings, shape), settings, shape, budget)


def _default_lora_shape(model: str | nn.Module, args: GRPOConfig) -> planning.ModelShape | None:
    """The model with the LoRA adapter `grpo-train --use_peft` adds (r 16, every linear layer)."""
    try:
        from peft import LoraConfig
    except ImportError:
        return None
    config = _model_config(model, args)
    return planning.model_shape(config, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                   task_type="CAUSAL_LM"), args.trust_remote_code)


def default_lora_shape(model: str | nn.Module, args: GRPOConfig) -> planning.ModelShape | None:
    """The model with `grpo-train --use_peft`'s default adapter (None without peft): what the suggestions try."""
    return _default_lora_shape(model, args)


def context_length(model: str | nn.Module, args: GRPOConfig) -> int | None:
    """The model's `max_position_embeddings` (None where its config has none)."""
    value = getattr(_model_config(model, args).get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


def apply_fit(args: GRPOConfig, changes: dict) -> None:
    """Set a fit's GRPOConfig fields on `args` (the generation batch stays: `steps_per_generation` changes with
    the micro-batch, so `generation_batch_size` is unchanged)."""
    for name, value in changes.items():
        if name == "gradient_checkpointing":
            args.gradient_checkpointing = value
            compat.mirror_checkpointing(args)
            if hasattr(args, "activation_checkpointing"):
                args.activation_checkpointing = value
        else:
            setattr(args, name, value)
    check_config(args)


def prepare_host(args: GRPOConfig) -> None:
    """CPU training: glibc's heap held to the live tensors (`runtime.host_memory`), as the plan assumes."""
    if _device(args) == "cpu":
        host_memory.hold_heap_to_live_tensors()


def check_memory(model: str | nn.Module, args: GRPOConfig, train_dataset: Any, processing_class: Any,
                 peft_config: Any = None, quantization_config: Any = None, launch: Launch | None = None) -> None:
    """The trainer's check before loading weights (decision 3)."""
    auto, args.auto_find_batch_size = args.auto_find_batch_size, False  # decision 3: the Trainer's retry is off
    verdict = typed.memory_verdict(args, _device(args) or "cpu")
    if verdict == "off" or _device(args) is None:
        return
    run = plan_run(model, args, train_dataset, processing_class, peft_config, quantization_config, launch=launch)
    plan, device = run.plan, run.device
    if plan.device_bytes <= device.total_bytes:
        logger.info("Memory plan: %.2f GiB of %.2f GiB per process (%s); `grpo-train plan` shows the items.",
                    plan.device_bytes / 2**30, device.total_bytes / 2**30, device.source)
        return
    exact = planning.split_is_exact(args.loss_type, args.top_entropy_quantile)
    lora = _default_lora_shape(model, args) if peft_config is None and not run.shape.adapter_parameters else None
    fits = planning.fitting(run.settings, run.shape, device, exact, lora)
    choice = next((f for f in fits if f.same_objective), None)
    if auto and choice is not None:
        apply_fit(args, choice.changes)
        logger.warning("auto_find_batch_size: the plan (%.2f GiB) exceeds %.2f GiB (%s); training with %s "
                       "(%.2f GiB, the same global batch and objective).", plan.device_bytes / 2**30,
                       device.total_bytes / 2**30, device.source, choice.describe(), choice.plan.device_bytes / 2**30)
        return
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    message = planning.over_budget_message(plan, device, fits, global_batch)
    if verdict == "warn":
        logger.warning(message)
        return
    raise MemoryPlanError(message)
