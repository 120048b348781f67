"""Legacy option names (older TRL and transformers releases) are accepted: each warns naming its replacement and maps
its value there, or warns that it has no effect; never silently ignored."""

import warnings

import pytest
from transformers import HfArgumentParser

from grpo_trainer import GRPOConfig
from grpo_trainer.config.legacy import LEGACY

BASE = {"output_dir": "unused", "report_to": "none"}

# legacy name -> (value set, replacement, value the replacement takes)
MAPPED = {
    "vllm_max_model_len": (4096, "vllm_max_model_length", 4096),
    "token_entropy_percentile_threshold": (0.8, "top_entropy_quantile", 0.2),  # mask the bottom 80% = keep top 20%
    "wandb_log_unique_prompts": (False, "log_unique_prompts", False),
    "use_liger_loss": (True, "use_liger_kernel", True),
    "vllm_guided_decoding_regex": (r"\d+", "vllm_structured_outputs_regex", r"\d+"),
    "evaluation_strategy": ("steps", "eval_strategy", "steps"),
    "warmup_ratio": (0.1, "warmup_steps", 0.1),  # open-r1's recipes all set it
    "no_cuda": (True, "use_cpu", True),
    "per_gpu_train_batch_size": (16, "per_device_train_batch_size", 16),
    "per_gpu_eval_batch_size": (16, "per_device_eval_batch_size", 16),
    "push_to_hub_token": ("hf_secret", "hub_token", "hf_secret"),
}
NO_EFFECT = {"vllm_device": "cuda:7", "vllm_dtype": "bfloat16", "vllm_enable_prefix_caching": True,
             "overwrite_output_dir": True, "logging_dir": "runs/x", "save_safetensors": False}


def test_the_tables_cover_every_legacy_name():
    assert sorted([*MAPPED, *NO_EFFECT]) == sorted(LEGACY)
    assert all(LEGACY[name].replacement == replacement for name, (_, replacement, _) in MAPPED.items())
    assert all(LEGACY[name].replacement is None for name in NO_EFFECT)


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_a_legacy_name_warns_and_sets_its_replacement(name):
    value, replacement, expected = MAPPED[name]
    with pytest.warns(FutureWarning, match=f"{name} is a legacy name .* use {replacement} instead"):
        config = GRPOConfig(**BASE, **{name: value})
    assert str(getattr(getattr(config, replacement), "value", getattr(config, replacement))) == str(expected)


@pytest.mark.parametrize("name", sorted(NO_EFFECT))
def test_a_legacy_name_without_replacement_warns_that_it_has_no_effect(name):
    with pytest.warns(FutureWarning, match=f"{name} is a legacy option .* has no effect: "):
        GRPOConfig(**BASE, **{name: NO_EFFECT[name]})


def test_a_legacy_name_and_its_replacement_must_agree():
    with pytest.raises(ValueError, match="vllm_guided_decoding_regex='a' .* and vllm_structured_outputs_regex='b' are "
                                         "both set"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        GRPOConfig(**BASE, vllm_guided_decoding_regex="a", vllm_structured_outputs_regex="b")
    with pytest.warns(FutureWarning):  # the same value twice is no conflict
        config = GRPOConfig(**BASE, vllm_guided_decoding_regex="a", vllm_structured_outputs_regex="a")
    assert config.vllm_structured_outputs_regex == "a"


def test_the_replacement_is_validated_like_a_direct_setting():
    # 1 - 1.5 = -0.5 is outside (0, 1]: the replacement's own check reports it
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        GRPOConfig(**BASE, token_entropy_percentile_threshold=1.5)


def test_max_prompt_length_is_a_feature_here_not_a_legacy_name():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert GRPOConfig(**BASE, max_prompt_length=512).max_prompt_length == 512


def test_legacy_names_parse_from_the_command_line():
    parser = HfArgumentParser(GRPOConfig)
    with pytest.warns(FutureWarning, match="vllm_guided_decoding_regex is a legacy name"):
        (config,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--report_to", "none",
                                                        "--vllm_guided_decoding_regex", "[ab]+"])
    assert config.vllm_structured_outputs_regex == "[ab]+"
