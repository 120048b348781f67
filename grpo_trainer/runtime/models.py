"""Model loading, PEFT wrapping, the reference model and reward models.

Decisions:

1. The reference model is None when `beta == 0`. Under PEFT it is the policy itself with the adapter disabled
   (no second copy in memory). Otherwise it is a frozen copy, prepared for DeepSpeed like the policy.
2. A model given by id is loaded in float32 unless `model_init_kwargs['dtype']` says otherwise (as TRL does).
   `trust_remote_code` (GRPOConfig's, unless `model_init_kwargs` sets it) reaches every `from_pretrained`: the
   policy, its tokenizer, reward models and theirs. A checkpoint that needs its own code and is not trusted is
   refused by `check_remote_code` before anything loads, instead of transformers' interactive prompt.
   A Hub id that cannot be read (not in the cache while offline, gated, not on the Hub) is reported by
   `hub_failure` in one line naming the model and the fix, instead of transformers' generic OSError.
3. Optional dependencies (peft, deepspeed) are imported inside the functions that need them.
4. `cast_lm_head_to_fp32` swaps an untied LM head for a `logprobs.Float32Head` holding a float32 copy of its
   weight. A tied head would drag the input embedding to float32 with it, so it is refused, as TRL documents.
5. A Mixture-of-Experts model's router auxiliary loss weight is resolved once (`router_aux_loss_coef`): the
   config's own coefficient unless the user sets one, and an error when set on a model without a router.
6. A vision-language model (a config with a `vision_config`) loads as `AutoModelForImageTextToText` with its
   processor (`AutoProcessor`), as TRL loads them; under PEFT its adapter goes on the language model only, unless
   the adapter config says where itself (`exclude_modules`, or a regex `target_modules`): the vision tower and
   projector stay frozen, and the reference is the policy with the adapter disabled, as for text.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import cached_file

from grpo_trainer.modeling.logprobs import Float32Head
from grpo_trainer.modeling.unwrap import causal_lm, is_peft_model, is_zero3_partitioned

__all__ = ["cast_lm_head_to_fp32", "check_adapter", "check_remote_code", "disable_dropout", "hub_failure",
           "init_kwargs", "is_vision_language", "liger_kernel_config", "load_policy",
           "load_processing_class", "load_reward_model", "load_tokenizer", "make_reference_model", "reference_context",
           "router_aux_loss_coef", "wrap_peft"]


def init_kwargs(model_init_kwargs: dict | None, trust_remote_code: bool = False) -> dict:
    """`from_pretrained` kwargs: `model_init_kwargs` with a torch dtype (float32 unless set) and trust_remote_code
    (GRPOConfig's, unless `model_init_kwargs` sets its own)."""
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.get("dtype", kwargs.pop("torch_dtype", None))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = torch.float32 if dtype is None else dtype
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    return kwargs


def check_remote_code(model_id: str, trust_remote_code: bool, revision: str | None = None) -> None:
    """Refuse a checkpoint whose architecture exists only as code shipped with it (an `auto_map` in its config for
    a model type transformers does not know) unless `trust_remote_code` is set. Reads config.json only."""
    if trust_remote_code:
        return
    path = cached_file(model_id, "config.json", revision=revision, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)
    if path is None:
        return  # no config to read: from_pretrained reports it
    with open(path) as f:
        config = json.load(f)
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"{model_id!r} contains custom code (its config's auto_map names {sorted(config['auto_map'])} "
                         f"for model_type {config.get('model_type')!r}, which transformers does not implement). Read "
                         "that code, then set trust_remote_code=True in GRPOConfig (`--trust_remote_code True` "
                         "with grpo-train) to run it.")


def hub_failure(model_id: str, error: BaseException) -> str | None:
    """One line naming `model_id` and the fix when `error` (transformers' OSError, chained to huggingface_hub's
    error) says the Hub could not serve it; None for any other failure, which the caller re-raises as it was."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    causes = []
    while error is not None and len(causes) < 8:  # transformers raises `OSError(...) from hub_error`
        causes.append(error)
        error = error.__cause__ or error.__context__
    if any(isinstance(e, GatedRepoError) for e in causes):  # a subclass of RepositoryNotFoundError: test it first
        return (f"model {model_id!r} is gated on the Hub: accept its terms at https://huggingface.co/{model_id}, "
                "then log in with that account (`hf auth login`, or set HF_TOKEN).")
    if any(isinstance(e, RepositoryNotFoundError) for e in causes):
        return (f"model {model_id!r} is neither a local directory nor a model on the Hub: check the id (a local "
                "path must exist; a Hub id looks like 'org/name'); if it is private, log in (`hf auth login`, or "
                "set HF_TOKEN).")
    if any(isinstance(e, LocalEntryNotFoundError) for e in causes):
        offline = "HF_HUB_OFFLINE is set" if _hub_offline() else "the Hub cannot be reached"
        return (f"model {model_id!r} is not in the local Hugging Face cache and {offline}: download it first where "
                f"the Hub is reachable (`hf download {model_id}`), or pass a local directory holding it.")
    return None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_tokenizer(model_id: str, trust_remote_code: bool, revision: str | None = None, **kwargs: Any) -> Any:
    """The tokenizer saved with `model_id` (custom tokenizer code only when `trust_remote_code`)."""
    return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code, **kwargs)


def is_vision_language(config: Any) -> bool:
    """Whether a model config is a vision-language model's (decision 6)."""
    return getattr(config, "vision_config", None) is not None


def load_processing_class(model_id: str, trust_remote_code: bool, revision: str | None = None,
                          **kwargs: Any) -> Any:
    """The processor saved with a vision-language model, else the tokenizer saved with `model_id`."""
    config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
    if is_vision_language(config):
        return AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code,
                                             **kwargs)
    return load_tokenizer(model_id, trust_remote_code, revision, **kwargs)


def load_policy(model: str | nn.Module, model_init_kwargs: dict | None, quantization_config: Any = None,
                trust_remote_code: bool = False) -> nn.Module:
    """A causal LM from a Hub id or a local path; a model that is already loaded is returned as it is."""
    if not isinstance(model, str):
        if quantization_config is not None:
            raise ValueError("quantization_config applies only when `model` is a Hub id or a local path; this model "
                             "is already loaded. Pass its id/path, or load it with quantization_config yourself.")
        return model
    kwargs = init_kwargs(model_init_kwargs, trust_remote_code)
    check_remote_code(model, kwargs["trust_remote_code"], kwargs.get("revision"))
    if quantization_config is not None and kwargs.get("quantization_config") is not None:
        raise ValueError("quantization_config is set both as a trainer argument and in args.model_init_kwargs; "
                         "set it in one place (the trainer argument).")
    quantization_config = quantization_config or kwargs.get("quantization_config")
    if quantization_config is not None:
        if not torch.cuda.is_available():  # checked before any weight is read
            raise ValueError("quantization_config (QLoRA / 4-bit) needs a CUDA GPU, and none is available; drop "
                             "quantization_config to train in full precision with LoRA.")
        kwargs["quantization_config"] = quantization_config
    config = AutoConfig.from_pretrained(model, revision=kwargs.get("revision"),
                                        trust_remote_code=kwargs["trust_remote_code"])
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return auto.from_pretrained(model, **kwargs)


def load_reward_model(model_id: str, model_init_kwargs: dict | None,
                      trust_remote_code: bool = False) -> tuple[nn.Module, Any]:
    """A sequence-classification reward model (one label) and its tokenizer."""
    kwargs = init_kwargs(model_init_kwargs, trust_remote_code)
    check_remote_code(model_id, kwargs["trust_remote_code"], kwargs.get("revision"))
    model = AutoModelForSequenceClassification.from_pretrained(model_id, num_labels=1, **kwargs)
    return model, load_tokenizer(model_id, kwargs["trust_remote_code"], kwargs.get("revision"))


def wrap_peft(model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool) -> nn.Module:
    """Wrap `model` with a fresh adapter; only the adapter trains."""
    from peft import get_peft_model

    if is_peft_model(model):
        raise ValueError("model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
    _refuse_prompt_learning(peft_config)
    targets = getattr(peft_config, "target_modules", None) or []
    if "lm_head" in targets:  # as TRL 1.16; modules_to_save=["lm_head"] (a trained copy of the head) is fine
        raise ValueError("peft_config puts an adapter on lm_head (target_modules); an adapter on the LM head is not "
                         "supported, as in TRL. Leave lm_head out of target_modules, or list it in modules_to_save "
                         "to train the whole head.")
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return get_peft_model(model, _language_model_only(model, peft_config))


def _language_model_only(model: nn.Module, peft_config: Any) -> Any:
    """For a vision-language model, `peft_config` restricted to its language model (decision 6): a copy whose
    `exclude_modules` matches every module outside it. Unchanged for text models, non-LoRA-style configs, and
    configs that already say where adapters go (`exclude_modules`, a regex `target_modules`)."""
    lm = causal_lm(model)
    if not is_vision_language(lm.config) or not hasattr(peft_config, "exclude_modules") \
            or peft_config.exclude_modules or isinstance(getattr(peft_config, "target_modules", None), str):
        return peft_config
    decoder = lm.get_decoder()
    prefix = next((name for name, module in model.named_modules() if module is decoder), None)
    if prefix is None:
        return peft_config
    config = copy.deepcopy(peft_config)
    config.exclude_modules = rf"^(?!{re.escape(prefix)}\.).*"  # every module name outside the language model
    return config


def _refuse_prompt_learning(peft_config: Any) -> None:
    if getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(f"{type(peft_config).__name__} is a prompt-learning PEFT method (virtual tokens prepended by "
                         "PeftModel.forward), which is not supported: rollouts and log-probs run the underlying model "
                         "directly, so they would leave the virtual tokens out. Use LoRA (peft.LoraConfig).")


def check_adapter(model: nn.Module) -> None:
    """Refuse a PeftModel whose active adapter is a prompt-learning method (see `wrap_peft`)."""
    if is_peft_model(model):
        _refuse_prompt_learning(model.peft_config.get(model.active_adapter))


def make_reference_model(model: nn.Module, beta: float, model_init_kwargs: dict | None = None,
                         trust_remote_code: bool = False) -> nn.Module | None:
    """The frozen reference policy (decision 1), or None when it is not needed (beta == 0) or is the adapter-free
    policy. A ZeRO-3 partitioned policy is loaded again from its checkpoint (as TRL does): a deep copy of one
    holds empty partitions, not weights."""
    if beta == 0.0:
        return None
    if is_peft_model(model):
        if any(p.any() for name, p in model.named_parameters() if "lora_B" in name):
            warnings.warn("the PeftModel's adapter is already trained (non-zero lora_B), but the KL reference is "
                          "the base model with the adapter disabled, not this starting point. To measure KL from "
                          "it, merge it (merge_and_unload()) and pass the merged model with peft_config.")
        return None
    if is_zero3_partitioned(model):
        path = getattr(model.config, "_name_or_path", "")
        if not path:
            raise ValueError("beta > 0 under DeepSpeed ZeRO-3 needs a reference model loaded from a checkpoint, but "
                             "the policy has no config._name_or_path. Pass the model as a Hub id or local path, "
                             "build it before GRPOConfig (so it is not partitioned yet), or set beta=0.")
        kwargs = {"dtype": next(model.parameters()).dtype, **(model_init_kwargs or {})}
        reference = load_policy(path, kwargs, trust_remote_code=trust_remote_code)
    else:
        reference = copy.deepcopy(model)
    reference.eval().requires_grad_(False)
    return reference


@contextlib.contextmanager
def reference_context(policy: nn.Module) -> Iterator[None]:
    """Under PEFT, run the policy as the reference model by disabling its adapter."""
    while hasattr(policy, "module") and not is_peft_model(policy):  # DDP / DeepSpeed wrappers
        policy = policy.module
    with policy.disable_adapter():
        yield


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Replace the LM head of `model` by a `Float32Head` holding its weight in float32. Idempotent.

    A tied head shares its weight with the input embedding, so that weight becomes float32 for both (as TRL does);
    the embedding's outputs are cast back to the dtype they had, so the layers still see their own dtype."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is Float32Head:
        return
    if type(head) is not nn.Linear:
        raise ValueError(f"cast_lm_head_to_fp32=True needs a plain nn.Linear LM head; {type(lm).__name__}'s is a "
                         f"{type(head).__name__} (a PEFT adapter on lm_head, or a quantised head). Remove lm_head "
                         "from the adapter's target_modules / modules_to_save, or set cast_lm_head_to_fp32=False.")
    embedding = lm.get_input_embeddings()
    tied = embedding is not None and embedding.weight is head.weight
    fp32 = Float32Head(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    fp32.weight = nn.Parameter(head.weight.detach().float(), requires_grad=head.weight.requires_grad)
    if head.bias is not None:
        fp32.bias = nn.Parameter(head.bias.detach().float(), requires_grad=head.bias.requires_grad)
    if tied:
        dtype = embedding.weight.dtype
        embedding.weight = fp32.weight  # still one parameter: the tie survives, in float32
        if dtype != torch.float32:
            embedding.register_forward_hook(lambda module, args, output: output.to(dtype))
    lm.set_output_embeddings(fp32)


def router_aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """The weight of a Mixture-of-Experts router's load-balancing loss in the GRPO loss: `coef`, or the model
    config's own `router_aux_loss_coef` when `coef` is None (0.0 for a config without one). 0.0 turns it off.
    A model that cannot return its router logits (no `output_router_logits` in its config) has no such loss."""
    config = causal_lm(model).config.get_text_config()
    is_moe = hasattr(config, "output_router_logits")
    if coef and not is_moe:
        raise ValueError(f"router_aux_loss_coef={coef} but {type(causal_lm(model)).__name__} is not a "
                         "Mixture-of-Experts model that returns its router logits, so there is no auxiliary loss to "
                         "weight. Leave router_aux_loss_coef at None (or 0).")
    resolved = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return float(resolved) if is_moe else 0.0


def liger_kernel_config(config: dict | None) -> dict:
    """The Liger kernel settings `Trainer` applies with `use_liger_kernel=True`: its layer kernels only. Liger's
    fused linear cross-entropy replaces the model's forward, which log-probs need as it is (`modeling.logprobs`)."""
    warnings.warn("use_liger_kernel=True is deprecated for GRPO, as in TRL 1.16 (to be removed in TRL 2.0): only "
                  "Liger's layer kernels apply, never its fused loss. Hub kernels are the replacement: "
                  "model_init_kwargs={'use_kernels': True}.", FutureWarning, stacklevel=3)
    config = dict(config or {})
    if config.get("fused_linear_cross_entropy"):
        raise ValueError('liger_kernel_config={"fused_linear_cross_entropy": True} is not supported: it replaces the '
                         "model's forward, and GRPO's log-probs need the model's own forward and LM head.")
    return {**config, "fused_linear_cross_entropy": False}
