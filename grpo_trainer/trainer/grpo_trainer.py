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

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
from accelerate.utils import gather, gather_object, set_seed
from torch import Tensor, nn
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl.models.utils import prepare_deepspeed, prepare_fsdp

from grpo_trainer import rollout
from grpo_trainer.algorithms import linear, losses, masks, surrogates
from grpo_trainer.algorithms.advantage import MULTI_OBJECTIVE_AGGREGATIONS, Advantage, get_advantage_estimator
from grpo_trainer.algorithms.engine_correction import CROSS_PROCESS
from grpo_trainer.algorithms.entropy import EntropyControl, window_stats
from grpo_trainer.algorithms.logprobs import LogProbs, completion_logprobs
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config.checks import advisories, check_config
from grpo_trainer.data.checks import (
    check_dataset,
    check_enough_prompts,
    eval_datasets,
    is_conversational,
    prepare_for_streaming,
)
from grpo_trainer.data.images import attach_images, row_images, strip_images
from grpo_trainer.data.sampler import RepeatSampler, repeat_iterable
from grpo_trainer.reporting import completions_hub, hub, metrics
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.reward_logs import RewardLogs
from grpo_trainer.rewards import scoring as rewards
from grpo_trainer.rewards.checks import as_processing_classes, check_reward_setup
from grpo_trainer.rollout import capture, multimodal, multiturn, replay
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import eos_token_ids, make_generation_config
from grpo_trainer.runtime import checkpoints, compat, distributed, interrupts, models, run_lock
from grpo_trainer.trainer.engine import apply_engine_correction
from grpo_trainer.trainer.round import Round

__all__ = ["GRPOTrainer"]

logger = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-4  # TRL's: keeps a group whose rewards barely differ from being amplified 1e8-fold
_ENTROPY_PAD = -1e9  # pads entropies (always >= 0) to a common length for the cross-process gather
_ENTROPY_STATE = "entropy_ctrl_state.json"  # the adaptive entropy controller's state in a checkpoint (TRL's name)


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


class GRPOTrainer(Trainer):
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
        compat.leave_accumulation_to_trainer(self.accelerator)  # transformers < 5.6 gave Accelerate the steps too
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

    @property
    def _tokenizer(self) -> Any:
        """The text tokenizer: the processing class, or a processor's tokenizer (TRL's attribute name)."""
        return multimodal.text_tokenizer(self.processing_class)

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

    # ------------------------------------------------------------------------------------ rollout + scoring

    def _prepare_inputs(self, generation_batch: list[dict]) -> Round:
        """Generate once per round; serve the round's micro-batches on the following micro-steps."""
        if not self.model.training:
            return self._micro_batch(self._generate_and_score(generation_batch, "eval"), "eval")
        args = self.args
        if self._micro_step % (args.steps_per_generation * args.num_iterations) == 0 or self._buffer is None:
            with self._signal_stop.between_steps():  # a stuck rollout or reward can still be checkpointed
                round_ = self._generate_and_score(generation_batch, "train")
            self._buffer = [self._micro_batch(part, "train") for part in round_.split(args.steps_per_generation)]
        iteration, index = divmod(self._micro_step % (args.steps_per_generation * args.num_iterations),
                                  args.steps_per_generation)
        inputs = self._buffer[index]
        if iteration == args.num_iterations - 1:  # its last loss: replay tensors go with it, not with the buffer
            self._buffer[index] = inputs.without_replay()
        self._micro_step += 1
        return inputs

    def _generate_and_score(self, batch: list[dict], mode: str) -> Round:
        args, device = self.args, self.accelerator.device
        if self._multi_turn is None:
            prompts = [row["prompt"] for row in batch]
            images = row_images(batch)  # [B] lists of images, or None for a text-only round
            if images is not None:
                prompts = attach_images(prompts, images)  # rewards and the log see them as TRL passes them
            prompt_batch = tokenize_prompts(self.processing_class, prompts, args.max_prompt_length,
                                            args.chat_template_kwargs, args.pad_to_multiple_of).to(device)
            out = self._rollout(prompt_batch, mode)
            completions, episode_columns = self._completion_texts(out, prompts), {}
            prompt_images = prompt_batch.images
        else:
            prompts, out, completions, episode_columns = self._episode(batch, mode)
            images = prompt_images = None  # multi-turn rounds are text-only (`rollout.prompts` rejects images)
        columns = {k: [row[k] for row in batch] for k in batch[0] if k not in ("prompt", "completion",
                                                                            "completion_ids")}
        columns.update(episode_columns)
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(out.completion_ids, out.completion_mask)]
        local_rewards = rewards.score_completions(self.reward_funcs, self.reward_names, prompts, completions,
                                                  completion_ids, columns, args.reward_error_policy,
                                                  args.reward_timeout, trainer_state=self.state,
                                                  log_extra=self._reward_logs.log_extra,
                                                  log_metric=self._reward_logs.log_metric).to(device)  # [B, F]
        unrewarded = torch.isnan(local_rewards).all(dim=1).nonzero()  # rows no reward function scored
        if len(unrewarded):
            row = int(unrewarded[0])
            sample = {**{k: v[row] for k, v in columns.items()}, "prompt": prompts[row], "completion": completions[row]}
            logger.warning(f"All reward functions returned None for the following kwargs:\n{sample}\nSuch completions "
                           "get advantage 0; make sure at least one reward function returns a valid reward.")
        all_rewards = gather(local_rewards)  # [B_global, F]: a group may span processes
        G = self._num_generations(mode)
        weights = self.reward_weights
        aggregate = MULTI_OBJECTIVE_AGGREGATIONS[args.multi_objective_aggregation]
        all_advantages = aggregate(self.advantage_fn, all_rewards.cpu(), G, args.scale_rewards, weights,
                                   ADVANTAGE_EPS)  # [B_global]
        start = self.accelerator.process_index * len(prompts)
        advantages = all_advantages[start:start + len(prompts)].to(device)  # [B]
        loss_mask = out.completion_mask * (~out.is_truncated).unsqueeze(1) \
            if args.mask_truncated_completions else out.completion_mask  # [B, T]; tool tokens: `env_mask`
        self._record_rollout_metrics(mode, out, all_rewards, weights, G)
        extra = self._reward_logs.gather_columns(len(prompts), gather_object) if args.log_completions else {}
        self._reward_logs.columns.clear()
        if args.log_completions and mode == "train":
            logged_images = gather_object(images) if images is not None and args.log_multimodal else None
            self._completions.add(gather_object([strip_images(p) for p in prompts]), gather_object(completions),
                                  all_rewards.cpu(), all_advantages, extra, images=logged_images)
        round_ = Round(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                       completion_mask=loss_mask.int(), env_mask=out.env_mask, advantages=advantages,
                       window_tokens=self._window_tokens(loss_mask if out.env_mask is None
                                                         else loss_mask * out.env_mask, mode),
                       sampling_logps=out.sampling_logps, sampling_entropy=out.sampling_entropy,
                       sampling_probs=out.sampling_probs, layer_outputs=out.layer_outputs,
                       images=prompt_images, engine_logps=out.engine_logps,
                       pad_to_multiple_of=args.pad_to_multiple_of).padded(self._tokenizer.pad_token_id)
        return self._correct_for_engine(round_, mode)

    def _correct_for_engine(self, round_: Round, mode: str) -> Round:
        """TRL's vLLM importance-sampling correction (`trainer.engine`): the trainer's log-probs of the round at
        the sampling weights against the engine's; records the `sampling/*` metrics."""
        if round_.engine_logps is None or not self.args.vllm_importance_sampling_correction:
            return round_
        with torch.no_grad():
            old = self._no_grad_logps(self.model, round_.trimmed())
        old = nn.functional.pad(old, (0, round_.completion_ids.shape[1] - old.shape[1]))
        round_, values = apply_engine_correction(round_, old, self.args, self._on_policy(mode))
        for key, value in values.items():
            self._metrics[mode][key].append(CROSS_PROCESS[key](gather(value.reshape(1).float())))
        return round_

    def _on_policy(self, mode: str) -> bool:
        """Whether every micro-step of a round runs before the next optimizer step (the sampling weights)."""
        args = self.args
        return mode != "train" or args.gradient_accumulation_steps % (
            args.steps_per_generation * args.num_iterations) == 0

    def _rollout(self, prompts: rollout.PromptBatch, mode: str, max_new_tokens: int | None = None,
                 continuation: bool = False) -> rollout.Rollout:
        """Completions for `prompts` from the rollout backend. A multi-turn `continuation` (a turn after tool
        results, `max_new_tokens` long) keeps only tokens (`capture`, decision 4)."""
        plan = capture.KEEP_NOTHING if continuation else capture.plan(
            training=mode == "train", on_policy=self._on_policy(mode),
            plain_single_process=self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled
            and not self.is_fsdp_enabled, checkpointing=compat.checkpointing_is_on(models.causal_lm(self.model)))
        max_new_tokens = max_new_tokens or self.args.max_completion_length
        backend = rollout.serving(self.rollout_backend, prompts)
        if backend.capabilities.own_weights:  # an engine: new weights in, nothing gathered to generate
            backend.sync_weights(self.accelerator.unwrap_model(self.model), self.state.global_step)
            config = make_generation_config(self.args, models.causal_lm(self.model).generation_config,
                                            self._tokenizer, max_new_tokens)
            out = backend.generate(self.model, prompts, config, plan)
            return capture.drop_unusable(out, config, self.args.temperature)
        with distributed.unwrapped_for_generation(self.model_wrapped, self.accelerator,
                                                  self.args.ds3_gather_for_generation) as model:
            config = make_generation_config(self.args, model.generation_config, self._tokenizer, max_new_tokens,
                                            suppress_tokens=self._suppressed(model))
            with torch.no_grad():
                out = backend.generate(model, prompts, config, plan)
        return capture.drop_unusable(out, config, self.args.temperature)

    def _episode(self, batch: list[dict], mode: str) -> tuple[list, rollout.Rollout, list, dict[str, list]]:
        """A multi-turn round (`rollout.multiturn`): the prompts as the model saw them, the rollout, the completions
        as chat messages, and the extra reward-function keyword arguments."""
        device = self.accelerator.device

        def generate(prompts: rollout.PromptBatch, max_new_tokens: int | None, continuation: bool) -> rollout.Rollout:
            return self._rollout(prompts.to(device), mode, max_new_tokens, continuation)

        episode = self._multi_turn.run(batch, generate, self._generate if self.rollout_func else None, device)
        self.environments = self._multi_turn.last_environments
        if episode.tool_counts is not None:
            counts = torch.tensor([episode.tool_counts.calls, episode.tool_counts.failures, len(batch)], device=device)
            for key, value in metrics.tool_metrics(*gather(counts[None]).sum(0)).items():
                self._metrics[mode][key].append(value)
        return episode.prompts, episode.rollout, episode.completions, episode.reward_kwargs

    def _generate(self, prompts: list) -> multiturn.RolloutFuncOutput:
        """The user's `rollout_func(prompts, trainer)` on this process's prompts, its output checked (TRL's name
        for this seam)."""
        return multiturn.call_rollout_func(self.rollout_func, prompts, self)

    def _suppressed(self, model: nn.Module) -> list[int] | None:
        """Tokens sampling must never produce: a vision-language model's image placeholders (TRL's rule)."""
        return multimodal.image_token_ids(model) if multimodal.is_processor(self.processing_class) else None

    def _completion_texts(self, out: rollout.Rollout, prompts: list) -> list:
        texts = self._tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        if is_conversational(prompts[0]):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def _micro_batch(self, part: Round, mode: str) -> Round:
        """`part` trimmed once, with the old log-probs (only when the round outlives an optimizer step) and the
        reference log-probs (only when beta != 0) that its loss needs."""
        part = part.trimmed()
        old = ref = None
        with torch.no_grad():
            if not self._on_policy(mode):
                # The sampler's log-probs are the old policy's; after an optimizer step they are no stand-ins for
                # the current ones, and replaying the rollout would be wrong.
                old = part.old_logps if part.old_logps is not None else part.sampling_logps
                old = old if old is not None else self._no_grad_logps(self.model, part)
                part = dataclasses.replace(part, sampling_logps=None, sampling_entropy=None, sampling_probs=None,
                                           layer_outputs=None)
            if self.args.beta != 0.0:
                if self.ref_model is not None:
                    ref = self._no_grad_logps(self.ref_model, part)
                else:
                    with models.reference_context(self.model):
                        ref = self._no_grad_logps(self.model, part)
        return dataclasses.replace(part, old_logps=old, ref_logps=ref)

    def _no_grad_logps(self, model: nn.Module, part: Round) -> Tensor:
        """Log-probs `[B, T]` of a (trimmed) round, `per_device_train_batch_size` rows per forward."""
        size, width = self.args.per_device_train_batch_size, part.completion_ids.shape[1]
        pieces = [self._logps(model, part.select(slice(i, i + size)).trimmed()).logps
                  for i in range(0, part.rows, size)]
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1])) for p in pieces])

    def _window_tokens(self, loss_mask: Tensor, mode: str) -> Tensor:
        """The `dapo` normaliser: active tokens per process per gradient-accumulation window."""
        args = self.args
        if mode == "eval":  # evaluation: each batch on its own
            return loss_mask.sum().float()
        global_tokens = gather(loss_mask.sum().reshape(1).float()).sum()
        return global_tokens / self.accelerator.num_processes * args.gradient_accumulation_steps \
            / args.steps_per_generation

    # ---------------------------------------------------------------------------------------------- loss

    def _logps(self, model: nn.Module, inputs: Round, with_entropy: bool = False, policy: bool = False) -> LogProbs:
        """Log-probs and entropies `[B, T]` of a trimmed micro-batch. `policy`: the model is the policy that sampled
        this round, on-policy, so the rollout's values stand in for the forward's (and its layer outputs, if kept,
        are replayed); the policy's forward also returns the MoE router's auxiliary loss when it is enabled."""
        input_ids = torch.cat([inputs.prompt_ids, inputs.completion_ids], dim=1)  # [B, S + T]
        attention_mask = torch.cat([inputs.prompt_mask, inputs.completion_mask], dim=1)
        width = inputs.completion_ids.shape[1]
        with_aux_loss = policy and self.aux_loss_enabled
        images = multimodal.forward_inputs(model, inputs.images, width)  # None for text prompts
        if self.is_fsdp_enabled and distributed.is_fsdp_module(model):
            return distributed.fsdp_completion_logprobs(model, input_ids, attention_mask, width, self.args.temperature,
                                                        self.args.logprob_chunk_size, with_entropy, with_aux_loss,
                                                        model_inputs=images)
        known = (inputs.sampling_logps, inputs.sampling_entropy, inputs.sampling_probs) if policy else (None,) * 3
        replayed = contextlib.nullcontext()
        if policy and inputs.layer_outputs is not None and model.training:
            replayed = replay.replayed_layers(models.causal_lm(model).get_decoder().layers, inputs.layer_outputs)
        with replayed:
            return completion_logprobs(model, input_ids, attention_mask, width, self.args.temperature,
                                       self.args.logprob_chunk_size, with_entropy, *known,
                                       with_aux_loss=with_aux_loss, model_inputs=images)

    def compute_loss(self, model: nn.Module, inputs: Round, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Tensor:
        args = self.args
        mode = "train" if model.training else "eval"
        logps, entropy, measured, aux_loss = self._policy_logps(model, inputs, mode)  # [B, T] each; [] or None
        mask = inputs.loss_mask
        entropy_mask = None
        if args.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy.detach(), mask, 1.0 - args.top_entropy_quantile)
        bonus = self._entropy.enabled
        norm = losses.LossNorm(args.gradient_accumulation_steps if mode == "train" else 1,
                               inputs.window_tokens, args.max_completion_length)
        out = losses.policy_loss(logps, inputs.advantages, mask, norm, loss_type=args.loss_type,
                                 old_logps=inputs.old_logps, ref_logps=inputs.ref_logps, beta=args.beta,
                                 kl_bias_correction=args.use_bias_correction_kl, params=self._surrogate_params,
                                 importance_sampling_level=args.importance_sampling_level,
                                 off_policy_threshold=args.off_policy_mask_threshold,
                                 sampling_logps=inputs.engine_logps if inputs.engine_logps is not None
                                 else inputs.sampling_logps, entropy_mask=entropy_mask,
                                 entropy=entropy if bonus else None,
                                 entropy_coef=self._entropy.applied() if bonus else None,
                                 engine_ratio=inputs.engine_ratio)
        window = self._metrics[mode]
        for key, value in out.metrics.items():
            window[key].append(value)
        for key, values in out.per_sequence.items():  # extremes over every process's completions
            window[key].append(losses.SEQUENCE_METRICS[key][1](gather(values)))
        window["entropy"].append((entropy.detach() * measured).sum() / measured.sum().clamp(min=1))
        if bonus and mode == "train":
            self._control_entropy(entropy, mask if entropy_mask is None else mask * entropy_mask)
        loss = out.loss
        if aux_loss is not None:  # TRL: scaled for gradient accumulation like the policy loss (auto-scaling is off)
            loss = loss + self.router_aux_loss_coef * aux_loss / norm.accumulation_steps
            window["aux_loss"].append(aux_loss.detach())
        return (loss, None) if return_outputs else loss

    def _control_entropy(self, entropy: Tensor, mask: Tensor) -> None:
        """Adaptive entropy control: add this micro-batch's entropy to the window's; at the optimizer step, update
        the coefficient from the window's token-weighted entropy over every process. Logs `entropy_coef` once per
        optimizer step, as TRL."""
        if self._entropy.adaptive:
            stats = window_stats(entropy, mask)  # [2]
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window, reduction="sum")
                self._entropy.update((totals[0] / totals[1].clamp(min=1.0)).item())
                self._entropy_window = None
        if self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self._entropy.coef)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute; adaptive control changes it each step)."""
        return self._entropy.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self._entropy.coef = value

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """TRL's method: True for the completion tokens `[B, T]` whose entropy is at least the `threshold` quantile
        of the completion-token entropies of every process (`masks.high_entropy_mask`)."""
        local = entropies[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=_ENTROPY_PAD)
        gathered = self.accelerator.gather(padded)
        return masks.high_entropy_mask(entropies, mask, gathered[gathered != _ENTROPY_PAD], threshold)

    @staticmethod
    def get_off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor,
                            mask: Tensor, off_policy_threshold: float) -> Tensor:
        """TRL's static method: DeepSeek-V3.2's off-policy sequence mask `[B, 1]` (`masks.off_policy_mask`)."""
        return masks.off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                     off_policy_threshold)

    @staticmethod
    def get_gamma_weights(advantages: Tensor, log_ratio_per_token: Tensor, mask: Tensor,
                          importance_sampling_ratio: Tensor | None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                          k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
        """TRL's static method: VESPO's sequence weights phi(w) `[B, 1]` (`surrogates.gamma_weights`)."""
        return surrogates.gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos,
                                        lambda_pos, k_neg, lambda_neg)

    def _policy_logps(self, model: nn.Module, inputs: Round, mode: str
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Policy log-probs and entropies `[B, T]`, the mask of tokens whose entropy was computed, and the MoE
        router's auxiliary loss (None unless enabled). With beta == 0, no entropy mask, no entropy bonus and no
        auxiliary loss, a completion whose advantage is exactly 0 adds 0 to the loss and to its gradient whatever
        its log-probs, so only the other rows run forward and backward; skipped rows keep their place in every loss
        normaliser, with log-probs equal to the old ones (a ratio of exactly 1)."""
        args = self.args
        advantages, mask = inputs.advantages, inputs.loss_mask  # [B] or [B, T]; [B, T]
        nonzero = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(1)  # [B]
        if mode != "train" or args.beta != 0.0 or args.top_entropy_quantile < 1.0 or self._entropy.enabled \
                or self.aux_loss_enabled or bool(nonzero.all()):
            out = self._logps(model, inputs, with_entropy=True, policy=True)
            return out.logps, out.entropy, mask, out.aux_loss
        keep = nonzero.nonzero().squeeze(1)
        keep = keep if keep.numel() else keep.new_zeros(1)  # one row keeps the graph (and DDP's hooks) alive
        part = self._logps(model, inputs.select(keep).trimmed(), True, policy=True)
        part_logps, part_entropy = part.logps, part.entropy
        B, T = mask.shape
        width = part_logps.shape[1]
        logps = inputs.old_logps.clone() if inputs.old_logps is not None else part_logps.new_zeros(B, T)
        logps[keep, :width] = part_logps
        entropy = part_logps.new_zeros(B, T)
        entropy[keep, :width] = part_entropy
        measured = torch.zeros_like(mask)
        measured[keep] = mask[keep]
        return logps, entropy, measured, None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        """The Trainer's step, then a guard: a non-finite loss or gradient drops this window's gradients."""
        started = time.perf_counter()
        with compat.loss_already_scaled(self):  # transformers < 5.19 would divide it by the window again
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_step_time(time.perf_counter() - started)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = torch.isfinite(loss) and (not grads or torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()))
        if finite:
            self._nonfinite_in_a_row = 0
            return loss
        self._nonfinite_in_a_row += 1
        self._nonfinite_since_log += 1
        warnings.warn(f"non-finite loss or gradient at step {self.state.global_step}; its gradients are dropped.")
        if self._nonfinite_in_a_row > self.args.max_nonfinite_steps:
            raise RuntimeError(
                f"{self._nonfinite_in_a_row} micro-steps in a row had a non-finite loss or gradient. Check the "
                "rewards for huge values, lower learning_rate, set max_grad_norm, or use fp32 instead of fp16.")
        for p in model.parameters():
            p.grad = None  # an optimizer skips parameters without a gradient
        return loss.new_zeros(())

    # --------------------------------------------------------------------------------- checkpoints, resume

    def _save_rng_state(self, output_dir: str) -> None:
        """RNG states, plus the generation buffer and its position: a resumed run replays the same micro-steps.
        Written before `trainer_state.json`, whose presence marks a checkpoint as complete."""
        super()._save_rng_state(output_dir)
        state = {"buffer": self._buffer, "micro_step": self._micro_step}
        torch.save(state, os.path.join(output_dir, f"grpo_state_{self.accelerator.process_index}.pt"))
        if self._entropy.adaptive and self.args.should_save:  # the same on every process; TRL's file and keys
            with open(os.path.join(output_dir, _ENTROPY_STATE), "w") as f:
                json.dump(self._entropy.state_dict(), f)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = os.path.join(checkpoint or "", f"grpo_state_{self.accelerator.process_index}.pt")
        if checkpoint is not None and os.path.isfile(path):
            device = self.accelerator.device  # "cpu:0" under a multi-process CPU launch, which torch cannot map to
            state = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=False)
            self._buffer, self._micro_step = state["buffer"], state["micro_step"]
        entropy_state = os.path.join(checkpoint or "", _ENTROPY_STATE)
        if checkpoint is not None and self._entropy.adaptive and os.path.isfile(entropy_state):
            with open(entropy_state) as f:
                self._entropy.load_state_dict(json.load(f))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, written completely or not at all (`runtime.checkpoints`): a manifest last, the
        partial folder removed and a clear error if the save fails. Older checkpoints are rotated out
        (`save_total_limit`) only once the new one is complete."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            with checkpoints.save_guard(folder, self.args.should_save, self.accelerator.wait_for_everyone):
                super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save:
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def _save_last_step(self) -> None:
        """Called from the signal watchdog while the main thread is stuck in a rollout or reward function that
        began before any micro-step of the current step: the model and optimizer hold the last finished step."""
        if self.state.global_step > 0 and not checkpoints.is_saved(self.args.output_dir, self.state.global_step):
            self._save_checkpoint(self.model, trial=None)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # Private Trainer hook: it checks max_steps only after a step, so a run resumed at or past max_steps would
        # train one step more.
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Private Trainer hook: a model that saves its weights under other names (a VLM) is read back with its own
        # name mapping; every other checkpoint loads as the Trainer loads it (`checkpoints.load_renamed_weights`).
        target = model if model is not None else self.model
        if self.is_fsdp_enabled or not checkpoints.load_renamed_weights(target, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        """`Trainer.train`, holding output_dir's lock (`runtime.run_lock`). `resume_from_checkpoint=True` picks the
        newest checkpoint that verifies, a path must verify (`runtime.checkpoints`); SIGTERM or SIGINT saves a
        checkpoint and stops (`runtime.interrupts`)."""
        with run_lock.hold(self.args.output_dir, self.accelerator, self.args.ignore_output_dir_lock):
            resume_from_checkpoint = distributed.decided_by_main(
                self.accelerator, lambda: checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir))
            # A save from the watchdog thread is safe only alone: collectives would wait on the stuck processes.
            save_last_step = self._save_last_step if self.accelerator.num_processes == 1 else None
            # Large float32 CPU linears through oneDNN where it beats the BLAS (`algorithms.linear`); engines that
            # shard or hook the weights (DeepSpeed, FSDP) keep their own.
            plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
            with self._signal_stop.handling(save_last_step), \
                    linear.fast_linears(*(self.model, self.ref_model) if plain else ()):
                output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self._completions_upload is not None:  # the last log steps' files, without waiting for the next tick
            self._completions_upload.push_now()
        return output

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.mean().detach(), None, None

    # ------------------------------------------------------------------------------------------- metrics

    def _record_rollout_metrics(self, mode: str, out: rollout.Rollout, all_rewards: Tensor, weights: Tensor,
                                G: int) -> None:
        """TRL's round metrics, from the gathered round, and the round's `log_metric` values. `num_tokens` is the
        running total of prompt and completion tokens trained on (`state.num_input_tokens_seen`)."""
        window = self._metrics[mode]
        lengths = gather(out.sampled_mask.sum(1))  # [B_global]; TRL: the tokens the policy sampled, no tool's
        if mode == "train":
            self.state.num_input_tokens_seen += int(gather(out.prompt_mask.sum().reshape(1)).sum() + lengths.sum())
        window["num_tokens"] = [self.state.num_input_tokens_seen]
        round_metrics = {**metrics.completion_length_metrics(lengths, gather(out.is_truncated.int())),
                         **metrics.reward_metrics(all_rewards, weights, self.reward_names, G, self.args.scale_rewards,
                                                  with_pass_at_k=mode == "eval"),
                         **self._reward_logs.gather_metrics(gather_object)}
        for key, value in round_metrics.items():
            window[key].append(value)

    def _record_step_time(self, seconds: float) -> None:
        """TRL's `step_time`: seconds spent in `training_step` over the micro-steps of one optimizer step."""
        self._step_time += seconds
        self._micro_steps_timed += 1
        if self._micro_steps_timed >= self.current_gradient_accumulation_steps:
            self._metrics["train"]["step_time"].append(self._step_time)
            self._step_time, self._micro_steps_timed = 0.0, 0

    @property
    def _logs(self) -> dict[str, Any]:
        """The completions table's rows in the layout of `trl.GRPOTrainer._logs` (prompt, completion, rewards,
        advantages, extra)."""
        return self._completions.columns()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        if mode == "train":  # skipped micro-steps since the last log, summed over processes below
            self._metrics[mode]["nonfinite_steps"] = [self._nonfinite_since_log * self.accelerator.num_processes]
            self._nonfinite_since_log = 0
        keys, local = metrics.window_totals(self._metrics[mode])  # the same keys on every process
        device = self.accelerator.device
        local = local.to(device, torch.float32 if device.type == "mps" else torch.float64)  # MPS has no float64
        reduced = self.accelerator.reduce(local, "sum").cpu() if keys else local
        logs.update({prefix + k: v for k, v in metrics.window_means(keys, reduced).items()})
        # `logs` is updated in place: `evaluate()` returns this same dict, so it carries our metrics too
        super().log(logs, start_time)
        self._metrics[mode].clear()
        if mode == "train" and self.args.log_completions and self.accelerator.is_main_process:
            self._completions.flush(self.state.global_step)

    # -------------------------------------------------------------------------------------- saving + Hub

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (only the adapter and tokenizer for a PeftModel), then the run's model card: every
        `save_model` and every checkpoint folder gets a README.md."""
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            hub.write_model_card(self, output_dir or self.args.output_dir)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs: Any) -> None:
        """Write `output_dir/README.md` (`push_to_hub` calls this before uploading `output_dir`)."""
        if self.is_world_process_zero():
            hub.write_model_card(self, self.args.output_dir, model_name=model_name, dataset_name=dataset_name,
                                 tags=tags)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The Trainer copies a checkpoint's weights into output_dir and uploads output_dir; the card goes with them.
        if self.is_world_process_zero():
            self.create_model_card()
        super()._push_from_checkpoint(checkpoint_folder)

    def save_merged_model(self, output_dir: str) -> str:
        """Save the policy with its adapter merged in, as a full model (+ tokenizer and card) loadable without
        peft. The trained adapter model itself is left as it is (the merge happens on a copy)."""
        return hub.save_merged_model(self, output_dir)
