"""`GRPOConfig`: every GRPO option, its default, its help text, and the checks across fields.

Fields TRL 1.16's `GRPOConfig` also has keep its name, meaning and default, so a TRL script runs unchanged.
Two documented differences: `bf16` defaults to what the hardware runs fast (bf16 on a GPU that supports it,
fp32 on CPU, where bf16 matmuls are ~30x slower), and `max_prompt_length` exists (None = no truncation).
Only the fields whose behaviour this package implements are declared, so a TRL-only knob fails loudly as an
unknown field instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from grpo_trainer.config.checks import check_config

__all__ = ["GRPOConfig"]


def _opt(default: Any, help: str, **kwargs: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def _bf16_is_fast() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class GRPOConfig(TrainingArguments):
    """Configuration for `GRPOTrainer`. `per_device_train_batch_size` counts *completions*, as in TRL."""

    # Defaults TRL changes on TrainingArguments.
    learning_rate: float = _opt(1e-6, "Initial AdamW learning rate.")
    logging_steps: float = _opt(10, "Log every X optimizer steps (a float in [0, 1) is a ratio of all steps).")
    bf16: bool | None = _opt(None, "bf16 mixed precision. None: on where the GPU runs bf16 natively, else off.")
    remove_unused_columns: bool | None = _opt(False, "Keep extra dataset columns: reward functions receive them.")
    dataloader_pin_memory: bool = _opt(False, "Pin batches in page-locked memory. Rows here are Python objects "
                                              "(prompts and columns), so there is nothing to pin.")

    # Model
    model_init_kwargs: dict | str | None = _opt(None, "kwargs for from_pretrained when `model` is a string.")
    disable_dropout: bool = _opt(False, "Disable dropout in the policy and reference model.")

    # Data and generation
    num_generations: int = _opt(8, "G: completions sampled per prompt. At least 2 for training.")
    num_generations_eval: int | None = _opt(None, "G during evaluation (None = num_generations).")
    max_prompt_length: int | None = _opt(None, "Keep only the last N prompt tokens (None = no truncation).")
    max_completion_length: int = _opt(512, "Maximum new tokens per completion.")
    generation_batch_size: int | None = _opt(
        None, "Completions per generation round, over all processes. Exclusive with steps_per_generation.")
    steps_per_generation: int | None = _opt(
        None, "Micro-steps served by one generation round (None = gradient_accumulation_steps).")
    temperature: float = _opt(1.0, "Sampling temperature; log-probs are recomputed at the same temperature.")
    top_p: float = _opt(1.0, "Nucleus sampling: keep the smallest token set with this total probability.")
    top_k: int = _opt(0, "Keep only the k most likely tokens (0 = off).")
    min_p: float | None = _opt(None, "Minimum token probability relative to the most likely one.")
    repetition_penalty: float = _opt(1.0, "Penalty > 1 discourages repeating tokens.")
    generation_kwargs: dict | str | None = _opt(None, "Extra GenerationConfig kwargs; override the fields above.")
    chat_template_kwargs: dict | str | None = _opt(None, "kwargs for apply_chat_template, e.g. enable_thinking.")
    cache_implementation: str | None = _opt(None, "KV-cache implementation for generate (e.g. 'static').")
    generation_backend: str = _opt(
        "fast", "Rollout backend by registry name (grpo_trainer.rollout.BACKENDS). 'fast': each prompt prefilled "
        "once for its G completions and a tight decode loop over a preallocated KV cache (Llama-family models; "
        "anything it does not reproduce falls back to model.generate). 'generate': always model.generate, the "
        "reference path.")
    ds3_gather_for_generation: bool = _opt(
        True, "ZeRO-3: gather full weights for generation (fast). False keeps them sharded (slow, less memory).")
    shuffle_dataset: bool = _opt(True, "Shuffle prompts each epoch (same order on every process).")

    # Rewards and advantages
    reward_weights: list[float] | None = _opt(None, "One weight per reward function (None = all 1.0).")
    scale_rewards: str = _opt("group", "Advantage scale: 'group', 'batch' or 'none' (True/False accepted).")
    advantage_estimator: str = _opt(
        "grpo", "Advantage estimator by registry name: 'grpo', 'rloo', 'dr_grpo', 'reinforce_pp_baseline' or one "
        "registered with grpo_trainer.advantage.register_advantage. The trainer also accepts an instance/callable.")
    reward_error_policy: str = _opt(
        "raise", "A reward function that raises or returns NaN/inf: 'raise' stops with the function's name and "
        "the sample, 'none' treats that reward as missing (None).")
    reward_model_batch_size: int | None = _opt(
        None, "Completions scored per reward-model forward (None = per_device_train_batch_size).")

    # Loss
    beta: float = _opt(0.0, "KL coefficient. 0 loads no reference model.")
    num_iterations: int = _opt(1, "mu: optimisation passes over each generation round.")
    epsilon: float = _opt(0.2, "Lower clip range epsilon_low.")
    epsilon_high: float | None = _opt(None, "Upper clip range (None = epsilon); DAPO suggests 0.28.")
    delta: float | None = _opt(None, "Two-sided clipping: cap on the unclipped ratio (INTELLECT-2).")
    loss_type: str = _opt("dapo", "'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo' or 'sapo'.")
    importance_sampling_level: str = _opt("token", "'token' or 'sequence' (GSPO).")
    mask_truncated_completions: bool = _opt(False, "Leave completions that never emitted EOS out of the loss.")
    top_entropy_quantile: float = _opt(1.0, "rho: keep only the top-rho highest-entropy tokens in the loss.")
    sapo_temperature_neg: float = _opt(1.05, "SAPO gate temperature for negative advantages.")
    sapo_temperature_pos: float = _opt(1.0, "SAPO gate temperature for positive advantages.")
    logprob_chunk_size: int = _opt(1024, "Completion tokens projected through the LM head at once.")
    max_nonfinite_steps: int = _opt(
        3, "Consecutive micro-steps with a non-finite loss that are skipped before training stops.")

    # Reference model sync (TR-DPO)
    sync_ref_model: bool = _opt(False, "Update the reference model towards the policy every few steps.")
    ref_model_mixup_alpha: float = _opt(0.6, "alpha in ref <- alpha * policy + (1 - alpha) * ref.")
    ref_model_sync_steps: int = _opt(512, "Optimizer steps between reference-model syncs.")

    # Logging
    log_completions: bool = _opt(False, "Print a table of sampled completions and save them at each log step.")
    num_completions_to_print: int | None = _opt(None, "Rows of that table printed (None = all).")

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and _bf16_is_fast()
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default (its deprecated alias gradient_checkpointing=True)
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported: shrinking the batch would split prompt groups. "
                             "Set it to False and lower per_device_train_batch_size instead.")
        super().__post_init__()
        self._resolve_generation_batch()
        check_config(self)

    def _resolve_generation_batch(self) -> None:
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("generation_batch_size and steps_per_generation cannot both be set: set one "
                             "(the other follows from per_device_train_batch_size x processes).")
        if self.generation_batch_size is None:
            self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        elif self.generation_batch_size % global_batch:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                             f"per_device_train_batch_size x processes ({global_batch}).")
        else:
            self.steps_per_generation = self.generation_batch_size // global_batch
