"""The rules a `GRPOConfig` must satisfy, single-field and cross-field, checked when it is built.

Each failure raises one `ValueError` that names the field and says how to fix it. The table in docs/ERRORS.md lists
them; tests/config/test_validation.py and tests/config/test_config_rules.py reach every one. Combinations of valid
fields are one `config.refusals` table (`COMBINATIONS`), which the combination matrix reads.
"""

from __future__ import annotations

from typing import Any

from grpo_trainer.algorithms.advantage import ADVANTAGE_ESTIMATORS, SCALES
from grpo_trainer.config import choices as kinds
from grpo_trainer.config.choices import choices
from grpo_trainer.config.refusals import Refusal, check
from grpo_trainer.diagnosis.settings import threshold_problems
from grpo_trainer.planning import levers

__all__ = ["COMBINATIONS", "LONG_COMPLETION_LEVERS", "advisories", "check_config"]


def _rules(args: Any) -> list[tuple[bool, str]]:
    """(is_wrong, message) for every single-field and cross-field rule of GRPOConfig."""
    G = args.num_generations
    estimator = args.advantage_estimator
    return [
        (not isinstance(G, int) or G < 2,
         f"num_generations must be >= 2 for training (got {G}): advantages compare completions of one prompt."),
        (args.generation_batch_size % G != 0,
         f"generation_batch_size ({args.generation_batch_size} = per_device_train_batch_size x processes x "
         f"steps_per_generation) must be divisible by num_generations ({G}); change per_device_train_batch_size "
         "or num_generations so every prompt's group fits in one generation round."),
        (args.epsilon <= 0, f"epsilon must be > 0 (got {args.epsilon}); 0.2 is the usual value."),
        (args.epsilon_high is not None and args.epsilon_high < args.epsilon,
         f"epsilon_high ({args.epsilon_high}) must be >= epsilon ({args.epsilon}); leave it None to use epsilon."),
        (args.delta is not None and args.delta <= 1.0, f"delta must be > 1 (got {args.delta}); None disables it."),
        (args.temperature <= 0, f"temperature must be > 0 (got {args.temperature}); use a small value for "
                                "near-greedy sampling."),
        (args.beta < 0, f"beta must be >= 0 (got {args.beta}); 0 disables the KL term."),
        (not 0 < args.top_p <= 1, f"top_p must be in (0, 1] (got {args.top_p}); 1.0 disables nucleus sampling."),
        (args.top_k < 0, f"top_k must be >= 0 (got {args.top_k}); 0 disables it."),
        (args.max_completion_length < 1, f"max_completion_length must be >= 1 (got {args.max_completion_length})."),
        (args.max_prompt_length is not None and args.max_prompt_length < 1,
         f"max_prompt_length must be >= 1 or None (got {args.max_prompt_length})."),
        (args.num_iterations < 1, f"num_iterations must be >= 1 (got {args.num_iterations})."),
        (args.speculative_draft_tokens < 1,
         f"speculative_draft_tokens must be >= 1 (got {args.speculative_draft_tokens}); 8 is the default."),
        (args.speculative_policy not in ("fixed", "measured"),
         f"speculative_policy must be 'fixed' or 'measured' (got {args.speculative_policy!r})."),
        (args.speculative_verify_tokens < 1,
         f"speculative_verify_tokens must be >= 1 (got {args.speculative_verify_tokens}); 256 is the default."),
        (not (isinstance(args.partial_rollouts, (int, float)) and 0 <= args.partial_rollouts <= 4),
         f"partial_rollouts must be a number in [0, 4] (got {args.partial_rollouts!r}): the share of extra groups a "
         "round starts (0: off; APRIL uses 0.2-1)."),
        (args.partial_rollout_max_parks < 1,
         f"partial_rollout_max_parks must be >= 1 (got {args.partial_rollout_max_parks}); 2 is the default."),
        (args.partial_rollout_stale_tokens not in ("weight", "mask"),
         f"partial_rollout_stale_tokens must be 'weight' or 'mask' (got {args.partial_rollout_stale_tokens!r})."),
        (args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0,
         f"max_tool_calling_iterations must be >= 0 or None (got {args.max_tool_calling_iterations}); None lets the "
         "model call tools until it stops or its completion budget runs out."),
        (not 0 <= args.top_entropy_quantile <= 1,
         f"top_entropy_quantile must be in [0, 1] (got {args.top_entropy_quantile}); 1.0 keeps every token, 0.0 "
         "only the highest-entropy ones."),
        (args.loss_type not in choices(kinds.LossType),
         f"unknown loss_type {args.loss_type!r}; choose one of {sorted(choices(kinds.LossType))}."),
        (isinstance(estimator, str) and estimator not in ADVANTAGE_ESTIMATORS,
         f"unknown advantage_estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)} or register "
         "one with grpo_trainer.advantage.register_advantage."),
        (args.importance_sampling_level not in choices(kinds.ImportanceSamplingLevel),
         f"unknown importance_sampling_level {args.importance_sampling_level!r}; choose 'token' or 'sequence'."),
        (args.scale_rewards not in SCALES,
         f"unknown scale_rewards {args.scale_rewards!r}; choose one of {list(SCALES)} (or True/False)."),
        (args.reward_error_policy not in choices(kinds.RewardErrorPolicy),
         f"unknown reward_error_policy {args.reward_error_policy!r}; choose 'raise' or 'none'."),
        (args.reward_timeout is not None and not args.reward_timeout > 0,
         f"reward_timeout must be > 0 seconds or None (got {args.reward_timeout}); None sets no limit."),
        (not args.signal_grace_period >= 0,
         f"signal_grace_period must be >= 0 seconds (got {args.signal_grace_period})."),
        (args.sync_ref_model and args.beta == 0,
         "sync_ref_model=True needs beta > 0: with beta == 0 there is no reference model to sync."),
        (args.zero_variance_groups not in choices(kinds.ZeroVarianceGroups),
         f"unknown zero_variance_groups {args.zero_variance_groups!r}; choose one of "
         f"{choices(kinds.ZeroVarianceGroups)}."),
        (args.max_resample_rounds < 0,
         f"max_resample_rounds must be >= 0 (got {args.max_resample_rounds}); 0 draws no extra prompt."),
        (not args.sampling_mismatch_threshold > 0,
         f"sampling_mismatch_threshold must be > 0 nats (got {args.sampling_mismatch_threshold}); 0.05 is the "
         "default."),
        (args.logprob_chunk_size < 1, f"logprob_chunk_size must be >= 1 (got {args.logprob_chunk_size})."),
        (not isinstance(args.mlp_tile_tokens, int) or args.mlp_tile_tokens < 0,
         f"mlp_tile_tokens must be an integer >= 0 (got {args.mlp_tile_tokens!r}); 0 turns the tiled MLP off."),
        (not isinstance(args.recompute_attention, bool),
         f"recompute_attention must be True or False (got {args.recompute_attention!r})."),
        (not isinstance(args.activation_offloading, bool),
         f"activation_offloading must be True or False (got {args.activation_offloading!r})."),
        (args.padding_free is not None and not isinstance(args.padding_free, bool),
         f"padding_free must be True, False or None (got {args.padding_free!r}); None: on where it has run "
         "(planning/levers.py)."),
        (args.tied_embedding_lookup is not None and not isinstance(args.tied_embedding_lookup, bool),
         f"tied_embedding_lookup must be True, False or None (got {args.tied_embedding_lookup!r}); None: on where "
         "it has run (planning/levers.py)."),
        (args.reward_weights is not None and any(w != w for w in args.reward_weights),
         "reward_weights must be numbers, not NaN."),
        (args.multi_objective_aggregation not in choices(kinds.MultiObjectiveAggregation),
         f"unknown multi_objective_aggregation {args.multi_objective_aggregation!r}; choose one of "
         f"{sorted(choices(kinds.MultiObjectiveAggregation))}."),
        (args.memory_check not in choices(kinds.MemoryCheck),
         f"unknown memory_check {args.memory_check!r}; choose 'auto', 'error', 'warn' or 'off'."),
        (not isinstance(args.async_rollouts, int) or args.async_rollouts < 0,
         f"async_rollouts must be an integer >= 0 (got {args.async_rollouts!r}); 0 is synchronous, 1 samples one "
         "round ahead."),
        (args.async_correction not in choices(kinds.AsyncCorrection),
         f"async_correction must be 'recompute' or 'behaviour' (got {args.async_correction!r})."),
        (args.async_rollout_timeout is not None and args.async_rollout_timeout <= 0,
         f"async_rollout_timeout must be > 0 seconds, or None for no limit (got {args.async_rollout_timeout})."),
        (args.routing_replay not in choices(kinds.RoutingReplay),
         f"routing_replay must be 'auto', 'on' or 'off' (got {args.routing_replay!r})."),
        (args.vllm_mode not in choices(kinds.VLLMMode),
         f"unknown vllm_mode {args.vllm_mode!r}; choose 'colocate' or 'server'."),
        (args.vllm_importance_sampling_mode not in choices(kinds.VLLMImportanceSamplingMode),
         f"unknown vllm_importance_sampling_mode {args.vllm_importance_sampling_mode!r}; choose one of "
         f"{choices(kinds.VLLMImportanceSamplingMode)}."),
        (args.vllm_model_impl not in choices(kinds.VLLMModelImpl),
         f"unknown vllm_model_impl {args.vllm_model_impl!r}; choose 'vllm' or 'transformers'."),
        (None not in (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
         and args.vllm_importance_sampling_clip_min >= args.vllm_importance_sampling_clip_max,
         f"vllm_importance_sampling_clip_min ({args.vllm_importance_sampling_clip_min}) must be less than "
         f"vllm_importance_sampling_clip_max ({args.vllm_importance_sampling_clip_max})."),
        (args.loss_type == "vespo" and args.use_vllm and args.vllm_importance_sampling_correction
         and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"),
         "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. Got: "
         f"{args.vllm_importance_sampling_mode}."),
        (args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode.endswith("_truncate")
         and args.vllm_importance_sampling_clip_min is None and args.vllm_importance_sampling_clip_max is None,
         "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or _clip_max; set one "
         "(clip_max=3.0 is the default)."),
        (args.vllm_sync_check_interval < 0,
         f"vllm_sync_check_interval must be >= 0 (got {args.vllm_sync_check_interval}); 0 turns the weight-sync "
         "check off."),
        (args.log_completions_hub_repo is not None and not args.log_completions,
         "log_completions_hub_repo is set but log_completions is False; set log_completions=True to upload the "
         "completions, or unset log_completions_hub_repo."),
        (args.entropy_coef_min > args.entropy_coef_max,
         f"entropy_coef_min ({args.entropy_coef_min}) must be <= entropy_coef_max ({args.entropy_coef_max})."),
        (args.off_policy_mask_threshold is not None and args.off_policy_mask_threshold <= 0,
         f"off_policy_mask_threshold must be > 0 or None (got {args.off_policy_mask_threshold}); 0.5 is typical."),
        (args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1,
         f"pad_to_multiple_of must be >= 1 or None (got {args.pad_to_multiple_of})."),
        (_parallel_size(args, "cp_size") > 1,
         f"parallelism_config cp_size={_parallel_size(args, 'cp_size')} (torch context parallelism) is not wired "
         "into GRPO: GRPO builds its policy, old and reference batches inside the trainer after generation, and "
         "accelerate's context parallelism (FSDP2 only) replaces the attention mask by a plain causal one, so the "
         "real tokens of GRPO's left-padded prompt+completion rows would attend to the padding. Set cp_size=1; for "
         f"long completions use {LONG_COMPLETION_LEVERS}."),
        (not isinstance(args.health_checks, bool),
         f"health_checks must be True or False (got {args.health_checks!r}); False turns the training-health "
         "warnings and summary off."),
        *((True, message) for message in threshold_problems(args.health_thresholds)),
        (_evaluates(args) and (args.per_device_eval_batch_size * args.world_size)
         % (args.num_generations_eval or G) != 0,
         f"the global eval batch (per_device_eval_batch_size {args.per_device_eval_batch_size} x "
         f"{args.world_size} processes) must be divisible by the evaluation's num_generations "
         f"({args.num_generations_eval or G}): each prompt's completions are scored together."),
    ]


def _skip_changes_gradient(args: Any) -> str | None:
    """The setting under which a completion with advantage 0 still has a loss gradient (None: there is none)."""
    if args.beta != 0:
        return f"beta={args.beta} (the KL term)"
    if args.entropy_coef != 0 or args.use_adaptive_entropy:
        return "the entropy bonus (entropy_coef / use_adaptive_entropy)"
    if args.top_entropy_quantile < 1.0:
        return f"top_entropy_quantile={args.top_entropy_quantile} (its quantile counts every completion's tokens)"
    return None


# What fits a longer completion on one device instead (docs/MEMORY.md, "How long can I go?"): the levers' table.
LONG_COMPLETION_LEVERS = levers.longer_levers_text()


def _parallel_size(args: Any, field: str) -> int:
    """parallelism_config's cp_size / sp_size (1 without a parallelism_config, or while accelerate leaves it unset)."""
    return getattr(getattr(args, "parallelism_config", None), field, None) or 1


def _evaluates(args: Any) -> bool:
    return bool(args.do_eval) and str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no"


# Losses that sum token terms (a completion weighs as many tokens as it has).
_TOKEN_SUMMING_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")


def advisories(args: Any) -> list[str]:
    """Warnings (not errors) for combinations that run but are probably not what was meant, as TRL's trainer logs
    them; the trainer logs each through its module's logger."""
    level, loss_type = args.importance_sampling_level, args.loss_type
    messages = []
    if level == "sequence" and loss_type in _TOKEN_SUMMING_LOSSES:
        messages.append(
            f"importance_sampling_level='sequence' with loss_type='{loss_type}': this loss sums per-token terms, "
            "which weights each sequence by its completion length instead of optimising one objective per "
            "sequence as GSPO (arXiv:2507.18071) does; use loss_type='grpo' for GSPO's setup.")
    if loss_type == "luspo" and level != "sequence":
        messages.append("loss_type='luspo' is designed for importance_sampling_level='sequence' (the LUSPO paper's "
                        f"setup); it is {level!r} here.")
    if loss_type == "vespo" and level != "token":
        messages.append("loss_type='vespo' builds its own sequence-level weight from the token ratios, so "
                        f"importance_sampling_level should be 'token' (the default); {level!r} only changes the "
                        "ratio of the KL bias correction.")
    return messages


# Combinations of valid fields refused by name (`config.refusals`: the combination matrix reads this table), checked
# after the rules above.
COMBINATIONS: tuple[Refusal[Any], ...] = (
    Refusal("skip_with_gradient", ("zero_variance_groups", "beta", "entropy_coef", "use_adaptive_entropy",
                                   "top_entropy_quantile"),
            lambda a: a.zero_variance_groups == "skip" and _skip_changes_gradient(a) is not None,
            lambda a: f"zero_variance_groups='skip' leaves the gradient unchanged only when a zero-advantage "
                      f"completion adds nothing to the loss, but {_skip_changes_gradient(a)} gives it a gradient; use "
                      "'train' (the same gradient, every row run) or 'resample'."),
    Refusal("resample_ahead", ("zero_variance_groups", "async_rollouts"),
            lambda a: a.zero_variance_groups == "resample" and isinstance(a.async_rollouts, int)
            and a.async_rollouts > 0,
            lambda a: f"zero_variance_groups='resample' generates its extra prompts while the round is assembled, "
                      f"with the latest weights, but async_rollouts={a.async_rollouts} samples rounds ahead with older "
                      "ones; use async_rollouts=0, or zero_variance_groups='train' or 'skip'."),
    Refusal("speculative_backend", ("speculative_rollouts", "use_vllm", "use_transformers_continuous_batching",
                                    "generation_backend"),
            lambda a: a.speculative_rollouts and _speculative_backend(a) is not None,
            lambda a: f"speculative_rollouts=True drafts and verifies inside the fast decoder, but "
                      f"{_speculative_backend(a)}; use generation_backend='fast' without use_vllm and continuous "
                      "batching, or "
                      "speculative_rollouts=False."),
    Refusal("partial_backend", ("partial_rollouts", "use_vllm", "use_transformers_continuous_batching",
                                "generation_backend", "speculative_rollouts"),
            lambda a: bool(a.partial_rollouts) and _partial_backend(a) is not None,
            lambda a: f"partial_rollouts={a.partial_rollouts} ends a round inside the fast decoder's plain loop, but "
                      f"{_partial_backend(a)}; use generation_backend='fast' without use_vllm, continuous batching "
                      "and speculative_rollouts, or partial_rollouts=0."),
    Refusal("partial_ahead", ("partial_rollouts", "async_rollouts"),
            lambda a: bool(a.partial_rollouts) and isinstance(a.async_rollouts, int) and a.async_rollouts > 0,
            lambda a: f"partial_rollouts={a.partial_rollouts} parks rows between synchronous rounds; with "
                      f"async_rollouts={a.async_rollouts} rounds are sampled ahead by a producer, which does not park "
                      "them yet; use async_rollouts=0, or partial_rollouts=0."),
    Refusal("partial_resample", ("partial_rollouts", "zero_variance_groups"),
            lambda a: bool(a.partial_rollouts) and a.zero_variance_groups == "resample",
            lambda a: f"partial_rollouts={a.partial_rollouts} and zero_variance_groups='resample' both decide which "
                      "groups a round trains, and their combination is not built; use zero_variance_groups='train' "
                      "or 'skip', or partial_rollouts=0."),
    Refusal("partial_uncorrected", ("partial_rollouts", "partial_rollout_stale_tokens",
                                    "vllm_importance_sampling_correction"),
            lambda a: bool(a.partial_rollouts) and a.partial_rollout_stale_tokens == "weight"
            and not a.vllm_importance_sampling_correction,
            lambda a: "partial_rollout_stale_tokens='weight' bounds the stale tokens' importance weights as the "
                      "engine correction says, which vllm_importance_sampling_correction=False turns off; set it "
                      "True, or partial_rollout_stale_tokens='mask'."),
    Refusal("partial_truncated", ("partial_rollouts", "top_k", "top_p", "min_p"),
            lambda a: bool(a.partial_rollouts) and (a.top_k > 0 or a.top_p < 1 or bool(a.min_p)),
            lambda a: "partial_rollouts parks each token's sampling log-prob, not the kept support a truncated "
                      f"sampler drew it from (top_k={a.top_k}, top_p={a.top_p}, min_p={a.min_p}), which the loss "
                      "needs; sample without truncation, or set partial_rollouts=0."),
    Refusal("partial_mismatch_report", ("partial_rollouts", "sampling_mismatch_report"),
            lambda a: bool(a.partial_rollouts) and bool(a.sampling_mismatch_report),
            lambda a: "sampling_mismatch_report compares a round's sampler with the trainer at the weights that "
                      "sampled it, and a partial round's tokens were sampled by several; set one of them off."),
    Refusal("routing_replay_engine", ("routing_replay", "use_vllm", "use_transformers_continuous_batching"),
            lambda a: a.routing_replay == "on" and bool(a.use_vllm or a.use_transformers_continuous_batching),
            lambda a: "routing_replay='on' needs the rollout's routing, which is recorded only for rollouts in the "
                      "trainer's process (generate, the fast backends), not by vLLM or transformers' continuous "
                      "batching; use 'auto' (replay off there) or 'off'."),
)


def _speculative_backend(args: Any) -> str | None:
    """Why the rollouts `args` chooses are not the fast decoder's (`speculative_backend`), or None."""
    if args.use_vllm:
        return ("use_vllm=True samples in vLLM, whose own speculative decoding is not passed through: on its CPU "
                "build it samples off the model's distribution at temperature > 0 and returns NaN processed "
                "log-probs, and on a GPU it is unmeasured (docs/SPECULATIVE.md)")
    if args.use_transformers_continuous_batching:
        return "use_transformers_continuous_batching=True samples in transformers' engine"
    if args.generation_backend != "fast":
        return f"generation_backend={args.generation_backend!r}"
    return None


def _partial_backend(args: Any) -> str | None:
    """Why the rollouts `args` chooses cannot end a round early (`partial_backend`), or None."""
    if args.use_vllm:
        return ("use_vllm=True samples in vLLM, where aborting and resubmitting a round's open rows is not built "
                "yet (docs/PARTIAL.md)")
    if args.use_transformers_continuous_batching:
        return "use_transformers_continuous_batching=True samples in transformers' engine"
    if args.generation_backend != "fast":
        return f"generation_backend={args.generation_backend!r}"
    if args.speculative_rollouts:
        return "speculative_rollouts=True verifies drafts in a loop with no early end"
    return None


def check_config(args: Any) -> None:
    """Raise the first rule that `args` (a GRPOConfig) breaks, then the first refused combination."""
    for wrong, message in _rules(args):
        if wrong:
            raise ValueError(message)
    check(COMBINATIONS, args)
