"""`GRPOConfig` against the installed `trl.GRPOConfig`, field by field: a TRL upgrade that adds a field or changes a
default fails here, naming it. Our own fields and deliberate differences are listed, each with its reason."""

import dataclasses
import typing

import pytest
import trl
from transformers import TrainingArguments

from grpo_trainer import GRPOConfig
from grpo_trainer.config.legacy import LEGACY
from grpo_trainer.runtime import compat

# Fields TRL does not have, each a feature of this project (README "Differences from trl.GRPOConfig").
OURS_ONLY = {
    "max_prompt_length": "prompt truncation (TRL removed it); None = no truncation, TRL's behaviour",
    "generation_backend": "the rollout backend by registry name",
    "advantage_estimator": "the pluggable advantage estimator",
    "reward_error_policy": "what a failing reward function does",
    "reward_model_batch_size": "reward models score in micro-batches",
    "logprob_chunk_size": "completion tokens per LM-head chunk",
    "mlp_tile_tokens": "the sequence-tiled MLP for long completions (docs/MEMORY.md)",
    "recompute_attention": "each attention block checkpointed, for long completions (docs/MEMORY.md)",
    "activation_offloading": "saved activations in host memory on a GPU (TRL's SFT/DPO option and helper)",
    "padding_free": "packed log-prob forwards (TRL's SFT and DPO configs have the name; its GRPOConfig does not)",
    "tied_embedding_lookup": "a tied embedding's lookup adds its rows into the LM head's gradient (docs/MEMORY.md)",
    "max_nonfinite_steps": "the non-finite-loss guard",
    "speculative_rollouts": "rollouts drafted from the group, verified exactly (docs/SPECULATIVE.md)",
    "speculative_draft_tokens": "speculative rollouts: a row's most draft tokens per forward",
    "speculative_verify_tokens": "speculative rollouts: the most positions one forward verifies",
    "speculative_policy": "speculative rollouts: how wide each verifying forward is",
    "partial_rollouts": "rounds that end once enough groups complete, the rest parked (docs/PARTIAL.md)",
    "partial_rollout_max_parks": "partial rollouts: the parks after which a group must complete",
    "partial_rollout_stale_tokens": "partial rollouts: earlier policies' tokens weighted or masked",
    "memory_check": "what a run whose memory plan exceeds the device does (docs/MEMORY.md)",
    "vllm_sync_check_interval": "how often the vLLM weight-sync self-check runs (docs/VLLM.md)",
    "async_rollouts": "asynchronous rollouts in the trainer itself: rounds sampled ahead (docs/ASYNC.md)",
    "async_correction": "how asynchronous rounds correct for their stale weights (docs/ASYNC.md)",
    "async_rollout_timeout": "the longest a producer job may take (docs/ASYNC.md)",
    # Legacy names (config/legacy.py): removed from TRL's GRPOConfig or transformers' TrainingArguments, still in
    # recipes; each warns and maps to its replacement, or warns that it has no effect.
    "vllm_device": "legacy (TRL < 0.18), no effect: vLLM's devices follow the launch",
    "vllm_dtype": "legacy (TRL < 0.18), no effect: vLLM runs in the model's dtype",
    "vllm_enable_prefix_caching": "legacy (TRL < 0.18), no effect: a vLLM server setting",
    "vllm_max_model_len": "legacy (TRL < 0.18) name of vllm_max_model_length",
    "token_entropy_percentile_threshold": "legacy (TRL < 0.20): top_entropy_quantile = 1 - threshold",
    "wandb_log_unique_prompts": "legacy (TRL < 0.27) name of log_unique_prompts",
    "use_liger_loss": "legacy (TRL < 0.28) name of use_liger_kernel",
    "vllm_guided_decoding_regex": "legacy (TRL < 0.28) name of vllm_structured_outputs_regex",
    "evaluation_strategy": "legacy (transformers < 4.46) name of eval_strategy",
    "warmup_ratio": "legacy (transformers < 5) name of warmup_steps (a value below 1 is a ratio there)",
    "no_cuda": "legacy (transformers < 5) name of use_cpu",
    "per_gpu_train_batch_size": "legacy (transformers < 5) name of per_device_train_batch_size",
    "per_gpu_eval_batch_size": "legacy (transformers < 5) name of per_device_eval_batch_size",
    "push_to_hub_token": "legacy (transformers < 5) name of hub_token",
    "overwrite_output_dir": "legacy (transformers < 5), no effect: Trainer never read it (open-r1's recipes set it)",
    "logging_dir": "legacy (transformers < 5), no effect: TENSORBOARD_LOGGING_DIR sets TensorBoard's folder",
    "save_safetensors": "legacy (transformers < 5), no effect: checkpoints are always safetensors",
    "reward_timeout": "a time limit for reward functions (a stuck call becomes a reward failure)",
    "signal_grace_period": "how long SIGTERM/SIGINT waits for the current step before the process exits",
    "ignore_output_dir_lock": "opting in to two live runs writing one output_dir (no such field in transformers 5)",
    "zero_variance_groups": "what a group with equal rewards costs: trained ('train', TRL's behaviour), skipped or "
                            "resampled (docs/TRAINING_DATA.md)",
    "max_resample_rounds": "the cap on dynamic sampling's extra generation rounds",
    "keep_sampling_mask": "log-probs over the sampler's kept support under top_k / top_p / min_p",
    "sampling_mismatch_report": "the per-round report of where sampler and trainer log-probs disagree",
    "sampling_mismatch_threshold": "the mismatch report's warning threshold",
    "routing_replay": "Mixture-of-Experts rollout routing replay (R3, docs/MOE.md)",
    "health_checks": "the training-health warnings and summary (docs/HEALTH.md)",
    "health_thresholds": "the training-health checks' thresholds by name (docs/HEALTH.md)",
}
# Shared fields whose default differs on purpose: field -> (ours, reason). (`bf16` is None in both dataclasses; TRL
# resolves it to True, we to what the hardware runs fast: tests/config/test_validation.py.)
DIFFERENT_DEFAULTS = {
    "gradient_checkpointing": (None, "on by default under transformers' current name, activation_checkpointing"),
    "dataloader_pin_memory": (False, "rows are Python objects: nothing to pin"),
}


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


THEIRS, OURS = _fields(trl.GRPOConfig), _fields(GRPOConfig)


def test_every_trl_field_exists_here():
    missing = sorted(set(THEIRS) - set(OURS))
    assert not missing, f"trl {trl.__version__} GRPOConfig has fields grpo_trainer lacks: {missing}"


def test_our_extra_fields_are_the_listed_ones():
    # transformers' newer names that GRPOConfig declares on older releases are not fields of our own
    extra = sorted(set(OURS) - set(THEIRS) - set(compat.BACKPORTED_FIELDS))
    # transformers < 5.15 still carries two of the legacy names (warmup_ratio, logging_dir), deprecated
    still_theirs = set(THEIRS) & set(LEGACY)
    assert extra == sorted(set(OURS_ONLY) - still_theirs), \
        f"unlisted fields of our own (add them to OURS_ONLY with a reason): {extra}"


@pytest.mark.parametrize("name", sorted(THEIRS))
def test_defaults_equal_trls_unless_listed(name):
    ours, theirs = _default(OURS[name]), _default(THEIRS[name])
    if name in DIFFERENT_DEFAULTS:
        assert ours == DIFFERENT_DEFAULTS[name][0] and ours != theirs, f"{name}: update DIFFERENT_DEFAULTS"
        return
    assert repr(ours) == repr(theirs), f"{name}: default {ours!r} here, {theirs!r} in trl {trl.__version__}"


@pytest.mark.parametrize("name", sorted(set(THEIRS) - set(_fields(TrainingArguments))))
def test_types_equal_trls(name):
    ours, theirs = typing.get_type_hints(GRPOConfig)[name], typing.get_type_hints(trl.GRPOConfig)[name]
    if typing.get_origin(ours) is typing.Literal:  # a choice field: TRL's str narrowed to its values (documented)
        assert theirs is str and all(isinstance(value, str) for value in typing.get_args(ours)), name
        return
    assert ours == theirs, f"{name}: {ours} here, {theirs} in trl {trl.__version__}"


def test_trls_1_16_defaults_that_changed_since_older_releases():
    config = GRPOConfig(output_dir="unused", report_to="none")
    assert config.use_bias_correction_kl is True and config.loss_type == "dapo" and config.beta == 0.0
    assert config.router_aux_loss_coef is None
    assert config.pad_to_multiple_of is None  # "auto" resolves to no padding off Neuron


def test_deprecated_spellings_map_to_their_replacements_with_trls_warning():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        config = GRPOConfig(output_dir="unused", report_to="none", vllm_importance_sampling_cap=2.5)
    assert config.vllm_importance_sampling_clip_max == 2.5
    assert GRPOConfig(output_dir="unused", report_to="none", pad_to_multiple_of="none").pad_to_multiple_of is None


def test_every_trl_feature_is_built():
    # the last ones were use_vllm (issue 21) and max_tool_calling_iterations (issue 22); the guard that refused
    # fields of unbuilt features is gone with them
    assert GRPOConfig(output_dir="unused", report_to="none", use_vllm=True).use_vllm
    assert GRPOConfig(output_dir="unused", report_to="none", max_tool_calling_iterations=2).max_tool_calling_iterations


def test_every_legacy_name_is_listed_with_its_reason():
    assert sorted(name for name, reason in OURS_ONLY.items() if reason.startswith("legacy")) == sorted(LEGACY)


def test_dict_fields_given_as_json_strings_are_parsed_as_trl_parses_them():
    """Command lines and YAML recipes pass dict fields as JSON strings; TRL lists the same four for parsing."""
    config = GRPOConfig(output_dir="unused", report_to="none", generation_kwargs='{"top_k": 5}',
                        model_init_kwargs='{"dtype": "float32"}', chat_template_kwargs='{"enable_thinking": false}',
                        transformers_continuous_batching_config='{"max_memory_percent": 0.3}')
    assert config.generation_kwargs == {"top_k": 5} and config.model_init_kwargs == {"dtype": "float32"}
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.transformers_continuous_batching_config == {"max_memory_percent": 0.3}
    assert set(GRPOConfig._VALID_DICT_FIELDS) == set(trl.GRPOConfig._VALID_DICT_FIELDS)
