"""YAML recipes written for TRL's `trl grpo` and open-r1's GRPO script, read by `grpo-train --config` unchanged.

Decisions:

1. Most recipe keys are fields here: `GRPOConfig`'s (legacy names included, `config.legacy`) and `ScriptArguments`',
   which also carries TRL's `ScriptArguments` / `ModelConfig` names that change what is loaded (`model_revision`,
   `dtype`, `attn_implementation`, quantization, LoRA variants, `dataset_test_split`, `dataset_streaming`) and
   open-r1's `chat_template` and `system_prompt`. `model_init_kwargs` set in the recipe wins over the model keys,
   as in TRL's script.
2. Every other key a known recipe format has is one of: another name of a field (`RENAMED`), an environment
   variable (`ENVIRONMENT`: open-r1's Weights & Biases settings; TRL's `env:` mapping), a key with no effect here
   (`NO_EFFECT`: a warning naming it and why), or an effect grpo-train cannot give (`REFUSED`: an error naming it).
   A key none of them knows is still an error (a typo must not pass).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection
from typing import Any

__all__ = ["ENVIRONMENT", "NO_EFFECT", "REFUSED", "RENAMED", "model_init_kwargs", "quantization_config",
           "translate"]

# recipe key -> the field it names here
RENAMED = {
    "dataset_prompt_column": "prompt_column",  # open-r1
    "torch_dtype": "dtype",  # TRL's ModelConfig before 1.0, open-r1
    "hub_model_revision": "hub_revision",  # open-r1: the Hub branch checkpoints go to
}
# recipe key -> environment variable (open-r1 exports these for Weights & Biases)
ENVIRONMENT = {"wandb_entity": "WANDB_ENTITY", "wandb_project": "WANDB_PROJECT", "wandb_run_group": "WANDB_RUN_GROUP"}

_CODE_REWARD = "a setting of open-r1's code-execution rewards, which grpo-train does not build in"
_OPEN_R1_REWARD = "a setting of one of open-r1's rewards ({}), which grpo-train does not build in"
NO_EFFECT = {
    "benchmarks": "open-r1 launches evaluation jobs after pushing; grpo-train does not",
    "callbacks": "open-r1's callback names (e.g. push_to_hub_revision); pushing follows push_to_hub / hub_revision",
    "push_to_hub_revision": "an open-r1 callback; checkpoints go to hub_revision when push_to_hub is set",
    "overwrite_hub_revision": "an open-r1 callback setting",
    "ignore_bias_buffers": "TRL's DDP workaround for boolean buffers, not needed here",
    **{key: _CODE_REWARD for key in ("code_language", "code_eval_test_batch_size", "code_eval_scoring_mode",
                                     "parallel_code_exec_per_proc", "e2b_router_url", "morph_router_url",
                                     "code_provider", "ioi_provider", "enforce_same_language")},
    **{key: _OPEN_R1_REWARD.format("cosine") for key in ("cosine_min_value_wrong", "cosine_max_value_wrong",
                                                         "cosine_min_value_correct", "cosine_max_value_correct",
                                                         "cosine_max_len")},
    **{key: _OPEN_R1_REWARD.format("repetition_penalty") for key in ("repetition_n_grams", "repetition_max_penalty")},
    **{key: "open-r1's soft_overlong_punishment settings; grpo-train's soft_overlong_punishment starts the penalty a "
            "quarter of max_completion_length before it" for key in ("max_completion_len", "soft_punish_cache")},
}
REFUSED = {
    "dataset_mixture": "a mixture of datasets (open-r1): grpo-train reads one dataset_name. Build the mixture with "
                       "datasets.concatenate_datasets, save it to a .jsonl/.parquet file and pass that file.",
    "datasets": "a mixture of datasets (TRL's DatasetMixtureConfig): grpo-train reads one dataset_name. Build the "
                "mixture with datasets.concatenate_datasets, save it to a file and pass that file.",
}


def translate(values: dict[str, Any], path: str, known: Collection[str]) -> dict[str, Any]:
    """A recipe's `key: value` pairs as this command's fields (decision 2): renamed keys renamed, environment keys
    exported, keys without effect dropped with a warning naming them. Raises ValueError for a refused key, and
    for a key that names a field twice (the recipe's and its other name)."""
    out = {}
    for key, value in values.items():
        if key == "env":  # TRL's parser: environment variables for the run
            if not isinstance(value, dict):
                raise ValueError(f"'env' in {path} must map variable names to values.")
            os.environ.update({str(k): str(v) for k, v in value.items()})
        elif key in ENVIRONMENT:
            os.environ[ENVIRONMENT[key]] = str(value)
        elif key in REFUSED:
            raise ValueError(f"{key!r} in {path} is not supported: {REFUSED[key]}")
        elif key in NO_EFFECT and key not in known:
            warnings.warn(f"{key!r} in {path} has no effect with grpo-train: {NO_EFFECT[key]}.", UserWarning,
                          stacklevel=3)
        elif key in RENAMED and key not in known:
            field = RENAMED[key]
            if field in values and values[field] != value:
                raise ValueError(f"{path} sets both {key!r} ({value!r}) and {field!r} ({values[field]!r}), two names "
                                 f"of one setting; keep {field!r}.")
            out[field] = value
        else:
            out[key] = value
    return out


def model_init_kwargs(script_args: Any, config: Any) -> dict[str, Any] | None:
    """`from_pretrained` kwargs from the model keys (decision 1), under the recipe's own `model_init_kwargs`."""
    kwargs = {name: value for name, value in (("revision", script_args.model_revision),
                                              ("dtype", script_args.dtype),
                                              ("attn_implementation", script_args.attn_implementation))
              if value is not None}
    kwargs.update(config.model_init_kwargs or {})
    return kwargs or None


def quantization_config(script_args: Any) -> Any:
    """A BitsAndBytesConfig for `load_in_4bit` / `load_in_8bit` (TRL's ModelConfig keys), else None."""
    if not (script_args.load_in_4bit or script_args.load_in_8bit):
        return None
    import torch
    from transformers import BitsAndBytesConfig

    compute_dtype = script_args.dtype if script_args.dtype not in (None, "auto") else "float32"
    return BitsAndBytesConfig(load_in_4bit=script_args.load_in_4bit, load_in_8bit=script_args.load_in_8bit,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype),
                              bnb_4bit_quant_type=script_args.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=script_args.use_bnb_nested_quant,
                              bnb_4bit_quant_storage=script_args.bnb_4bit_quant_storage)
