"""What `GRPOTrainer.__init__` builds before `Trainer.__init__` runs: checked inputs, the processing class, the policy
and its reference, the reward sources and the multi-turn set-up. Each step is a function of the config and its
inputs, returning what it built; errors are raised before anything expensive loads.

Decisions:

1. Datasets, reward set-up, processors and backends are checked before any model is loaded; a model id whose code is
   untrusted is refused before its tokenizer loads (that may already run its code).
2. Environments are built first: the rewards they own count as reward sources, after `reward_funcs`, each with
   weight 1 (TRL).
3. A vision-language model's processor: the continuous-batching engine is refused (it takes no image inputs), and
   DDP looks for unused parameters unless set (a round without images leaves the vision tower without gradients;
   reentrant checkpointing cannot look, so it is left alone), as TRL does.
4. On CUDA, the defaults this project holds back until they have run on a GPU (`planning.levers`) are named once per
   process, when the first trainer is built there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import IterableDataset

from grpo_trainer.config import GRPOConfig
from grpo_trainer.config.checks import LONG_COMPLETION_LEVERS
from grpo_trainer.config.settings import device_of, reward_settings, turn_settings
from grpo_trainer.data.checks import check_dataset, check_enough_prompts, eval_datasets, prepare_for_streaming
from grpo_trainer.modeling import unwrap
from grpo_trainer.planning import levers
from grpo_trainer.rewards import scoring as rewards
from grpo_trainer.rewards.checks import as_processing_classes
from grpo_trainer.rewards.sources import RewardSources
from grpo_trainer.rollout import multimodal, multiturn
from grpo_trainer.runtime import models

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")

__all__ = ["Policy", "build_policy", "build_reward_sources", "check_device", "check_inputs", "check_processor_setup",
           "load_processing_class", "multi_turn_of", "note_held_back"]


def check_inputs(args: GRPOConfig, model: Any, train_dataset: Any, eval_dataset: Any, processing_class: Any,
                 peft_config: Any, prompt_optional: bool = False) -> None:
    """Datasets and the options that depend on them, before any model is loaded. `prompt_optional`: environments
    write the prompts (`rollout.multiturn`)."""
    check_dataset(train_dataset, "train_dataset", processing_class, prompt_optional=prompt_optional)
    check_enough_prompts(train_dataset, "train_dataset", args.generation_batch_size, args.num_generations)
    for name, dataset in eval_datasets(eval_dataset):
        check_dataset(dataset, f"eval_dataset[{name!r}]" if name != "eval" else "eval_dataset", processing_class,
                      prompt_optional=prompt_optional)
    prepare_for_streaming(train_dataset, eval_dataset, args)
    if args.zero_variance_groups == "resample" and not _indexable(train_dataset):
        raise ValueError("zero_variance_groups='resample' draws its extra prompts from train_dataset by index, and "
                         f"a {type(train_dataset).__name__} has none; pass a map-style dataset (datasets.Dataset, "
                         "a list of rows), or use zero_variance_groups='train' or 'skip'.")
    if args.use_liger_kernel:
        args.liger_kernel_config = models.liger_kernel_config(args.liger_kernel_config)
    if args.sync_ref_model and (peft_config is not None or unwrap.is_peft_model(model)):
        raise ValueError("sync_ref_model is not supported with PEFT: the reference is the adapter-free base "
                         "model, which never changes. Set sync_ref_model=False.")


def check_device(args: GRPOConfig) -> None:
    """What the machine the run trains on must have, before anything is loaded: an accelerator for
    `activation_offloading` (TRL's manager copies from one to host memory). Not a config rule: `grpo-train plan
    --device cuda` builds the config of a GPU run on any machine."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if args.activation_offloading and (args.use_cpu or accelerator is None):
        raise ValueError("activation_offloading=True moves the backward's saved tensors from an accelerator to host "
                         "memory, and this run trains on CPU, where they already are; set "
                         f"activation_offloading=False (on CPU, longer completions fit with {LONG_COMPLETION_LEVERS}).")


_NOTED: set[str] = set()  # the held-back notes this process has logged (decision 4: once)


def note_held_back(args: GRPOConfig) -> None:
    """Decision 4: on a device where some of this project's defaults are held back (`planning.levers`), say once
    which and why."""
    note = levers.held_back_note(device_of(args))
    if note is not None and note not in _NOTED:
        _NOTED.add(note)
        logger.warning(note)


def _indexable(dataset: Any) -> bool:
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and not isinstance(dataset, IterableDataset)


def check_processor_setup(args: GRPOConfig, processing_class: Any) -> None:
    """Decision 3."""
    if not multimodal.is_processor(processing_class):
        return
    if args.use_transformers_continuous_batching or args.use_transformers_paged:
        raise ValueError("`use_transformers_continuous_batching` does not support multimodal models. Use "
                         "generation_backend='generate' (or 'fast', whose rounds with images run on generate).")
    reentrant = (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
    if args.ddp_find_unused_parameters is None and not reentrant:
        args.ddp_find_unused_parameters = True


def load_processing_class(model: str | nn.Module, processing_class: Any, args: GRPOConfig) -> Any:
    """The given tokenizer or processor, else the model's own (its processor for a vision-language model; left
    padding and truncation), with a pad token (decision 1)."""
    kwargs = models.init_kwargs(args.model_init_kwargs, args.trust_remote_code)
    trust, revision = kwargs["trust_remote_code"], kwargs.get("revision") if isinstance(model, str) else None
    if isinstance(model, str):
        models.check_remote_code(model, trust, revision)
    if processing_class is None:
        model_id = model if isinstance(model, str) else model.config._name_or_path
        processing_class = models.load_processing_class(model_id, trust, revision, padding_side="left",
                                                        truncation_side="left")
    tokenizer = multimodal.text_tokenizer(processing_class)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processing_class


@dataclass
class Policy:
    model: nn.Module  # loaded, adapter-wrapped, head cast as asked
    ref_model: nn.Module | None  # None: no KL term, or the adapter-disabled policy (PEFT)
    router_aux_loss_coef: float  # the MoE router's auxiliary loss weight (0: off)


def build_policy(model: str | nn.Module, args: GRPOConfig, peft_config: Any, quantization_config: Any) -> Policy:
    model = models.load_policy(model, args.model_init_kwargs, quantization_config, args.trust_remote_code)
    if peft_config is not None:
        set_seed(args.seed)  # the adapter's random init must follow `seed`, like the rest of the run
        model = models.wrap_peft(model, peft_config, args.gradient_checkpointing)
    models.check_adapter(model)
    if args.disable_dropout:
        models.disable_dropout(model)
    coef = models.router_aux_loss_coef(model, args.router_aux_loss_coef)
    if args.cast_lm_head_to_fp32:
        models.cast_lm_head_to_fp32(model)
    reference = models.make_reference_model(model, args.beta, args.model_init_kwargs, args.trust_remote_code)
    if args.cast_lm_head_to_fp32 and reference is not None:
        models.cast_lm_head_to_fp32(reference)  # a copy of the policy already has it; a reloaded one not
    return Policy(model, reference, coef)


def build_reward_sources(funcs: list, processing_classes: Any, args: GRPOConfig,
                         owned: list | None = None) -> RewardSources:
    """Every reward as a callable with the reward-function contract (reward models are loaded here), then the
    environments' `owned` rewards (decision 2)."""
    batch_size = args.reward_model_batch_size or args.per_device_train_batch_size
    built, tokenizers = [], []
    for func, tokenizer in zip(funcs, as_processing_classes(processing_classes, len(funcs))):
        if isinstance(func, str):
            func, loaded_tokenizer = models.load_reward_model(func, args.model_init_kwargs, args.trust_remote_code)
            tokenizer = tokenizer or loaded_tokenizer
        if isinstance(func, nn.Module):
            if tokenizer is None:
                tokenizer = models.load_tokenizer(func.config._name_or_path, args.trust_remote_code)
            func = rewards.RewardModel(func, tokenizer, batch_size)
        built.append(func)
        tokenizers.append(tokenizer)
    owned = owned or []
    weights = list(args.reward_weights or [1.0] * len(built)) + [1.0] * len(owned)
    return RewardSources(built + owned, [rewards.reward_name(f) for f in built] + [f.__name__ for f in owned],
                         weights, tokenizers + [None] * len(owned), reward_settings(args))


def multi_turn_of(processing_class: Any, args: GRPOConfig, tools: list | None,
                  environments: multiturn.Environments | None, rollout_func: Any,
                  backend_multi_turn: bool) -> multiturn.MultiTurn | None:
    """The multi-turn set-up (None for single-turn runs); a backend that cannot continue after a tool's result is
    refused here."""
    if not (tools or environments or rollout_func):
        return None
    multi_turn = multiturn.MultiTurn(processing_class, turn_settings(args), tools, environments)
    if multi_turn.tools and not backend_multi_turn:
        raise ValueError(f"generation_backend={args.generation_backend!r} cannot continue a rollout after a tool's "
                         "result (its capabilities say multi_turn=False); choose another backend.")
    return multi_turn


def training_prompts(train_dataset: Any, environments: multiturn.Environments | None,
                     multi_turn: multiturn.MultiTurn | None, args: GRPOConfig) -> Any:
    """`train_dataset`, or the placeholder of a run whose environment owns the data; chat prompts checked when tools
    or environments talk."""
    if train_dataset is None:
        train_dataset = multiturn.placeholder_dataset(environments, args.max_steps,
                                                      args.generation_batch_size // args.num_generations)
    if multi_turn is not None:
        multi_turn.check_dataset(train_dataset, "train_dataset")
    return train_dataset
