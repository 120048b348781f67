"""The rules a `GRPOConfig` must satisfy, single-field and cross-field, checked when it is built.

Each failure raises one `ValueError` that names the field and says how to fix it. The table in docs/ERRORS.md lists
them; tests/config/test_checks.py reaches every one.
"""

from __future__ import annotations

from typing import Any

from grpo_trainer.algorithms.advantage import ADVANTAGE_ESTIMATORS, SCALES
from grpo_trainer.algorithms.losses import LOSS_TYPES

__all__ = ["check_config"]


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
        (not 0 < args.top_entropy_quantile <= 1,
         f"top_entropy_quantile must be in (0, 1] (got {args.top_entropy_quantile}); 1.0 keeps every token."),
        (args.loss_type not in LOSS_TYPES,
         f"unknown loss_type {args.loss_type!r}; choose one of {sorted(LOSS_TYPES)}."),
        (isinstance(estimator, str) and estimator not in ADVANTAGE_ESTIMATORS,
         f"unknown advantage_estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)} or register "
         "one with grpo_trainer.advantage.register_advantage."),
        (args.importance_sampling_level not in ("token", "sequence"),
         f"unknown importance_sampling_level {args.importance_sampling_level!r}; choose 'token' or 'sequence'."),
        (args.scale_rewards not in SCALES,
         f"unknown scale_rewards {args.scale_rewards!r}; choose one of {list(SCALES)} (or True/False)."),
        (args.reward_error_policy not in ("raise", "none"),
         f"unknown reward_error_policy {args.reward_error_policy!r}; choose 'raise' or 'none'."),
        (args.sync_ref_model and args.beta == 0,
         "sync_ref_model=True needs beta > 0: with beta == 0 there is no reference model to sync."),
        (args.logprob_chunk_size < 1, f"logprob_chunk_size must be >= 1 (got {args.logprob_chunk_size})."),
        (args.reward_weights is not None and any(w != w for w in args.reward_weights),
         "reward_weights must be numbers, not NaN."),
    ]


def check_config(args: Any) -> None:
    """Raise the first rule that `args` (a GRPOConfig) breaks."""
    for wrong, message in _rules(args):
        if wrong:
            raise ValueError(message)
