"""What `GRPOTrainer` writes for others to use: the model card, and a merged full model from an adapter.

Decisions:

1. A card (README.md) is written on every save (`save_model`, each checkpoint) and before each push, so any
   saved folder says what it is, how it was trained and how to load it. Under PEFT the folder holds only the
   adapter (`adapter_config.json`, `adapter_model.safetensors`) and the tokenizer; the Trainer already saves a
   `PeftModel` that way.
2. The card's `library_name` is `peft` for an adapter and `transformers` for a full model: the Hub reads it to
   show the right loading code and to list an adapter under its base model. grpo_trainer is named in the tags
   and the text instead.
3. `base_model` is set only when it is a Hub id. A local folder or a model built from a config has no id the
   Hub could link to, so it is left out.
4. The card lists only the settings that decide what was optimised (estimator, loss, beta, G, clipping, ...) and
   the reward functions with their weights; the full `GRPOConfig` is saved next to it in training_args.bin. It also
   carries the training-health summary (docs/HEALTH.md): what was diagnosed during training and whether it cleared.
5. Merging copies the adapter model and merges the copy (`peft`'s `merge_and_unload`): merging in place and
   unmerging afterwards would leave base weights that differ from the originals by rounding. The copy costs
   one more model in memory for the duration of the save; a 4-bit (QLoRA) base is refused, because merging into
   quantized weights would round the adapter away (reload the base in 16 bits and merge there instead).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub import ModelCard, ModelCardData
from torch import nn

from grpo_trainer.algorithms.advantage import ADVANTAGE_ESTIMATORS

__all__ = ["RunCard", "adapter_settings", "base_model_id", "estimator_name", "grpo_settings", "merge_adapter_copy",
           "render_model_card", "save_merged_model", "write_model_card"]

LIBRARY_TAGS = ["grpo_trainer", "grpo", "reinforcement-learning"]

# The GRPOConfig fields that decide what the run optimised, in the order the card lists them.
CARD_FIELDS = ("num_generations", "scale_rewards", "loss_type", "beta", "epsilon", "epsilon_high", "delta",
               "importance_sampling_level", "num_iterations", "top_entropy_quantile", "mask_truncated_completions",
               "temperature", "max_completion_length", "learning_rate")


def _peft_config(model: nn.Module) -> Any:
    """The active adapter's config of a `PeftModel`, else None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return configs.get(getattr(model, "active_adapter", None)) or next(iter(configs.values()))


def base_model_id(model: nn.Module) -> str | None:
    """The Hub id the model (or its adapter) was loaded from; None for a local folder or a config-built model."""
    name = getattr(_peft_config(model), "base_model_name_or_path", None) \
        or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name or os.path.isdir(name) or os.path.isabs(name) or name.count("/") > 1:
        return None
    return name


def estimator_name(advantage_fn: Any, configured: str | None = None) -> str:
    """Registry name of an advantage estimator (or the callable's own name for an unregistered one)."""
    def matches(entry: Any) -> bool:
        return advantage_fn is entry or (isinstance(entry, type) and type(advantage_fn) is entry)

    if configured in ADVANTAGE_ESTIMATORS and matches(ADVANTAGE_ESTIMATORS[configured]):
        return configured
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        if matches(entry):
            return name
    return getattr(advantage_fn, "__name__", None) or type(advantage_fn).__name__


def grpo_settings(fields: dict[str, Any], advantage_fn: Any, configured_estimator: str | None = None
                  ) -> dict[str, Any]:
    """The settings a reader needs to reproduce the run's objective: `{field: value}` (`fields`: the config's
    values of `CARD_FIELDS`)."""
    settings: dict[str, Any] = {"advantage_estimator": estimator_name(advantage_fn, configured_estimator)}
    settings.update({name: fields[name] for name in CARD_FIELDS})
    return settings


@dataclass(frozen=True)
class RunCard:
    """What a run's model card says beyond the model itself (built by the trainer from its config)."""

    output_dir: str
    repo_id: str | None  # `hub_model_id`
    settings: dict[str, Any]  # `grpo_settings`
    reward_names: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    health: tuple[str, ...] = ()  # the training-health summary's lines (docs/HEALTH.md); () when the checks are off


def adapter_settings(model: nn.Module) -> dict[str, Any] | None:
    """The adapter's type, rank, alpha, dropout and target modules; None for a model without an adapter."""
    config = _peft_config(model)
    if config is None:
        return None
    targets = getattr(config, "target_modules", None)
    settings = {"peft_type": str(getattr(config.peft_type, "value", config.peft_type)),
                "r": getattr(config, "r", None), "lora_alpha": getattr(config, "lora_alpha", None),
                "lora_dropout": getattr(config, "lora_dropout", None),
                "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets}
    return {k: v for k, v in settings.items() if v is not None}


def _table(rows: dict[str, Any]) -> str:
    return "\n".join(["| setting | value |", "|---|---|", *(f"| `{k}` | `{v}` |" for k, v in rows.items())])


def _usage(repo: str, base_model: str | None, is_adapter: bool) -> str:
    if is_adapter:
        base = base_model or "<base model id or path>"
        return ("```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, "
                f"AutoTokenizer\n\nbase = AutoModelForCausalLM.from_pretrained(\"{base}\")\n"
                f"model = PeftModel.from_pretrained(base, \"{repo}\")\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n"
                "# Optional: fold the adapter into the weights for faster inference.\n"
                "model = model.merge_and_unload()\n```")
    return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\")\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n```")


def render_model_card(*, model_name: str, repo: str, base_model: str | None, is_adapter: bool,
                      settings: dict[str, Any], reward_names: list[str], reward_weights: list[float] | None,
                      adapter: dict[str, Any] | None = None, tags: list[str] | None = None,
                      dataset_name: str | None = None, health: list[str] | None = None) -> ModelCard:
    """A Hub model card: YAML metadata (base model, library, tags) and a text body (usage, settings, rewards, and
    the training-health summary when there is one)."""
    all_tags = list(dict.fromkeys([*LIBRARY_TAGS, *(["lora", "peft"] if is_adapter else []), *(tags or [])]))
    data = ModelCardData(base_model=base_model, library_name="peft" if is_adapter else "transformers",
                         model_name=model_name, tags=all_tags, pipeline_tag="text-generation",
                         datasets=[dataset_name] if dataset_name else None)
    base = f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else "a causal language model"
    kind = (adapter or {}).get("peft_type", "PEFT")
    what = f"A {kind} adapter for {base}" if is_adapter else f"A fine-tune of {base}"
    weights = reward_weights or [1.0] * len(reward_names)
    rewards = "\n".join(f"- `{name}` (weight {w:g})" for name, w in zip(reward_names, weights))
    sections = [
        f"# {model_name}",
        f"{what}, trained with reinforcement learning (GRPO-family policy optimisation) by `grpo_trainer`"
        + (f" on `{dataset_name}`." if dataset_name else "."),
        "## Usage", _usage(repo, base_model, is_adapter),
        "## Training settings", _table(settings),
        "## Reward functions", rewards or "- (none recorded)",
    ]
    if health:
        sections += ["## Training health", "\n".join(health)]
    if adapter:
        sections += ["## Adapter", _table(adapter)]
    versions = {"grpo_trainer": _version("grpo_trainer"), "transformers": _version("transformers"),
                "peft": _version("peft") if is_adapter else None, "torch": torch.__version__}
    sections += ["## Framework versions",
                 "\n".join(f"- {name}: {v}" for name, v in versions.items() if v is not None)]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def _version(package: str) -> str | None:
    try:
        module = __import__(package)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def write_model_card(run: RunCard, folder: str, model: nn.Module, model_name: str | None = None,
                     dataset_name: str | None = None, tags: str | list[str] | None = None) -> str:
    """Render the card of `run` and `model` (the unwrapped policy, or a merged copy) into `folder`/README.md."""
    model_name = model_name or (run.repo_id or os.path.basename(os.path.abspath(run.output_dir))).split("/")[-1]
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    tags += [t for t in getattr(model, "model_tags", None) or [] if t not in tags]
    adapter = adapter_settings(model)
    card = render_model_card(model_name=model_name, repo=run.repo_id or model_name, base_model=base_model_id(model),
                             is_adapter=adapter is not None, settings=run.settings,
                             reward_names=list(run.reward_names),
                             reward_weights=None if run.reward_weights is None else list(run.reward_weights),
                             adapter=adapter, tags=tags, dataset_name=dataset_name, health=list(run.health))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "README.md")
    card.save(path)
    return path


def merge_adapter_copy(model: nn.Module) -> nn.Module:
    """A full model with the adapter folded into its weights; `model` itself is left untouched."""
    if _peft_config(model) is None:
        raise ValueError("the model has no adapter to merge; save_model already writes the full model.")
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise ValueError("cannot merge into a quantized (QLoRA) base: the merge would round the adapter away. "
                         "Reload the base model in bf16/fp32, attach the saved adapter with "
                         "PeftModel.from_pretrained, then call merge_and_unload() (see docs/ADAPTERS.md).")
    merged = copy.deepcopy(model).merge_and_unload()
    merged.requires_grad_(False)
    return merged


def save_merged_model(model: nn.Module, processing_class: Any, run: RunCard, output_dir: str, should_save: bool
                      ) -> str:
    """Merge `model`'s adapter into a copy of the base model and save it as a full model (+ tokenizer, card)."""
    merged = merge_adapter_copy(model)
    if should_save:
        merged.save_pretrained(output_dir)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        write_model_card(run, output_dir, model=merged)
    return output_dir
