"""Option names that older TRL releases (and transformers' `TrainingArguments` before 5.0) had and TRL 1.16 no longer
has, still found in popular recipes (open-r1's YAML files, notebooks pinned to an older TRL).

Decisions:

1. Each legacy name is a real `GRPOConfig` field (`LegacyFields`, built from `LEGACY`), so `GRPOConfig(...)`, the
   command line and a YAML recipe accept it. Its default, None, means "not set".
2. A set legacy name warns (`FutureWarning`) naming its replacement, and its value moves there (converted when the
   meaning changed: `token_entropy_percentile_threshold` masked the *bottom* fraction, `top_entropy_quantile` keeps
   the *top* one); a name without a replacement warns that it has no effect and why. Never silently ignored.
3. A legacy name and its replacement set to different values is an error: which one was meant is unknowable.
4. `max_prompt_length`, which TRL removed in 0.28, is not legacy here: it is this project's prompt truncation.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LEGACY", "Legacy", "LegacyFields", "resolve_legacy"]


@dataclass(frozen=True)
class Legacy:
    """A removed option: its type, where it was removed, and its replacement (None: no effect here, see `note`)."""

    type: Any
    removed_in: str
    replacement: str | None = None
    convert: Callable[[Any], Any] | None = None  # old value -> the replacement's value (None: the same value)
    note: str = ""


LEGACY: dict[str, Legacy] = {
    # TRL's GRPOConfig
    "vllm_device": Legacy(str | None, "TRL 0.18", note="vLLM's devices follow the launch (vllm_mode 'colocate' "
                                                       "shares the training devices; 'server' is `trl vllm-serve`)."),
    "vllm_dtype": Legacy(str | None, "TRL 0.18", note="vLLM runs in the model's dtype (server: `trl vllm-serve "
                                                      "--dtype`)."),
    "vllm_enable_prefix_caching": Legacy(bool | None, "TRL 0.18", note="prefix caching is a vLLM server setting "
                                                                       "(`trl vllm-serve --enable_prefix_caching`)."),
    "vllm_max_model_len": Legacy(int | None, "TRL 0.18", "vllm_max_model_length"),
    "token_entropy_percentile_threshold": Legacy(
        float | None, "TRL 0.20", "top_entropy_quantile", lambda tau: round(1.0 - tau, 12),
        note="it masked the bottom tau of tokens by entropy; top_entropy_quantile keeps the top 1 - tau."),
    "wandb_log_unique_prompts": Legacy(bool | None, "TRL 0.27", "log_unique_prompts"),
    "use_liger_loss": Legacy(bool | None, "TRL 0.28", "use_liger_kernel"),
    "vllm_guided_decoding_regex": Legacy(str | None, "TRL 0.28", "vllm_structured_outputs_regex"),
    # transformers' TrainingArguments, which GRPOConfig extends
    "evaluation_strategy": Legacy(str | None, "transformers 4.46", "eval_strategy"),
    "warmup_ratio": Legacy(float | None, "transformers 5.0", "warmup_steps",
                           note="a warmup_steps below 1 is a ratio of the total steps"),
    "no_cuda": Legacy(bool | None, "transformers 5.0", "use_cpu"),
    "per_gpu_train_batch_size": Legacy(int | None, "transformers 5.0", "per_device_train_batch_size"),
    "per_gpu_eval_batch_size": Legacy(int | None, "transformers 5.0", "per_device_eval_batch_size"),
    "push_to_hub_token": Legacy(str | None, "transformers 5.0", "hub_token"),
    "overwrite_output_dir": Legacy(bool | None, "transformers 5.0", note="Trainer never read it (training scripts "
                                                                         "did): an existing output_dir is written "
                                                                         "into, and resume_from_checkpoint alone "
                                                                         "decides whether a run resumes."),
    "logging_dir": Legacy(str | None, "transformers 5.0", note="TensorBoard's folder is set by the "
                                                               "TENSORBOARD_LOGGING_DIR environment variable."),
    "save_safetensors": Legacy(bool | None, "transformers 5.0", note="checkpoints are always safetensors."),
}


def _help(name: str, legacy: Legacy) -> str:
    target = f"use {legacy.replacement} instead" if legacy.replacement else "no effect"
    return f"Legacy name (removed in {legacy.removed_in}): {target}. {legacy.note}".strip()


LegacyFields = dataclasses.make_dataclass(
    "LegacyFields",
    [(name, legacy.type, dataclasses.field(default=None, metadata={"help": _help(name, legacy)}))
     for name, legacy in LEGACY.items()],
)
LegacyFields.__doc__ = "The legacy option names as dataclass fields (a base of GRPOConfig); None = not set."
LegacyFields.__module__ = __name__


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # an Enum (IntervalStrategy) compares by its string


def resolve_legacy(config: Any) -> None:
    """Warn about every legacy name set on `config` and move its value to its replacement (decisions 2 and 3).
    Runs before the rest of `__post_init__`, so the replacement is validated and converted as if set directly."""
    defaults = {f.name: f for f in dataclasses.fields(config)}
    for name, legacy in LEGACY.items():
        value = getattr(config, name)
        if value is None:
            continue
        if legacy.replacement is None:
            warnings.warn(f"{name} is a legacy option (removed in {legacy.removed_in}) and has no effect: "
                          f"{legacy.note}", FutureWarning, stacklevel=4)
            continue
        new = legacy.convert(value) if legacy.convert else value
        current, default = getattr(config, legacy.replacement), defaults[legacy.replacement]
        default_value = default.default_factory() if default.default_factory is not dataclasses.MISSING \
            else default.default
        if _plain(current) not in (_plain(default_value), _plain(new)):
            raise ValueError(f"{name}={value!r} (a legacy name of {legacy.replacement}) and "
                             f"{legacy.replacement}={current!r} are both set; keep only {legacy.replacement}.")
        note = f" ({legacy.note})" if legacy.note else ""
        warnings.warn(f"{name} is a legacy name (removed in {legacy.removed_in}); use {legacy.replacement} instead. "
                      f"Taking {legacy.replacement}={new!r}{note}.", FutureWarning, stacklevel=4)
        setattr(config, legacy.replacement, new)
