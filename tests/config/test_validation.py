"""Every bad input of docs/ERRORS.md raises one clear error, naming the field and the fix, before any model is
loaded or any token generated."""

import contextlib
import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_reward

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")


@pytest.mark.parametrize("overrides, message", [
    ({"num_generations": 1}, "num_generations must be >= 2"),
    ({"per_device_train_batch_size": 3}, "must be divisible by num_generations"),
    ({"generation_batch_size": 8, "steps_per_generation": 2}, "cannot both be set"),
    ({"generation_batch_size": 6}, "must be a multiple of per_device_train_batch_size"),
    ({"epsilon": 0.0}, "epsilon must be > 0"),
    ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high (0.1) must be >= epsilon (0.2)"),
    ({"delta": 0.5}, "delta must be > 1"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"beta": -0.1}, "beta must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"max_completion_length": 0}, "max_completion_length must be >= 1"),
    ({"max_prompt_length": 0}, "max_prompt_length must be >= 1 or None"),
    ({"num_iterations": 0}, "num_iterations must be >= 1"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in [0, 1]"),
    ({"top_entropy_quantile": -0.1}, "top_entropy_quantile must be in [0, 1]"),
    ({"multi_objective_aggregation": "mean"}, "unknown multi_objective_aggregation 'mean'; choose one of"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min (0.5) must be <= entropy_coef_max"),
    ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold must be > 0"),
    ({"loss_type": "ppo"}, "unknown loss_type 'ppo'; choose one of"),
    ({"advantage_estimator": "gae"}, "unknown advantage_estimator 'gae'; choose one of"),
    ({"importance_sampling_level": "seq"}, "unknown importance_sampling_level 'seq'"),
    ({"scale_rewards": "prompt"}, "unknown scale_rewards 'prompt'"),
    ({"reward_error_policy": "skip"}, "unknown reward_error_policy 'skip'"),
    ({"reward_timeout": 0.0}, "reward_timeout must be > 0 seconds or None (got 0.0)"),
    ({"signal_grace_period": -1.0}, "signal_grace_period must be >= 0 seconds (got -1.0)"),
    ({"sync_ref_model": True, "beta": 0.0}, "sync_ref_model=True needs beta > 0"),
    ({"memory_check": "maybe"}, "unknown memory_check 'maybe'; choose 'auto', 'error', 'warn' or 'off'"),
    ({"vllm_mode": "remote"}, "unknown vllm_mode 'remote'; choose 'colocate' or 'server'"),
    ({"vllm_importance_sampling_mode": "token"}, "unknown vllm_importance_sampling_mode 'token'"),
    ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0},
     "vllm_importance_sampling_clip_min (2.0) must be less than vllm_importance_sampling_clip_max (1.0)"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
     "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or _clip_max"),
    ({"loss_type": "vespo", "use_vllm": True}, "VESPO loss requires `vllm_importance_sampling_mode` to be either "
                                               "'token_truncate' or 'token_mask'. Got: sequence_mask."),
    ({"max_tool_calling_iterations": -1}, "max_tool_calling_iterations must be >= 0 or None"),
    ({"padding_free": "yes"}, "padding_free must be True, False or None (got 'yes')"),
    ({"tied_embedding_lookup": 1}, "tied_embedding_lookup must be True, False or None (got 1)"),
    ({"activation_offloading": "yes"}, "activation_offloading must be True or False (got 'yes')"),
    ({"recompute_attention": 1}, "recompute_attention must be True or False (got 1)"),
    ({"vllm_sync_check_interval": -1}, "vllm_sync_check_interval must be >= 0 (got -1); 0 turns the weight-sync"),
    ({"zero_variance_groups": "drop"}, "unknown zero_variance_groups 'drop'; choose one of ('train', 'skip', "
                                       "'resample')"),
    ({"zero_variance_groups": "skip", "beta": 0.1}, "zero_variance_groups='skip' leaves the gradient unchanged only "
                                                    "when a zero-advantage completion adds nothing to the loss, but "
                                                    "beta=0.1 (the KL term) gives it a gradient"),
    ({"zero_variance_groups": "skip", "entropy_coef": 0.1}, "but the entropy bonus (entropy_coef / "
                                                            "use_adaptive_entropy) gives it a gradient"),
    ({"zero_variance_groups": "skip", "use_adaptive_entropy": True}, "but the entropy bonus"),
    ({"zero_variance_groups": "skip", "top_entropy_quantile": 0.5}, "but top_entropy_quantile=0.5 (its quantile "
                                                                    "counts every completion's tokens)"),
    ({"max_resample_rounds": -1}, "max_resample_rounds must be >= 0 (got -1)"),
    ({"zero_variance_groups": "resample", "async_rollouts": 1}, "zero_variance_groups='resample' generates its extra "
                                                                "prompts while the round is assembled"),
    ({"sampling_mismatch_threshold": 0.0}, "sampling_mismatch_threshold must be > 0 nats (got 0.0)"),
])
def test_config_rejects(overrides, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**{**BASE, **overrides})
    assert message in str(error.value)


def test_scale_rewards_accepts_booleans_like_trl():
    assert GRPOConfig(**BASE, scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(**BASE, scale_rewards=False).scale_rewards == "none"


def test_generation_batch_defaults_follow_trl():
    args = GRPOConfig(**BASE, gradient_accumulation_steps=3)
    assert (args.steps_per_generation, args.generation_batch_size) == (3, 12)
    args = GRPOConfig(**BASE, generation_batch_size=8)
    assert args.steps_per_generation == 2


def test_precision_follows_the_hardware_on_cpu():
    assert GRPOConfig(**BASE).bf16 is False  # no native bf16 here: fp32, not a 30x slower bf16 path


@pytest.fixture
def args(tmp_path):
    return GRPOConfig(**{**BASE, "output_dir": str(tmp_path)})


def make(args, tokenizer, model=None, reward_funcs=copy_digits_reward, dataset=None, **kwargs):
    dataset = Dataset.from_dict({"prompt": ["copy 1:"] * 4}) if dataset is None else dataset
    return GRPOTrainer("a/model-id-that-is-never-downloaded" if model is None else model, reward_funcs, args=args,
                       train_dataset=dataset, processing_class=tokenizer, **kwargs)


@pytest.mark.parametrize("reward_funcs, kwargs, message", [
    ([], {}, "No reward source provided"),
    (None, {}, "No reward source provided"),  # TRL 1.16's reward_funcs is optional, a reward is not
    ([copy_digits_reward, 3], {}, "reward_funcs[1] is a int"),
    ([copy_digits_reward], {"reward_processing_classes": [None, None]},
     "The number of reward processing classes (2) must match the number of reward functions (1)"),
    # TRL: a single processing class is a list of one, so two rewards need a list of two
    ([copy_digits_reward, copy_digits_reward], {"reward_processing_classes": "one-tokenizer"},
     "The number of reward processing classes (1) must match the number of reward functions (2)"),
])
def test_reward_setup_is_checked_before_loading(args, tokenizer, reward_funcs, kwargs, message):
    with pytest.raises(ValueError) as error:
        make(args, tokenizer, reward_funcs=reward_funcs, **kwargs)
    assert message in str(error.value)


def test_reward_weights_length(tmp_path, tokenizer):
    args = GRPOConfig(**{**BASE, "output_dir": str(tmp_path), "reward_weights": [1.0, 2.0]})
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1 reward functions"):
        make(args, tokenizer)


@pytest.mark.parametrize("dataset, message", [
    (Dataset.from_dict({"question": ["a"]}), "train_dataset has no 'prompt' column"),
    (Dataset.from_dict({"prompt": []}), "train_dataset is empty"),
    (Dataset.from_dict({"prompt": [3]}), "must hold strings or lists of {'role', 'content'} messages"),
    (Dataset.from_dict({"prompt": [[{"text": "hi"}]]}), "must hold strings or lists of {'role', 'content'}"),
    (Dataset.from_dict({"prompt": ["copy 1:", "copy 2:", None, "copy 4:"]}), "train_dataset row 2 has no prompt"),
    (Dataset.from_dict({"prompt": ["copy 1:"]}), "train_dataset has 1 prompts but one generation round needs 2"),
])
def test_dataset_is_checked_before_loading(args, tokenizer, dataset, message):
    with pytest.raises(ValueError) as error:
        make(args, tokenizer, dataset=dataset)
    assert message in str(error.value)


def test_conversational_prompts_need_a_chat_template(args, tokenizer):
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", eos_token="<eos>")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    with pytest.raises(ValueError, match="the tokenizer has no chat_template"):
        make(args, plain, dataset=dataset)


def test_sync_ref_model_with_peft_is_rejected(tmp_path, tokenizer):
    from peft import LoraConfig

    args = GRPOConfig(**{**BASE, "output_dir": str(tmp_path), "sync_ref_model": True, "beta": 0.1})
    with pytest.raises(ValueError, match="sync_ref_model is not supported with PEFT"):
        make(args, tokenizer, peft_config=LoraConfig(r=2))


def test_iterable_dataset_needs_max_steps(args, tokenizer):
    dataset = Dataset.from_dict({"prompt": ["copy 1:"] * 4}).to_iterable_dataset()
    with pytest.raises(ValueError, match="set max_steps > 0"):
        make(args, tokenizer, dataset=dataset)


def test_unknown_estimator_object_is_rejected(args, tokenizer):
    with pytest.raises(ValueError, match="advantage_estimator must be a name, an Advantage or a callable"):
        make(args, tokenizer, advantage_estimator=42)


def test_checkpointing_defaults_on_like_trl_and_either_name_turns_it_off():
    config = GRPOConfig(**BASE)
    assert config.gradient_checkpointing is True and config.activation_checkpointing is True
    config = GRPOConfig(**BASE, activation_checkpointing=False)
    assert config.gradient_checkpointing is False and config.activation_checkpointing is False
    # TRL scripts use gradient_checkpointing, which transformers >= 5.23 deprecates (older releases have only it)
    deprecated = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    with pytest.warns(FutureWarning) if deprecated else contextlib.nullcontext():
        config = GRPOConfig(**BASE, gradient_checkpointing=False)
    assert config.activation_checkpointing is False and config.gradient_checkpointing is False


@pytest.mark.parametrize("overrides", [
    {"entropy_coef": 0.1}, {"use_adaptive_entropy": True}, {"off_policy_mask_threshold": 0.5},
    {"multi_objective_aggregation": "normalize_then_sum"}, {"loss_type": "luspo"}, {"loss_type": "vespo"},
    {"top_entropy_quantile": 0.0},
])
def test_built_features_are_accepted(overrides):
    args = GRPOConfig(**{**BASE, **overrides})
    assert all(getattr(args, name) == value for name, value in overrides.items())


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"importance_sampling_level": "sequence", "loss_type": "dapo"}, "weights each sequence by its completion length"),
    ({"importance_sampling_level": "sequence", "loss_type": "cispo"}, "weights each sequence by its completion length"),
    ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, None),
    ({"importance_sampling_level": "token", "loss_type": "luspo"}, "loss_type='luspo' is designed for"),
    ({"importance_sampling_level": "sequence", "loss_type": "luspo"}, None),
    ({"importance_sampling_level": "sequence", "loss_type": "vespo"}, "loss_type='vespo' builds its own"),
])
def test_advisories(overrides, expected):
    from grpo_trainer.config.checks import advisories

    messages = advisories(GRPOConfig(**{**BASE, **overrides}))
    assert messages == [] if expected is None else (len(messages) == 1 and expected in messages[0])


@pytest.mark.parametrize("processes, overrides, what, fix", [
    (1, {}, "1 processes (only one group, of all processes, is wired)", "launch 2 processes"),
    (2, {"padding_free": True}, "padding_free=True", "set padding_free=False"),
    (2, {"loss_type": "bnpo"}, "loss_type='bnpo' (untested", "use loss_type='dapo' or 'grpo'"),
    (2, {"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5 (its quantile pools", "set top_entropy_quantile=1.0"),
    (2, {"async_rollouts": 1}, "async_rollouts=1 (untested)", "set async_rollouts=0"),
    (2, {"top_k": 5}, "truncated sampling", "set top_k=0, top_p=1.0, min_p=None"),
    (2, {"recompute_attention": True}, "recompute_attention=True (untested", "set recompute_attention=False"),
    (2, {"use_vllm": True}, "use_vllm=True (untested)", "set use_vllm=False"),
    (2, {"routing_replay": "on"}, "routing_replay='on' (the sharded forward", "set routing_replay='off'"),
    (2, {"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed (only DDP is wired)",
     "accelerate_configs/cpu/ddp_sp.yaml"),
])
def test_sequence_parallelism_refuses_what_does_not_combine_before_loading(tmp_path, tokenizer, monkeypatch,
                                                                           processes, overrides, what, fix):
    """sp_size=2 (docs/DISTRIBUTED.md, "Sequence parallelism"; trained in tests/distributed/test_multiprocess.py's
    ddp_sp modes): each combination it is not wired or tested with is refused by the trainer by name, with its fix,
    before the model (an id never downloaded) loads (`trainer.sequence_group.REFUSALS`)."""
    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: processes))
    fields = {**BASE, "output_dir": str(tmp_path), "parallelism_config": ParallelismConfig(sp_size=2), **overrides}
    if "deepspeed" in overrides:  # TrainingArguments would start DeepSpeed's engine set-up at construction
        args = GRPOConfig(**{k: v for k, v in fields.items() if k != "deepspeed"})
        args.deepspeed = overrides["deepspeed"]
    else:
        args = GRPOConfig(**fields)
    with pytest.raises(ValueError) as error:
        make(args, tokenizer)
    message = str(error.value)
    assert "parallelism_config sp_size=2 (DeepSpeed Ulysses sequence parallelism" in message
    assert f"does not combine with {what}" in message and fix in message, message


def test_every_sequence_parallel_refusal_fires_alone_by_its_name():
    """Each row of `trainer.sequence_group.REFUSALS` on settings that break it alone (activation offloading, which
    the trainer refuses on CPU before, and multi-turn / vision, which need the trainer's inputs, included)."""
    from grpo_trainer.config.refusals import first
    from grpo_trainer.trainer.sequence_group import REFUSALS, ShardingSettings

    fine = ShardingSettings(size=2, processes=2)
    assert first(REFUSALS, fine) is None and first(REFUSALS, ShardingSettings(size=1, use_vllm=True)) is None
    breaking = {"processes": {"processes": 4}, "engine": {"engine": "FSDP"}, "bnpo": {"loss_type": "bnpo"},
                "entropy_quantile": {"top_entropy_quantile": 0.5}, "padding_free": {"padding_free": True},
                "vllm": {"use_vllm": True}, "truncation": {"truncated": True},
                "routing_replay": {"routing_replay": "on"},
                "async": {"async_rollouts": 1}, "offloading": {"activation_offloading": True},
                "recompute_attention": {"recompute_attention": True}, "multi_turn": {"multi_turn": True},
                "vision": {"vision": True}}
    assert set(breaking) == {r.name for r in REFUSALS}
    for name, fields in breaking.items():
        settings = dataclasses.replace(fine, **fields)
        refused = first(REFUSALS, settings)
        assert refused is not None and refused.name == name, name
        assert refused.message(settings).startswith("parallelism_config sp_size=2")


def test_sequence_parallelism_is_accepted_where_wired(tmp_path, monkeypatch):
    """On 2 processes, with the sharded forward's tiled MLP too; `padding_free` left None resolves off there."""
    from accelerate.parallelism_config import ParallelismConfig

    from grpo_trainer.config import settings as typed
    from grpo_trainer.trainer import parts, sequence_group

    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    args = GRPOConfig(**{**BASE, "output_dir": str(tmp_path), "parallelism_config": ParallelismConfig(sp_size=2),
                         "mlp_tile_tokens": 64})
    settings = parts.sharding_settings(args, typed.launch(args), processing_class=None, multi_turn=False)
    sequence_group.sequence_group(2).check(settings)  # nothing refused
    assert not typed.forward_settings(args, "cpu").padding_free


def test_activation_offloading_is_refused_on_cpu_before_loading(args, tokenizer, monkeypatch):
    """The config accepts the option on any machine (`grpo-train plan --device cuda` plans a GPU run anywhere); the
    trainer refuses it by name where the run trains on CPU, before the model (an id never downloaded) is loaded: on
    a machine without an accelerator, and with `use_cpu=True` on one with an accelerator."""
    args.activation_offloading = True
    message = ("activation_offloading=True moves the backward's saved tensors from an accelerator to host memory, "
               "and this run trains on CPU, where they already are; set activation_offloading=False")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOTrainer("someorg/never-downloaded", copy_digits_reward, args=args, processing_class=tokenizer,
                    train_dataset=Dataset.from_dict({"prompt": ["a", "b"] * 4}))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    args.use_cpu = True
    with pytest.raises(ValueError, match="this run trains on CPU, where they already are"):
        GRPOTrainer("someorg/never-downloaded", copy_digits_reward, args=args, processing_class=tokenizer,
                    train_dataset=Dataset.from_dict({"prompt": ["a", "b"] * 4}))


def test_sequence_parallelism_refuses_multi_turn_before_loading(args, tokenizer, monkeypatch):
    """Tools (a multi-turn rollout) with sp_size=2 on 2 processes: refused by the trainer by name, before the model
    (an id never downloaded) is loaded."""
    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    args.parallelism_config, args.padding_free = ParallelismConfig(sp_size=2), False

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first.
            b: second.
        """
        return a + b

    with pytest.raises(ValueError, match=r"sp_size=2 \(DeepSpeed Ulysses sequence parallelism, docs/DISTRIBUTED.md\) "
                                         r"does not combine with multi-turn rollouts"):
        make(args, tokenizer, tools=[add])


@pytest.mark.parametrize("field, engine", [("cp_size", "torch context parallelism")])
def test_sequence_and_context_parallelism_are_refused_before_loading(args, tokenizer, field, engine):
    """Not wired into GRPO (docs/DISTRIBUTED.md, "Sequence parallelism (DeepSpeed Ulysses), and context
    parallelism: refused"): refused by the config, and by
    the trainer for a config changed after it was built, before the model (an id never downloaded) is loaded; the
    message names the field, the reason, and what fits a longer completion instead."""
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError) as built:
        GRPOConfig(**{**BASE, "parallelism_config": ParallelismConfig(**{field: 2})})
    args.parallelism_config = ParallelismConfig(**{field: 2})
    with pytest.raises(ValueError) as trained:
        make(args, tokenizer)
    for error in (built, trained):
        message = str(error.value)
        assert f"parallelism_config {field}=2 ({engine}) is not wired into GRPO" in message
        assert "left-padded prompt+completion rows would attend to the padding" in message
        assert f"Set {field}=1" in message and "mlp_tile_tokens" in message and "grpo-train plan" in message
