"""`GRPOConfig`: every GRPO option, its default, its help text, and the checks across fields.

Every field of TRL 1.16's `GRPOConfig` is here with its name, type, default and meaning, so a TRL script runs
unchanged (tests/config/test_trl_parity.py compares the two field by field). Documented differences: `bf16`
defaults to what the hardware runs fast (bf16 on a GPU that supports it, fp32 on CPU, where bf16 matmuls are
~30x slower), activation checkpointing is on by default under its current name, and this project's own fields
(`max_prompt_length`, `generation_backend`, `advantage_estimator`, ...). Choice fields are `Literal` types
(`config.choices`), so `grpo-train --help` lists their values. Names that older TRL releases had are accepted with a
warning naming their replacement (`config.legacy`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from grpo_trainer.config.checks import check_config
from grpo_trainer.config.choices import (
    AsyncCorrection,
    ImportanceSamplingLevel,
    LossType,
    MemoryCheck,
    MultiObjectiveAggregation,
    RewardErrorPolicy,
    RoutingReplay,
    VLLMImportanceSamplingMode,
    VLLMMode,
    VLLMModelImpl,
    ZeroVarianceGroups,
)
from grpo_trainer.config.legacy import LegacyFields, resolve_legacy
from grpo_trainer.planning import levers
from grpo_trainer.runtime import compat

__all__ = ["GRPOConfig"]


def _opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its default and help text (what `HfArgumentParser` prints); a list or dict default
    is copied for each instance. Also the field helper of the command-line dataclasses in `cli/`."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def _bf16_is_fast() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class GRPOConfig(LegacyFields, compat.CheckpointingFields, TrainingArguments):
    """Configuration for `GRPOTrainer`. `per_device_train_batch_size` counts *completions*, as in TRL."""

    # Dict fields that may arrive as JSON strings (command line, YAML): TrainingArguments parses the ones listed here.
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs", "transformers_continuous_batching_config", "generation_kwargs", "chat_template_kwargs"]

    # Defaults TRL changes on TrainingArguments.
    learning_rate: float = _opt(1e-6, "Initial AdamW learning rate.")
    logging_steps: float = _opt(10, "Log every X optimizer steps (a float in [0, 1) is a ratio of all steps).")
    bf16: bool | None = _opt(None, "bf16 mixed precision. None: on where the GPU runs bf16 natively, else off.")
    remove_unused_columns: bool | None = _opt(False, "Keep extra dataset columns: reward functions receive them.")
    dataloader_pin_memory: bool = _opt(False, "Pin batches in page-locked memory. Rows here are Python objects "
                                              "(prompts and columns), so there is nothing to pin.")

    # Model
    model_init_kwargs: dict[str, Any] | str | None = _opt(None, "kwargs for from_pretrained when `model` is a string.")
    trust_remote_code: bool = _opt(
        False, "Allow models and tokenizers that ship their own Python code (an `auto_map` in their config): the "
        "policy, its processor, reward models and their tokenizers. Only for code you trust.")
    disable_dropout: bool = _opt(False, "Disable dropout in the policy and reference model.")
    router_aux_loss_coef: float | None = _opt(
        None, "Mixture-of-Experts models: weight of the router's load-balancing loss added to the loss (logged as "
        "aux_loss). None takes the model config's own coefficient, 0 turns it off; an error on a dense model.")
    # Mixture-of-Experts rollout routing replay (docs/MOE.md)
    routing_replay: RoutingReplay = _opt(
        "auto", "Mixture-of-Experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss): record the experts the "
        "rollout routed every token to and route every training forward (old, reference, policy) the same way, the "
        "router's weights still trained (R3, docs/MOE.md). 'auto': on for those models when the rollout runs in the "
        "process, off for dense models and under vLLM (its routing is not captured yet); 'on': the same, an error "
        "where it cannot run; 'off': never.")
    cast_lm_head_to_fp32: bool = _opt(
        False, "Keep the policy's and reference model's LM head in float32 (the ScaleRL recipe). A tied head's "
        "shared embedding matrix becomes float32 too; the embedding's outputs keep the model's dtype.")

    # Data and generation
    num_generations: int | None = _opt(8, "G: completions sampled per prompt. At least 2 for training.")
    num_generations_eval: int | None = _opt(None, "G during evaluation (None = num_generations).")
    max_prompt_length: int | None = _opt(None, "Keep only the last N prompt tokens (None = no truncation).")
    max_completion_length: int | None = _opt(512, "Maximum new tokens per completion.")
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
        "other architectures run 'forward', and anything neither reproduces falls back to model.generate). "
        "'forward': the model's own forward over the same shared-prefix cache. 'generate': always "
        "model.generate, the reference path. use_transformers_continuous_batching overrides this field.")
    speculative_rollouts: bool = _opt(
        False, "Speculative rollouts drafted from the group (generation_backend='fast', the decoder's models): each "
        "decoder forward feeds a row's last token and a draft of its next ones (the continuation of its last few "
        "tokens in its siblings' completions so far, in the same prompt's earlier completions, or in the prompt) and "
        "commits every drafted token the sampler draws anyway: the same distribution, the same log-probs, fewer "
        "forwards where siblings share spans (a policy that has learnt a format). Rounds under logits processors that "
        "read the sequence decode without drafts. Off: the plain decode loop, unchanged. docs/SPECULATIVE.md."
        + levers.help_note("speculative_rollouts"))
    speculative_draft_tokens: int = _opt(
        8, "speculative_rollouts: a row's most draft tokens per forward (each row's own count grows while its drafts "
        "are accepted and backs off when they miss).")
    speculative_policy: str = _opt(
        "fixed", "speculative_rollouts: how wide each verifying forward is. 'fixed': the rows' own draft lengths "
        "(grown while accepted, backed off when missed) within speculative_verify_tokens; a seeded run reproduces bit "
        "for bit. 'measured': forwards are timed and each is made as wide as pays on this device (the same tokens; "
        "values at the float rounding of other widths, so not bit for bit).")
    speculative_verify_tokens: int = _opt(
        256, "speculative_rollouts: the most positions one forward verifies (rows x (1 + draft)), a bound on its "
        "cost and its logits' memory: a full batch drafts little, the batch's tail of a few long rows the most.")
    partial_rollouts: float = _opt(
        0.0, "Partial rollouts (alpha; generation_backend='fast', the decoder's plain loop): a training round starts "
        "the groups of (1 + alpha) x its prompts (the groups parked by earlier rounds first, then its own prompts, "
        "then extra prompts from a seeded stream of the training set), ends once enough groups have every completion "
        "finished, trains those, and parks the others with their tokens so far; the next round resumes them under the "
        "new weights (re-prefilled), and the tokens an earlier policy sampled are importance-weighted or masked "
        "(partial_rollout_stale_tokens). Groups train only when complete, so no length is dropped. 0: off, every "
        "round waits for its longest completion, unchanged. docs/PARTIAL.md." + levers.help_note("partial_rollouts"))
    partial_rollout_max_parks: int = _opt(
        2, "partial_rollouts: a group parked this many times is required to complete before its next round ends.")
    partial_rollout_stale_tokens: str = _opt(
        "weight", "partial_rollouts: the tokens an earlier policy sampled. 'weight': per-token importance "
        "weights pi_old / pi_behaviour against their recorded log-probs, truncated to vllm_importance_sampling_clip_"
        "min/max (the engine correction's bounds); 'mask': kept in the context, out of the loss.")
    pad_to_multiple_of: int | str | None = _opt(
        "auto", "Pad prompt and completion ids to a multiple of this many columns (fixed shapes for compilers). "
        "'auto': 128 on Neuron (AWS Trainium), no padding elsewhere; None: no padding.")
    ds3_gather_for_generation: bool = _opt(
        True, "ZeRO-3: gather full weights for generation (fast). False keeps them sharded (slow, less memory).")
    shuffle_dataset: bool | None = _opt(True, "Shuffle prompts each epoch (same order on every process).")

    use_transformers_continuous_batching: bool = _opt(
        False, "Generate with transformers' continuous-batching engine (`generate_batch`, transformers >= 5.8) "
        "instead of `generation_backend`. Text models only.")
    transformers_continuous_batching_config: dict | str | None = _opt(
        None, "kwargs for transformers' ContinuousBatchingConfig (max_memory_percent defaults to 0.5).")
    use_transformers_paged: bool = _opt(False, "Deprecated name of use_transformers_continuous_batching.")

    # vLLM
    use_vllm: bool = _opt(False, "Generate with vLLM instead of generation_backend.")
    vllm_mode: VLLMMode = _opt(
        "colocate", "'colocate': a vLLM engine inside each training process, sharing its devices; 'server': a "
        "separately started vLLM server (vllm_server_* fields).")
    vllm_model_impl: VLLMModelImpl = _opt("vllm", "vLLM's model implementation: 'vllm' (its own) or 'transformers'.")
    vllm_enable_sleep_mode: bool = _opt(
        False, "Colocate: offload vLLM's weights and KV cache while the trainer runs (less memory, slower wake-up).")
    vllm_structured_outputs_regex: str | None = _opt(None, "Constrain vLLM's completions to this regex.")
    vllm_server_base_url: str | None = _opt(
        None, "Server mode: the server's base URL (e.g. http://localhost:8000); overrides host and port.")
    vllm_server_host: str = _opt("0.0.0.0", "Server mode: the server's host (when vllm_server_base_url is None).")
    vllm_server_port: int = _opt(8000, "Server mode: the server's port (when vllm_server_base_url is None).")
    vllm_server_timeout: float = _opt(240.0, "Server mode: seconds to wait for the server before an error.")
    vllm_group_port: int = _opt(51216, "Server mode: port of the weight-update communicator.")
    vllm_gpu_memory_utilization: float = _opt(
        0.3, "Colocate: fraction of each device's memory vLLM may use (weights and KV cache).")
    vllm_max_model_length: int | None = _opt(
        None, "Colocate: vLLM's context length; at least the longest prompt plus max_completion_length (None: "
        "the model's).")
    vllm_tensor_parallel_size: int = _opt(1, "Colocate: tensor-parallel size of each vLLM engine; divides the "
                                             "number of processes.")
    vllm_importance_sampling_correction: bool = _opt(
        True, "Correct for the difference between vLLM's sampling log-probs and the trainer's with an "
        "importance weight on each token or sequence.")
    vllm_importance_sampling_mode: VLLMImportanceSamplingMode = _opt(
        "sequence_mask", "How that weight is bounded: 'token_truncate' / 'sequence_truncate' clip it to "
        "[clip_min, clip_max], 'token_mask' / 'sequence_mask' zero it outside that range; per token, or one "
        "weight per sequence (the exponential of the summed log-ratio).")
    vllm_importance_sampling_clip_max: float | None = _opt(3.0, "Upper bound C_max of the importance weight.")
    vllm_importance_sampling_clip_min: float | None = _opt(None, "Lower bound C_min of the importance weight.")
    vllm_importance_sampling_cap: float | None = _opt(None, "Deprecated name of vllm_importance_sampling_clip_max.")
    vllm_sync_check_interval: int = _opt(
        10, "Check that vLLM samples with the policy's weights after the first weight push and then every this "
        "many pushes: the engine scores a few sampled tokens and the run stops, naming what differs, when its "
        "log-probs are not the trainer's (docs/VLLM.md). 0 turns the check off.")

    # Rewards and advantages
    reward_weights: list[float] | None = _opt(None, "One weight per reward function (None = all 1.0).")
    multi_objective_aggregation: MultiObjectiveAggregation = _opt(
        "sum_then_normalize", "Several reward functions: 'sum_then_normalize' weights and sums them, then "
        "normalises as scale_rewards says; 'normalize_then_sum' (GDPO) normalises each within its group, sums "
        "them with their weights, then normalises the sum over the batch.")
    scale_rewards: str = _opt("group", "Advantage scale: 'group', 'batch' or 'none' (True/False accepted).")
    advantage_estimator: str = _opt(
        "grpo", "Advantage estimator by registry name: 'grpo', 'rloo', 'dr_grpo', 'reinforce_pp_baseline' or one "
        "registered with grpo_trainer.advantage.register_advantage. The trainer also accepts an instance/callable.")
    reward_error_policy: RewardErrorPolicy = _opt(
        "raise", "A reward function that raises or returns NaN/inf: 'raise' stops with the function's name and "
        "the sample, 'none' treats that reward as missing (None).")
    reward_model_batch_size: int | None = _opt(
        None, "Completions scored per reward-model forward (None = per_device_train_batch_size).")
    reward_timeout: float | None = _opt(
        None, "Seconds a reward function may take on one batch; past it the call is abandoned and counts as a "
        "failure of that function (reward_error_policy). None: no limit. With a limit, synchronous functions run "
        "in a worker thread.")

    # Loss
    beta: float = _opt(0.0, "KL coefficient. 0 loads no reference model.")
    num_iterations: int = _opt(1, "mu: optimisation passes over each generation round.")
    epsilon: float = _opt(0.2, "Lower clip range epsilon_low.")
    epsilon_high: float | None = _opt(None, "Upper clip range (None = epsilon); DAPO suggests 0.28.")
    delta: float | None = _opt(None, "Two-sided clipping: cap on the unclipped ratio (INTELLECT-2).")
    loss_type: LossType = _opt(
        "dapo", "Surrogate and aggregation: 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo' (sequence "
        "sums; pair it with importance_sampling_level='sequence') or 'vespo' (a Gamma-shaped sequence weight).")
    importance_sampling_level: ImportanceSamplingLevel = _opt("token", "'token' or 'sequence' (GSPO).")
    mask_truncated_completions: bool = _opt(False, "Leave completions that never emitted EOS out of the loss.")
    zero_variance_groups: ZeroVarianceGroups = _opt(
        "train", "Groups whose G rewards are all equal (advantage 0, no policy-gradient signal): 'train' trains on "
        "them as TRL does (they still count in every loss normaliser); 'skip' leaves out their forward and backward "
        "with the gradient unchanged (beta = 0, no entropy bonus or mask, no router loss); 'resample' (DAPO's dynamic "
        "sampling) generates extra prompts, drawn by a seeded sampler saved in checkpoints, until the round holds "
        "informative groups only, then normalises over the kept tokens as usual (docs/TRAINING_DATA.md).")
    max_resample_rounds: int = _opt(
        4, "zero_variance_groups='resample': the most extra generation rounds per round; past them the round keeps "
        "zero-variance groups in the free places, with a warning.")
    top_entropy_quantile: float = _opt(
        1.0, "rho: train the policy term on the top-rho highest-entropy completion tokens only (the quantile is over "
        "every process's tokens). 1.0 keeps every token, 0.0 the highest-entropy ones.")
    sapo_temperature_neg: float = _opt(1.05, "SAPO gate temperature for negative advantages.")
    sapo_temperature_pos: float = _opt(1.0, "SAPO gate temperature for positive advantages.")
    vespo_k_pos: float = _opt(2.0, "VESPO: Gamma-weight exponent k for non-negative advantages.")
    vespo_lambda_pos: float = _opt(3.0, "VESPO: Gamma-weight decay lambda for non-negative advantages.")
    vespo_k_neg: float = _opt(3.0, "VESPO: Gamma-weight exponent k for negative advantages.")
    vespo_lambda_neg: float = _opt(2.0, "VESPO: Gamma-weight decay lambda for negative advantages.")
    use_bias_correction_kl: bool = _opt(
        True, "Multiply each token's KL term by its (differentiable) importance ratio, which makes the KL gradient "
        "the unbiased reverse-KL gradient (DeepSeek-V3.2). Changes the gradient whenever beta != 0, on-policy too.")
    off_policy_mask_threshold: float | None = _opt(
        None, "DeepSeek-V3.2 off-policy sequence mask: drop from the loss each sequence whose advantage is "
        "negative and whose mean log-ratio of sampling to current policy exceeds this threshold (e.g. 0.5).")
    entropy_coef: float = _opt(
        0.0, "Entropy bonus: subtract this times the mean per-token entropy (over the loss's tokens) from the "
        "loss, whatever the loss_type. The initial coefficient when use_adaptive_entropy is on.")
    use_adaptive_entropy: bool = _opt(
        False, "Skywork-OR1's adaptive entropy control: after each optimizer step the coefficient moves by "
        "entropy_coef_delta towards keeping the entropy at entropy_target, and applies only at or below it.")
    entropy_coef_min: float = _opt(0.0, "Adaptive entropy control: lower bound of the coefficient.")
    entropy_coef_max: float = _opt(1.0, "Adaptive entropy control: upper bound of the coefficient.")
    entropy_coef_delta: float = _opt(0.005, "Adaptive entropy control: the coefficient's step per optimizer step.")
    entropy_target: float = _opt(
        0.2, "Adaptive entropy control: target mean per-token entropy in nats, over the loss's tokens.")
    keep_sampling_mask: bool = _opt(
        True, "With top_k / top_p / min_p, score every log-prob (old, current, reference) with a softmax over the "
        "tokens the sampler could draw at that position (its kept support, from the rollout backend where it "
        "returns it, else recomputed from the trainer's logits by transformers' rules), so the ratio to the sampler "
        "is 1, not the kept probability mass (DeepSeek-V3.2's keep-sampling-mask). False: the full softmax, as TRL; "
        "the mean log kept mass is logged either way (sampling/log_kept_mass).")
    sampling_mismatch_report: bool = _opt(
        False, "Each round, compare the sampler's log-probs of the sampled tokens with the trainer's at the same "
        "weights (by completion position and by token, worst tokens with context; docs/TRAINING_DATA.md), and warn "
        "with the likely cause above sampling_mismatch_threshold. Costs a no-grad forward where the round has none "
        "(the fast decoder on-policy); vLLM rounds with the importance-sampling correction are always reported.")
    sampling_mismatch_threshold: float = _opt(
        0.05, "Mean |sampler - trainer| log-prob difference (nats per token) above which the mismatch report warns.")
    logprob_chunk_size: int = _opt(1024, "Completion tokens projected through the LM head at once (at most: fewer "
                                         "where their float32 logits would pass 128 MiB, e.g. at a 152k vocabulary).")
    memory_check: MemoryCheck = _opt(
        "auto", "Before loading weights, plan the run's peak memory per process (docs/MEMORY.md): 'error' stops a "
        "run that would not fit, naming settings that do; 'warn' logs that and trains anyway; 'off' skips the plan; "
        "'auto': 'error' where the planner's figures have been checked on the device kind at its current code. "
        "With auto_find_batch_size=True the first setting that fits is applied instead (same global batch and "
        f"objective: {levers.fit_levers_text()})." + levers.help_note("memory_check"))
    mlp_tile_tokens: int = _opt(
        0, "Sequence-tiled MLP in the log-prob forwards and their backward (ALST's TiledMLP): each decoder layer's MLP "
        "computes this many tokens at a time, so its [tokens, intermediate] activations never exist for the whole "
        "micro-batch, and the layers' norms keep only their input; exact (the same values, gradients within float32 "
        "rounding), at the price of recomputing the MLP and the norms in the backward. 0: off. For long completions: "
        "docs/MEMORY.md, 'How long can I go?'." + levers.help_note("mlp_tile_tokens"))
    recompute_attention: bool = _opt(
        False, "Each decoder layer's attention block under its own activation checkpoint in the log-prob forwards' "
        "training forward, one row of the micro-batch at a time: its queries, keys, values and attention output are "
        "recomputed in its backward instead of kept, so under gradient_checkpointing they never sit beside the MLP's "
        "while the recomputed layer's backward runs (without it, no layer keeps them), and its working set is one "
        "row's. Exact; the price is one more attention forward per layer and step. "
        "Not with sequence parallelism. For long completions: docs/MEMORY.md, 'How long can I go?'."
        + levers.help_note("recompute_attention"))
    activation_offloading: bool = _opt(
        False, "Move the tensors the loss forward saves for the backward to host memory (pinned, copied on a side "
        "stream) and bring them back in the backward (TRL's SFT/DPO option of the same name, through TRL's own "
        "`get_act_offloading_ctx_manager`). Under gradient checkpointing these are each layer's input, the term that "
        "grows with layers x completion length; exact. Needs an accelerator (GPU): refused on CPU, where they "
        "already are in host memory. docs/MEMORY.md, 'How long can I go?'." + levers.help_note("activation_offloading"))
    padding_free: bool | None = _opt(
        None, "Padding-free log-prob forwards (TRL's SFT name): each micro-batch's sequences packed into rows, "
        "positions restarting per sequence, no attention across sequences, so no layer computes padding. Models "
        "it cannot serve are scored padded, by rule or after a once-per-model packed-vs-padded self-check, with "
        "the reason logged (docs/DESIGN.md, 'Padding-free forwards'). None: on where it has run (planning/levers.py)."
        + levers.help_note("padding_free"))
    tied_embedding_lookup: bool | None = _opt(
        None, "With tied input and output embeddings (Qwen2.5 0.5B-3B, Qwen3 0.6B-4B, Llama 3.2), the input lookup's "
        "backward adds its rows into the LM head's gradient in place instead of building a [vocabulary, hidden] "
        "gradient of its own (modeling/tied_embedding.py): the same sums, one such matrix less at the backward's "
        "end. None: on where it has run (planning/levers.py)." + levers.help_note("tied_embedding_lookup"))
    max_nonfinite_steps: int = _opt(
        3, "Consecutive micro-steps with a non-finite loss that are skipped before training stops.")

    # Asynchronous rollouts (docs/ASYNC.md)
    async_rollouts: int = _opt(
        0, "Rounds sampled ahead on a producer thread while the trainer trains on the current one (0: synchronous, "
        "as TRL's GRPOTrainer). With k, round n + k is sampled with the weights of step n: at most k steps stale, "
        "by pacing (nothing is dropped). Pays off when generation and training use different devices (vLLM server) "
        "or rewards wait on I/O.")
    async_correction: AsyncCorrection = _opt(
        "behaviour", "Off-policy correction of asynchronous rounds: 'behaviour' (the sampler's log-probs are the old "
        "log-probs, as TRL's async trainer and verl) or 'recompute' (decoupled PPO: old log-probs recomputed under "
        "the round's start weights, one no-grad forward per round, weighted by old / behaviour with the "
        "vllm_importance_sampling_* truncation). The default by measurement (benchmarks/RESULTS.md).")
    async_rollout_timeout: float | None = _opt(
        None, "Seconds a round may take on the producer thread before the run stops with an error (None: no limit).")

    # Interruption and concurrent runs
    signal_grace_period: float = _opt(
        25.0, "Seconds after SIGTERM or SIGINT for the current step to end (then a checkpoint is saved and training "
        "stops). A step still running then is abandoned: the process exits (status 128 + signal), first saving the "
        "last finished step when the run is stuck in a rollout or reward function. Keep it below the scheduler's "
        "kill delay (Slurm KillWait, Kubernetes terminationGracePeriodSeconds: 30 s by default).")
    ignore_output_dir_lock: bool = _opt(
        False, "Train even when another live run holds output_dir's lock (_grpo_trainer.lock). Both runs then write "
        "into the same folder, and one may overwrite the other's checkpoints.")

    # Reference model sync (TR-DPO)
    sync_ref_model: bool = _opt(False, "Update the reference model towards the policy every few steps.")
    ref_model_mixup_alpha: float = _opt(0.6, "alpha in ref <- alpha * policy + (1 - alpha) * ref.")
    ref_model_sync_steps: int = _opt(512, "Optimizer steps between reference-model syncs.")

    # Multi-turn
    max_tool_calling_iterations: int | None = _opt(
        None, "Tool calling: the most tool-call turns per completion (None: until the model stops calling tools).")

    # Logging
    log_completions: bool = _opt(False, "Print a table of sampled completions and save them at each log step.")
    num_completions_to_print: int | None = _opt(None, "Rows of that table printed (None = all).")
    log_unique_prompts: bool = _opt(False, "Completions table: one row per distinct prompt.")
    log_multimodal: bool = _opt(True, "Completions table: include the prompts' images.")
    log_completions_hub_repo: str | None = _opt(
        None, "Also push the completions files to this Hub dataset repo ('user/name', or 'name' in your own "
        "namespace); needs log_completions. Public unless hub_private_repo=True.")

    # Training health (docs/HEALTH.md)
    health_checks: bool = _opt(
        True, "Watch the logged metrics for the usual reasons a GRPO run does not learn (completions cut at "
        "max_completion_length, groups of equal rewards, a reward function that fails or dominates, entropy collapse, "
        "KL growth, clipping, collapsed importance weights, gradient spikes, non-finite steps): warn once when one "
        "sets in, naming the metric, the threshold, the likely cause and the fix, and summarise at the end of training "
        "(run log, console, metrics.jsonl, model card). Reads the metrics already computed: no extra forward.")
    health_thresholds: dict | str | None = _opt(
        None, "Overrides of the health checks' thresholds by name, e.g. {\"truncated_fraction\": 0.8} (every name, "
        "its default and its meaning: docs/HEALTH.md, grpo_trainer/diagnosis/settings.py).")

    def __post_init__(self) -> None:
        resolve_legacy(self)  # first: a legacy name's value is then checked and converted like its replacement's
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not self.use_cpu and _bf16_is_fast()
        compat.resolve_checkpointing(self, default=True)  # TRL's default (gradient_checkpointing=True there)
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        super().__post_init__()
        compat.mirror_checkpointing(self)
        self._resolve_deprecated_names()
        self._resolve_padding()
        self._resolve_generation_batch()
        self._resolve_health_thresholds()
        check_config(self)

    def _resolve_deprecated_names(self) -> None:
        """TRL's deprecated spellings, mapped to their replacements with the warning TRL gives."""
        if self.use_transformers_paged:
            warnings.warn("use_transformers_paged is deprecated; use use_transformers_continuous_batching instead.",
                          FutureWarning, stacklevel=4)
            self.use_transformers_continuous_batching = True
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn("vllm_importance_sampling_cap is deprecated; use vllm_importance_sampling_clip_max "
                          "instead.", FutureWarning, stacklevel=4)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap

    def _resolve_health_thresholds(self) -> None:
        """A JSON string (command line, YAML) as its dict; parsed here, not through `_VALID_DICT_FIELDS`, which
        lists TRL's dict fields only."""
        if isinstance(self.health_thresholds, str):
            try:
                self.health_thresholds = json.loads(self.health_thresholds)
            except json.JSONDecodeError as exc:
                raise ValueError(f"health_thresholds is not a JSON dict ({exc.msg}): {self.health_thresholds!r}; "
                                 'write it as \'{"truncated_fraction": 0.8}\' (docs/HEALTH.md).') from None

    def _resolve_padding(self) -> None:
        # From the command line the value arrives as a string.
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            value = self.pad_to_multiple_of.strip().lower()
            self.pad_to_multiple_of = None if value in ("none", "null", "") else int(value)
        if self.pad_to_multiple_of == "auto":
            # Neuron compiles once per input shape, so padding bounds the number of compilations.
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None

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
