"""The `GRPOConfig` rules of `config.checks` (`_rules`, and one row of `COMBINATIONS`) that
tests/config/test_validation.py's table does not reach: each raises one `ValueError` when the config is built, and
its message names the field (and, where there is one, the fix)."""

import pytest

from grpo_trainer import GRPOConfig

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")


@pytest.mark.parametrize("overrides, field, message", [
    ({"logprob_chunk_size": 0}, "logprob_chunk_size", "logprob_chunk_size must be >= 1 (got 0)"),
    ({"mlp_tile_tokens": -1}, "mlp_tile_tokens", "mlp_tile_tokens must be an integer >= 0 (got -1); 0 turns the "
                                                 "tiled MLP off"),
    ({"mlp_tile_tokens": 2.5}, "mlp_tile_tokens", "mlp_tile_tokens must be an integer >= 0 (got 2.5)"),
    ({"reward_weights": [1.0, float("nan")]}, "reward_weights", "reward_weights must be numbers, not NaN"),
    ({"async_rollouts": -1}, "async_rollouts", "async_rollouts must be an integer >= 0 (got -1); 0 is synchronous"),
    ({"async_rollouts": 1.5}, "async_rollouts", "async_rollouts must be an integer >= 0 (got 1.5)"),
    ({"async_correction": "ignore"}, "async_correction",
     "async_correction must be 'recompute' or 'behaviour' (got 'ignore')"),
    ({"async_rollout_timeout": 0.0}, "async_rollout_timeout",
     "async_rollout_timeout must be > 0 seconds, or None for no limit (got 0.0)"),
    ({"routing_replay": "always"}, "routing_replay", "routing_replay must be 'auto', 'on' or 'off' (got 'always')"),
    ({"vllm_model_impl": "torch"}, "vllm_model_impl",
     "unknown vllm_model_impl 'torch'; choose 'vllm' or 'transformers'"),
    ({"log_completions_hub_repo": "org/completions", "log_completions": False}, "log_completions_hub_repo",
     "log_completions_hub_repo is set but log_completions is False; set log_completions=True"),
    ({"pad_to_multiple_of": 0}, "pad_to_multiple_of", "pad_to_multiple_of must be >= 1 or None (got 0)"),
    ({"do_eval": True, "eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 3},
     "per_device_eval_batch_size", "the global eval batch (per_device_eval_batch_size 3 x 1 processes) must be "
                                   "divisible by the evaluation's num_generations (2)"),
    ({"do_eval": True, "eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4,
      "num_generations_eval": 3}, "num_generations",
     "must be divisible by the evaluation's num_generations (3)"),
    # COMBINATIONS' `routing_replay_engine`: the engines that record no routing
    ({"routing_replay": "on", "use_vllm": True}, "routing_replay",
     "routing_replay='on' needs the rollout's routing, which is recorded only for rollouts in the trainer's "
     "process"),
    ({"routing_replay": "on", "use_transformers_continuous_batching": True}, "routing_replay",
     "not by vLLM or transformers' continuous batching; use 'auto' (replay off there) or 'off'"),
])
def test_config_rejects_by_field(overrides, field, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**{**BASE, **overrides})
    text = str(error.value)
    assert message in text, text
    assert field in text


@pytest.mark.parametrize("overrides", [
    {"logprob_chunk_size": 1}, {"mlp_tile_tokens": 0}, {"reward_weights": [1.0, 0.0]}, {"async_rollouts": 0},
    {"async_correction": "recompute"}, {"async_rollout_timeout": None}, {"routing_replay": "on"},
    {"vllm_model_impl": "transformers"}, {"log_completions_hub_repo": "org/completions", "log_completions": True},
    {"pad_to_multiple_of": 1},
    {"do_eval": True, "eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4},
    {"routing_replay": "on", "use_vllm": False},
])
def test_the_edge_of_each_rule_is_accepted(overrides):
    """The value next to each refused one passes: the rules refuse no more than their messages say."""
    args = GRPOConfig(**{**BASE, **overrides})
    assert all(getattr(args, name) == value for name, value in overrides.items())
