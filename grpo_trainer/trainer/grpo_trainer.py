"""`GRPOTrainer`: a `transformers.Trainer` that trains a causal LM with GRPO, RLOO or any advantage estimator.

What this trainer does, and how it differs from the papers and from TRL:

1. One generation round serves `steps_per_generation x num_iterations` micro-steps. The sampler repeats each
   prompt G times inside one round, in the same order on every process; rewards are gathered across processes
   before advantages are computed, so a group may span processes, and each process keeps its slice.
2. Advantages come from a pluggable estimator (`advantage_estimator`: a registry name, an `Advantage`, or any
   callable with its signature). RLOO is `advantage_estimator="rloo"`, not a second trainer. Missing rewards
   (None) are left out of the baselines.
3. Loss = surrogate then aggregation (+ beta * k3 KL), chosen by `loss_type` (see `losses`). The loss already
   includes gradient-accumulation scaling (`loss_is_scaled_for_ga = True`).
4. Old log-probs are needed only when a rollout is used after an optimizer step (`num_iterations > 1`, or
   more micro-steps per round than per optimizer step); otherwise the ratio is exp(logp - logp.detach()). A
   rollout backend with the `sampling_logps` capability returns each token's log-prob and entropy under the
   weights that sampled it: they are the old log-probs, and on-policy they are the current values too, so the
   loss forward skips the LM-head projection (its backward still recomputes the logits exactly). What a rollout
   keeps for the loss is decided in `rollout.capture`. An inference engine's log-probs (vLLM, `engine_logps`) are
   never stand-ins: they enter through the importance-sampling correction only (`trainer.engine`), and the
   engine gets the policy's weights whenever the optimizer step changed (`sync_weights`).
5. No reference model when `beta == 0`; under PEFT the reference is the policy with its adapter disabled.
6. A round travels as one typed `Round`; each micro-batch is trimmed to its own longest prompt and completion
   once, before any forward pass (`round`), and log-probs never materialise float32 `[B, T, V]` logits
   (`algorithms.logprobs`).

The class is assembled by concern: this module holds the constructor, set-up and data loading; `trainer.rounds`
the generation round (rollout, scoring, micro-batches), `trainer.loss` the loss and the guarded step,
`trainer.lifecycle` training, checkpoints and resume, logging, saving and the Hub.

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward functions.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import Tensor, nn
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel, Trainer, TrainerCallback
from trl.models.utils import prepare_deepspeed, prepare_fsdp

from grpo_trainer import rollout
from grpo_trainer.algorithms import surrogates
from grpo_trainer.algorithms.advantage import Advantage, get_advantage_estimator
from grpo_trainer.algorithms.entropy import EntropyControl
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config.checks import advisories, check_config
from grpo_trainer.data.checks import (
    check_dataset,
    check_enough_prompts,
    eval_datasets,
    prepare_for_streaming,
)
from grpo_trainer.data.sampler import RepeatSampler, repeat_iterable
from grpo_trainer.reporting import completions_hub
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.reward_logs import RewardLogs
from grpo_trainer.rewards import scoring as rewards
from grpo_trainer.rewards.checks import as_processing_classes, check_reward_setup
from grpo_trainer.rollout import multimodal, multiturn
from grpo_trainer.rollout.settings import eos_token_ids
from grpo_trainer.runtime import distributed, interrupts, models
from grpo_trainer.trainer import memory
from grpo_trainer.trainer.lifecycle import LifecycleMixin
from grpo_trainer.trainer.loss import LossMixin
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.rounds import ADVANTAGE_EPS, RoundsMixin

__all__ = ["GRPOTrainer"]

logger = logging.getLogger(__name__)



def _check_inputs(args: GRPOConfig, model: Any, train_dataset: Any, eval_dataset: Any, processing_class: Any,
                  peft_config: Any, prompt_optional: bool = False) -> None:
    """Datasets and the options that depend on them, before any model is loaded. `prompt_optional`: environments
    write the prompts (`rollout.multiturn`)."""
    check_dataset(train_dataset, "train_dataset", processing_class, prompt_optional=prompt_optional)
    check_enough_prompts(train_dataset, "train_dataset", args.generation_batch_size, args.num_generations)
    for name, dataset in eval_datasets(eval_dataset):
        check_dataset(dataset, f"eval_dataset[{name!r}]" if name != "eval" else "eval_dataset", processing_class,
                      prompt_optional=prompt_optional)
    prepare_for_streaming(train_dataset, eval_dataset, args)
    if args.use_liger_kernel:
        args.liger_kernel_config = models.liger_kernel_config(args.liger_kernel_config)
    if args.sync_ref_model and (peft_config is not None or models.is_peft_model(model)):
        raise ValueError("sync_ref_model is not supported with PEFT: the reference is the adapter-free base "
                         "model, which never changes. Set sync_ref_model=False.")


def _identity(features: list[dict]) -> list[dict]:
    return features


class GRPOTrainer(RoundsMixin, LossMixin, LifecycleMixin, Trainer):
    """Group Relative Policy Optimization (Shao et al. 2024) through `transformers.Trainer`.

    Same constructor as `trl.GRPOTrainer`; `reward_funcs` takes callables (TRL's contract), reward models or
    model ids. `args.advantage_estimator` may also be given here as `advantage_estimator=`. `tools`,
    `environment_factory` and `rollout_func` make rollouts multi-turn (`rollout.multiturn`, docs/TOOLS.md).
    """

    _tag_names = ["grpo_trainer", "grpo"]
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        quantization_config: Any = None,
        tools: list | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
        advantage_estimator: str | Advantage | Any = None,
    ) -> None:
        model_id = model if isinstance(model, str) else model.config._name_or_path
        args = args or GRPOConfig(f"{model_id.split('/')[-1]}-GRPO")
        check_config(args)  # again: scripts set fields after building the config
        for message in advisories(args):
            logger.warning(message)
        reward_funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        # Environments first: the rewards they own count as reward sources (rollout.multiturn.environments).
        environments = multiturn.Environments.of(environment_factory, tools)
        owned_rewards = environments.reward_funcs if environments else []
        check_reward_setup(reward_funcs, args, reward_processing_classes, environment_rewards=len(owned_rewards))
        processing_class = self._load_processing_class(model, processing_class, args)
        # The text tokenizer (a processor's own): a plain attribute under TRL's name, which code written against
        # TRL reads and assigns.
        self._tokenizer = multimodal.text_tokenizer(processing_class)
        self.rollout_backend = rollout.select(args)
        multimodal.check_processor_setup(args, processing_class)
        self.rollout_backend.check_model(model, args.trust_remote_code)
        train_dataset = self._set_up_multi_turn(processing_class, args, tools, environments, rollout_func,
                                                train_dataset)
        _check_inputs(args, model, train_dataset, eval_dataset, processing_class, peft_config,
                      prompt_optional=environments is not None)
        self.advantage_fn = get_advantage_estimator(advantage_estimator or args.advantage_estimator, ADVANTAGE_EPS)
        self._surrogate_params = surrogates.SurrogateParams(
            args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high, args.delta,
            args.sapo_temperature_pos, args.sapo_temperature_neg, args.vespo_k_pos, args.vespo_lambda_pos,
            args.vespo_k_neg, args.vespo_lambda_neg)
        self._entropy = EntropyControl(args.entropy_coef, args.use_adaptive_entropy, args.entropy_target,
                                       args.entropy_coef_delta, args.entropy_coef_min, args.entropy_coef_max)
        self._entropy_window: Tensor | None = None  # [sum, tokens] of the current accumulation window

        memory.check_memory(model, args, train_dataset, processing_class, peft_config, quantization_config)
        model = self._build_models(model, args, peft_config, quantization_config)
        if self._multi_turn is not None:
            self._multi_turn.attach_model(eos_token_ids(processing_class, model.generation_config),
                                          getattr(model.config, "max_position_embeddings", None))
        self.reward_funcs, self.reward_names = self._build_rewards(reward_funcs, reward_processing_classes, args)
        # Environment-owned rewards come after `reward_funcs`, each with weight 1 (TRL).
        self.reward_weights = torch.tensor((args.reward_weights or [1.0] * len(self.reward_funcs))
                                           + [1.0] * len(owned_rewards))
        self.reward_funcs += owned_rewards
        self.reward_names += [func.__name__ for func in owned_rewards]
        self.reward_processing_classes += [None] * len(owned_rewards)

        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._prepare_auxiliary_models()
        self._signal_stop = interrupts.SignalStop(args.signal_grace_period)
        self.add_callback(self._signal_stop)
        self.rollout_backend.start(self.model, processing_class)  # an inference engine (vLLM) starts here
        self._buffer: list[Round] | None = None
        self._micro_step = 0
        self._nonfinite_in_a_row = self._nonfinite_since_log = 0
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._completions = CompletionLog(args.output_dir, self.reward_names, args.num_completions_to_print,
                                          args.generation_batch_size, args.log_unique_prompts, args.report_to)
        self._reward_logs = RewardLogs()  # what reward functions pass to log_extra / log_metric
        self._step_time, self._micro_steps_timed = 0.0, 0
        self._completions_upload = None
        if args.log_completions and args.log_completions_hub_repo and self.accelerator.is_main_process:
            self._completions_upload = completions_hub.start_upload(
                args.log_completions_hub_repo, self._completions.directory, args.hub_private_repo, args.hub_token,
                args.hub_model_id)
        set_seed(args.seed, device_specific=True)  # processes must sample different completions

    # ----------------------------------------------------------------------------------------------- set-up

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        distributed.prepare_backend(self)  # FSDP2 on CPU; refuse a launch whose processes would not sync

    @staticmethod
    def _load_processing_class(model: str | nn.Module, processing_class: Any, args: GRPOConfig) -> Any:
        """The given tokenizer or processor, else the model's own (its processor for a vision-language model; left
        padding and truncation), with a pad token. A model id whose code is untrusted is refused first: loading
        its tokenizer may already run that code."""
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

    def _set_up_multi_turn(self, processing_class: Any, args: GRPOConfig, tools: list | None,
                           environments: multiturn.Environments | None, rollout_func: Any, train_dataset: Any) -> Any:
        """`self._multi_turn` (None for single-turn runs) and TRL's attributes for it; the train dataset (a
        placeholder when an environment owns the data), its prompts checked for tools."""
        self._multi_turn = multiturn.MultiTurn(processing_class, args, tools, environments) \
            if tools or environments or rollout_func else None
        # TRL's attributes: every tool, the rollout_func, the latest round's environments, each one's tools and pool
        self.tools, self.rollout_func, self.environments = [], rollout_func, None
        if self._multi_turn is not None:
            self.tools = self._multi_turn.tools
            if self.tools and not self.rollout_backend.capabilities.multi_turn:
                raise ValueError(f"generation_backend={args.generation_backend!r} cannot continue a rollout after a "
                                 "tool's result (its capabilities say multi_turn=False); choose another backend.")
        if environments is not None:
            self._env_tools, self._environment_pool = environments.tools, environments.pools
        if train_dataset is None:
            train_dataset = multiturn.placeholder_dataset(environments, args)
        if self._multi_turn is not None:
            self._multi_turn.check_dataset(train_dataset, "train_dataset")
        return train_dataset

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's name for `reward_names`: each reward source's metric name."""
        return self.reward_names

    def _build_models(self, model: str | nn.Module, args: GRPOConfig, peft_config: Any,
                      quantization_config: Any) -> nn.Module:
        """The policy (loaded, adapter-wrapped, head cast as asked) and `self.ref_model`; resolves the MoE router's
        auxiliary loss (`self.router_aux_loss_coef`, `self.aux_loss_enabled`, TRL's names)."""
        model = models.load_policy(model, args.model_init_kwargs, quantization_config, args.trust_remote_code)
        if peft_config is not None:
            set_seed(args.seed)  # the adapter's random init must follow `seed`, like the rest of the run
            model = models.wrap_peft(model, peft_config, args.gradient_checkpointing)
        models.check_adapter(model)
        if args.disable_dropout:
            models.disable_dropout(model)
        self.router_aux_loss_coef = models.router_aux_loss_coef(model, args.router_aux_loss_coef)
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0
        if args.cast_lm_head_to_fp32:
            models.cast_lm_head_to_fp32(model)
        self.ref_model = distributed.make_reference_model(model, args.beta, args.model_init_kwargs,
                                                          args.trust_remote_code)
        if args.cast_lm_head_to_fp32 and self.ref_model is not None:
            models.cast_lm_head_to_fp32(self.ref_model)  # a copy of the policy already has it; a reloaded one not
        return model

    def _build_rewards(self, funcs: list, processing_classes: Any, args: GRPOConfig) -> tuple[list, list[str]]:
        """Every reward as a callable with the reward-function contract; reward models are loaded here.
        `self.reward_processing_classes`: each reward's tokenizer (None for reward functions), as in TRL."""
        batch_size = args.reward_model_batch_size or args.per_device_train_batch_size
        built, self.reward_processing_classes = [], []
        for func, tokenizer in zip(funcs, as_processing_classes(processing_classes, len(funcs))):
            if isinstance(func, str):
                func, loaded_tokenizer = models.load_reward_model(func, args.model_init_kwargs, args.trust_remote_code)
                tokenizer = tokenizer or loaded_tokenizer
            if isinstance(func, nn.Module):
                if tokenizer is None:
                    tokenizer = models.load_tokenizer(func.config._name_or_path, args.trust_remote_code)
                func = rewards.RewardModel(func, tokenizer, batch_size)
            built.append(func)
            self.reward_processing_classes.append(tokenizer)
        return built, [rewards.reward_name(f) for f in built]

    def _prepare_auxiliary_models(self) -> None:
        """Put the reference and reward models where the policy is (DeepSpeed engines under DeepSpeed)."""
        deepspeed = self.is_deepspeed_enabled

        def prepare(module: nn.Module, shard_under_fsdp: bool = False) -> nn.Module:
            if deepspeed:
                return prepare_deepspeed(module, self.accelerator)
            if shard_under_fsdp and self.is_fsdp_enabled:
                return prepare_fsdp(module, self.accelerator)
            # device_placement: accelerate does not move models under FSDP by default
            return self.accelerator.prepare_model(module, evaluation_mode=True, device_placement=True)

        if self.ref_model is not None:
            self.ref_model = prepare(self.ref_model, shard_under_fsdp=True)
            if self.args.sync_ref_model:
                from trl import SyncRefModelCallback

                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        for func in self.reward_funcs:
            if isinstance(func, rewards.RewardModel):
                func.model = prepare(func.model)

    # -------------------------------------------------------------------------------------------- sampling

    def get_train_dataloader(self):
        # One dataloader batch is one local generation round (steps_per_generation micro-batches).
        dataset, args = self.train_dataset, self.args
        if isinstance(dataset, IterableDataset):  # no sampler: repeat the stream the way RepeatSampler would
            dataset = repeat_iterable(dataset, args.num_generations, args.generation_batch_size // args.num_generations,
                                      args.num_iterations * args.steps_per_generation)
        return self._get_dataloader(dataset, "Training",
                                    self._train_batch_size * self.args.steps_per_generation,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_train_sampler(self, dataset: Any = None) -> RepeatSampler:
        dataset = self.train_dataset if dataset is None else dataset
        args = self.args
        return RepeatSampler(dataset, mini_repeat_count=args.num_generations,
                             batch_size=args.generation_batch_size // args.num_generations,
                             repeat_count=args.num_iterations * args.steps_per_generation,
                             shuffle=args.shuffle_dataset, seed=args.seed)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if not isinstance(dataset, IterableDataset):
            return super().get_eval_dataloader(dataset)
        # A stream (also one first seen here, via `evaluate(eval_dataset=...)`): each process reads its own share,
        # with one worker, so that each prompt's repeats stay together (`data.checks.prepare_for_streaming`).
        if self.args.accelerator_config.dispatch_batches:
            raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                             "`accelerator_config`; set it to False, or pass a map-style eval dataset.")
        self.accelerator.dataloader_config.dispatch_batches = False
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return super().get_eval_dataloader(repeat_iterable(dataset, self._num_generations("eval"), 1, 1))
        finally:
            self.args.dataloader_num_workers = workers

    def _get_eval_sampler(self, eval_dataset: Any) -> RepeatSampler:
        G = self._num_generations("eval")
        return RepeatSampler(eval_dataset, mini_repeat_count=G, shuffle=False, seed=self.args.seed)

    def _num_generations(self, mode: str) -> int:
        return (self.args.num_generations_eval or self.args.num_generations) if mode == "eval" \
            else self.args.num_generations
