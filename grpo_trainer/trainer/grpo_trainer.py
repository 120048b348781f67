"""`GRPOTrainer`: a `transformers.Trainer` that trains a causal LM with GRPO, RLOO or any advantage estimator.

What this trainer does, and how it differs from the papers and from TRL:

1. One generation round serves `steps_per_generation x num_iterations` micro-steps (`schedule`). The sampler repeats
   each prompt G times inside one round, in the same order on every process; rewards are gathered across processes
   before advantages are computed, so a group may span processes, and each process keeps its slice.
2. Advantages come from a pluggable estimator (`advantage_estimator`: a registry name, an `Advantage`, or any
   callable with its signature). RLOO is `advantage_estimator="rloo"`, not a second trainer. Missing rewards
   (None) are left out of the baselines.
3. Loss = surrogate then aggregation (+ beta * k3 KL), chosen by `loss_type` (see `algorithms.losses`). The loss
   already includes gradient-accumulation scaling (`loss_is_scaled_for_ga = True`).
4. Old log-probs are needed only when a rollout is used after an optimizer step; otherwise the ratio is
   exp(logp - logp.detach()). A rollout backend with the `sampling_logps` capability returns each token's log-prob
   and entropy under the sampling weights: they are the old log-probs, and on-policy the current values too, so the
   loss forward skips the LM-head projection (`trainer.scoring`). An inference engine's log-probs (vLLM) never
   stand in for the trainer's: they enter through the importance-sampling correction, the off-policy mask and the
   mismatch report, and are the old log-probs only of rounds sampled ahead with `async_correction='behaviour'`
   (`trainer.off_policy`).
5. No reference model when `beta == 0`; under PEFT the reference is the policy with its adapter disabled.
6. A round travels as one typed `Round`; each micro-batch is trimmed to its own longest prompt and completion once,
   and log-probs never materialise float32 `[B, T, V]` logits (`modeling.logprobs`).

The trainer wires owned parts and keeps `Trainer`'s hooks thin (ARCHITECTURE.md): the round source (`source`:
where rounds come from, synchronous or asynchronous), `RoundBuilder` (prompts -> rollout -> rewards -> advantages ->
`Round`), `OffPolicy` (`corrections`: importance weights and the old log-probs they need), `RoundBuffer` (which
micro-batch each micro-step trains on), `PolicyScorer` (log-prob forwards), the sequence-parallel layout
(`sequence`), `GRPOLoss` (`objective`), `NonFiniteGuard`, `TrainingHealth` (`health`: the health checks on the logged
metrics, docs/HEALTH.md), and the run's checkpoint state (`lifecycle`), metrics window and model card.

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward functions.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import Tensor, nn
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import SyncRefModelCallback

from grpo_trainer import rollout
from grpo_trainer.algorithms import masks, surrogates
from grpo_trainer.algorithms.advantage import Advantage, get_advantage_estimator
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config import settings as typed
from grpo_trainer.config.checks import advisories, check_config
from grpo_trainer.data.sampler import RepeatSampler, repeat_iterable, streaming_eval
from grpo_trainer.reporting import completions_hub, hub
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.metrics import MetricsWindow, StepTime
from grpo_trainer.rewards import scoring as rewards
from grpo_trainer.rewards.checks import check_reward_setup
from grpo_trainer.rewards.sources import ADVANTAGE_EPS
from grpo_trainer.rollout import multimodal, multiturn
from grpo_trainer.rollout.backend import chosen
from grpo_trainer.rollout.settings import eos_token_ids
from grpo_trainer.runtime import checkpoints, compat, distributed, interrupts, run_lock
from grpo_trainer.trainer import health, lifecycle, memory, parts, setup
from grpo_trainer.trainer.loss import NonFiniteGuard, pooled_high_entropy_mask
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.round_builder import PolicyView
from grpo_trainer.trainer.schedule import RoundBuffer
from grpo_trainer.trainer.sequence_group import SequenceGroup, Unsharded, sequence_group

__all__ = ["GRPOTrainer"]

logger = logging.getLogger(__name__)


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
    sequence: SequenceGroup = Unsharded()  # a trainer built with `object.__new__` (TRL's white-box tests) too

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
        setup.check_device(args)
        self.launch = launch = typed.launch(args)  # read once: the planner, round source and sequence group take it
        setup.note_held_back(args)
        for message in advisories(args):
            logger.warning(message)
        reward_funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        environments = multiturn.Environments.of(environment_factory, tools)  # `setup`, decision 2
        owned_rewards = environments.reward_funcs if environments else []
        check_reward_setup(reward_funcs, args.reward_weights, reward_processing_classes,
                           environment_rewards=len(owned_rewards))
        processing_class = setup.load_processing_class(model, processing_class, args)
        # the text tokenizer (a processor's own) under TRL's attribute name, which TRL users' code reads and assigns
        self._tokenizer = multimodal.text_tokenizer(processing_class)
        self.sequence = sequence_group(launch.sequence_parallel)  # the one choice of the layout
        self.sequence.check(parts.sharding_settings(args, launch, processing_class,
                                                    multi_turn=bool(tools or environments is not None or rollout_func)))
        choice = typed.backend_choice(args)
        source_type = parts.source_type(args)  # its refusals before the backend contacts a server or starts
        source_type.check(parts.source_settings(args, launch), chosen(choice), train_dataset, rollout_func)
        backend = rollout.select(choice)
        setup.check_processor_setup(args, processing_class)
        backend.check_model(model, args.trust_remote_code)
        self._multi_turn = setup.multi_turn_of(processing_class, args, tools, environments, rollout_func,
                                               backend.capabilities.multi_turn)
        # TRL's attributes: every tool, the rollout_func, each environment's tools and pool
        self.tools = self._multi_turn.tools if self._multi_turn is not None else []
        self.rollout_func = rollout_func
        if environments is not None:
            self._env_tools, self._environment_pool = environments.tools, environments.pools
        train_dataset = setup.training_prompts(train_dataset, environments, self._multi_turn, args)
        setup.check_inputs(args, model, train_dataset, eval_dataset, processing_class, peft_config,
                           prompt_optional=environments is not None)
        self.advantage_fn = get_advantage_estimator(advantage_estimator or args.advantage_estimator, ADVANTAGE_EPS)
        memory.prepare_host(args)
        memory.check_memory(model, args, train_dataset, processing_class, peft_config, quantization_config, launch)
        policy = setup.build_policy(model, args, peft_config, quantization_config)
        in_process = not backend.capabilities.own_weights
        source_type.check_model(policy.model, parts.source_settings(args, launch), in_process)
        for name, value in source_type.checkpointing_kwargs(in_process).items():
            compat.default_checkpointing_kwarg(args, name, value)
        self.ref_model, self.router_aux_loss_coef = policy.ref_model, policy.router_aux_loss_coef
        if self._multi_turn is not None:
            self._multi_turn.attach_model(eos_token_ids(processing_class, policy.model.generation_config),
                                          getattr(policy.model.config, "max_position_embeddings", None))
        self.reward_sources = setup.build_reward_sources(reward_funcs, reward_processing_classes, args, owned_rewards)

        super().__init__(model=policy.model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._prepare_auxiliary_models()
        self._signal_stop = interrupts.SignalStop(args.signal_grace_period)
        self.add_callback(self._signal_stop)
        self._build_parts(args, backend, processing_class)
        backend.start(self.model, processing_class)  # an inference engine (vLLM) starts here
        self._completions_upload = None
        if args.log_completions and args.log_completions_hub_repo and self.accelerator.is_main_process:
            self._completions_upload = completions_hub.start_upload(
                args.log_completions_hub_repo, self.completions.directory, args.hub_private_repo, args.hub_token,
                args.hub_model_id)
        set_seed(args.seed, device_specific=True)  # processes must sample different completions

    def _build_parts(self, args: GRPOConfig, backend: rollout.RolloutBackend, processing_class: Any) -> None:
        """The owned parts (module docstring; `trainer.parts`), once the accelerator and the prepared models exist."""
        schedule = parts.schedule(args, self.launch)
        self.metrics = MetricsWindow()
        self.completions = CompletionLog(args.output_dir, self.reward_sources.names, args.num_completions_to_print,
                                         args.generation_batch_size, args.log_unique_prompts, args.report_to)
        self.scorer = self.sequence.scorer(parts.scoring_settings(args), schedule, self.ref_model)
        self.sequence.attach(self.model)
        self.objective = parts.objective(args, self.scorer, self.router_aux_loss_coef, self.accelerator, self.metrics)
        first_turn = (lambda prompts: self._generate(prompts)) if self.rollout_func else None
        self.rounds = parts.round_builder(args, schedule, processing_class, backend, self.reward_sources,
                                          self.advantage_fn, self.accelerator, self.metrics, self.completions,
                                          self._multi_turn, first_turn, self.train_dataset, self.model)
        self.corrections = parts.corrections(args, self.launch, schedule, self.rounds, self.scorer, self.accelerator,
                                             self.metrics, self.model)
        self.buffer = RoundBuffer(schedule)
        self.source = parts.round_source(args, self.launch, self.train_dataset, self.accelerator, self.rounds,
                                         self.corrections, self.scorer, self.buffer,
                                         lambda rows, mode: self._generate_and_score(rows, mode), self.model, backend,
                                         self.metrics, lambda: self.state.global_step, self._signal_stop)
        for callback in self.source.callbacks():
            self.add_callback(callback)
        self.run_parts = lifecycle.RunParts(self.source, self.rounds.resampler, backend, self.rounds.partial)
        self.guard = NonFiniteGuard(args.max_nonfinite_steps)
        self.offloading = parts.activation_offloading(args, self.model)  # docs/MEMORY.md, "How long can I go?"
        self.step_time, self._saving_stuck = StepTime(self.metrics), False
        self.health = parts.training_health(args, self.reward_sources, self.accelerator.is_main_process)

    def create_accelerator_and_postprocess(self) -> None:
        with self.sequence.hidden_from_accelerate(self.args):  # GRPO shards sequences itself, after generation
            super().create_accelerator_and_postprocess()
        # FSDP2 on CPU; refuse a launch whose processes would not sync
        if distributed.prepare_backend(self.accelerator, getattr(self.args, "fsdp_plugin_args", None)):
            self.is_fsdp_enabled = True

    def _prepare_auxiliary_models(self) -> None:
        """Put the reference and reward models where the policy is (`parts.prepare_auxiliary`)."""
        where = (self.accelerator, self.is_deepspeed_enabled, self.is_fsdp_enabled)
        if self.ref_model is not None:
            self.ref_model = parts.prepare_auxiliary(self.ref_model, *where, shard_under_fsdp=True)
            if self.args.sync_ref_model:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        for func in self.reward_sources.funcs:
            if isinstance(func, rewards.RewardModel):
                func.model = parts.prepare_auxiliary(func.model, *where)

    # -------------------------------------------------------------------------------- TRL's attributes

    reward_funcs = property(lambda self: self.reward_sources.funcs)
    reward_names = property(lambda self: self.reward_sources.names)
    reward_func_names = reward_names  # TRL's name: each reward source's metric name
    reward_weights = property(lambda self: self.reward_sources.weights)
    reward_processing_classes = property(lambda self: self.reward_sources.processing_classes)
    # assignable, as TRL's is: the parts keep their window (a trainer made by object.__new__ gets one)
    _metrics = property(lambda self: self.metrics.windows,
                        lambda self, windows: self.__dict__.setdefault("metrics", MetricsWindow()).replace(windows))
    _logs = property(lambda self: self.completions.columns())  # TRL's completions table layout
    environments = property(lambda self: self._multi_turn.last_environments if self._multi_turn else None)
    aux_loss_enabled = property(lambda self: self.router_aux_loss_coef != 0.0)

    @property
    def rollout_backend(self) -> rollout.RolloutBackend:
        return self.rounds.backend

    @rollout_backend.setter
    def rollout_backend(self, backend: rollout.RolloutBackend) -> None:
        self.rounds.backend = backend

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute; adaptive control changes it each step)."""
        return self.objective.entropy.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.objective.entropy.coef = value

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """TRL's method (`trainer.loss.pooled_high_entropy_mask`); reads only `self.accelerator`, as TRL's tests call it
        on a stand-in trainer."""
        return pooled_high_entropy_mask(self.accelerator, entropies, mask, threshold)

    # TRL's static methods (under TRL's parameter names): DeepSeek-V3.2's off-policy sequence mask `[B, 1]`, VESPO's
    # sequence weights phi(w) `[B, 1]`
    get_off_policy_mask = staticmethod(masks.off_policy_mask)
    get_gamma_weights = staticmethod(surrogates.gamma_weights)

    def _generate(self, prompts: list) -> multiturn.RolloutFuncOutput:
        """The user's `rollout_func(prompts, trainer)` on this process's prompts, its output checked (TRL's name
        for this seam)."""
        return multiturn.call_rollout_func(self.rollout_func, prompts, self)

    # -------------------------------------------------------------------------------- data

    def get_train_dataloader(self):
        # One dataloader batch is one local generation round (steps_per_generation micro-batches).
        dataset, args = self.train_dataset, self.args
        if isinstance(dataset, IterableDataset):  # no sampler: repeat the stream the way RepeatSampler would
            dataset = repeat_iterable(dataset, args.num_generations, args.generation_batch_size // args.num_generations,
                                      args.num_iterations * args.steps_per_generation)
        return self._get_dataloader(dataset, "Training", self._train_batch_size * self.args.steps_per_generation,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_train_sampler(self, dataset: Any = None) -> RepeatSampler:
        args = self.args  # TRL's order: each prompt G times, a round's prompts num_iterations x steps times
        return RepeatSampler(self.train_dataset if dataset is None else dataset, args.num_generations,
                             args.generation_batch_size // args.num_generations,
                             args.num_iterations * args.steps_per_generation, args.shuffle_dataset, args.seed)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset
        if not isinstance(dataset, IterableDataset):
            return super().get_eval_dataloader(dataset)
        # A stream (also one first seen here, via `evaluate(eval_dataset=...)`): each process reads its own share,
        # with one worker, so that each prompt's repeats stay together (`data.checks.prepare_for_streaming`).
        args, self.args = self.args, streaming_eval(self.args)  # the Trainer builds dataloaders from `self.args`
        self.accelerator.dataloader_config.dispatch_batches = False  # each process reads its own share
        try:
            return super().get_eval_dataloader(repeat_iterable(dataset, self.rounds.num_generations("eval"), 1, 1))
        finally:
            self.args = args

    def _get_eval_sampler(self, eval_dataset: Any) -> RepeatSampler:
        return RepeatSampler(eval_dataset, mini_repeat_count=self.rounds.num_generations("eval"), shuffle=False,
                             seed=self.args.seed)

    # -------------------------------------------------------------------------------- rounds and the loss

    def _policy_view(self) -> PolicyView:
        plain = self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled and not self.is_fsdp_enabled
        return PolicyView(self.model, lambda: distributed.unwrapped_for_generation(
            self.model_wrapped, self.accelerator, self.args.ds3_gather_for_generation), self.state.global_step, plain)

    def _generate_and_score(self, batch: list[dict], mode: str) -> Round:
        """One round from this process's dataset rows, built and corrected (`RoundSource.build`)."""
        return self.source.build(batch, mode, self._policy_view(), self.state)

    def _prepare_inputs(self, generation_batch: list[dict]) -> Round:
        """Generate once per round; serve the round's micro-batches on the following micro-steps."""
        if not self.model.training:
            return self.scorer.prepare(self.source.evaluation_round(generation_batch), "eval", self.model)

        def make_round() -> list[Round]:
            with self._signal_stop.between_steps():  # a stuck rollout or reward can still be checkpointed
                return self.source.training_round(self.buffer.micro_step, generation_batch, self.model, self.state)

        return self.sequence.rows(self.buffer.next(make_round))

    def compute_loss(self, model: nn.Module, inputs: Round, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Tensor:
        if not model.training:
            loss = self.objective(model, inputs, "eval")
        else:  # a sequence-parallel group runs the backward of all but the last share itself (`SequenceGroup.loss`)
            sync = self.accelerator.sync_gradients
            loss = self.sequence.loss(lambda share, last: self.objective(model, share, "train", sync and last),
                                      inputs, model, self.accelerator.backward)
        return (loss, None) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: list[dict], num_items_in_batch: Any = None) -> Tensor:
        """The Trainer's step, then `NonFiniteGuard`: a non-finite loss or gradient drops this step's gradients.
        `inputs`: the dataloader's batch (this round's rows), which the Trainer's step turns into the micro-batch's
        `Round` through `_prepare_inputs` (TRL's seam, `test_prepare_input_called_with_correct_data`)."""
        with self.step_time.micro_step(self.current_gradient_accumulation_steps), self.offloading:
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)  # left unscaled: loss_is_scaled_for_ga
            finally:
                self.sequence.step_done()
        loss = self.sequence.logged(loss)
        return loss if self.guard.check(loss, model, self.state.global_step) else loss.new_zeros(())

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.mean().detach(), None, None

    # -------------------------------------------------------------------------------- the run, checkpoints, logs

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        """`Trainer.train`, holding output_dir's lock (`runtime.run_lock`). `resume_from_checkpoint=True` picks the
        newest checkpoint that verifies, a path must verify (`runtime.checkpoints`); SIGTERM or SIGINT saves a
        checkpoint and stops (`runtime.interrupts`)."""
        with run_lock.hold(self.args.output_dir, self.accelerator, self.args.ignore_output_dir_lock):
            resume_from_checkpoint = distributed.decided_by_main(
                self.accelerator, lambda: checkpoints.resolve_resume(resume_from_checkpoint, self.args.output_dir))
            # A save from the watchdog thread is safe only alone: collectives would wait on the stuck processes.
            save_last_step = self._save_last_step if self.accelerator.num_processes == 1 else None
            with self._signal_stop.handling(save_last_step):
                error = None
                self.health.start()
                try:
                    output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    self.source.close()  # nothing is left running (`trainer.source`)
                    stopped = health.stop_reason(self.state.global_step, self.state.max_steps, self._signal_stop.signum,
                                                 error)  # the health summary however it ends (`trainer.health`)
                    self.health.finish(stopped, self.callback_handler.callbacks, self.args, self.state, self.control)
        if self._completions_upload is not None:  # the last log steps' files, without waiting for the next tick
            self._completions_upload.push_now()
        return output

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        lifecycle.save_run_state(output_dir, self.accelerator.process_index,
                                 self.run_parts.state_dict(stuck=self._saving_stuck), self.objective.entropy,
                                 self.args.should_save)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is not None:
            state = lifecycle.load_run_state(checkpoint, self.accelerator.process_index, self.accelerator.device,
                                             self.objective.entropy)
            if state is not None:
                self.run_parts.load_state_dict(state)

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
            self._saving_stuck = True  # a producer job may be the stuck call: save the rounds it finished
            try:
                self._save_checkpoint(self.model, trial=None)
            finally:
                self._saving_stuck = False

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # Private Trainer hook: it checks max_steps only after a step (a run resumed at max_steps would train one more)
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

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Private Trainer hook: an FSDP2 optimizer without per-parameter state (SGD without momentum) cannot go
        # through torch 2.13's set_optimizer_state_dict ("Expected device to be set"): its checkpoint holds only the
        # groups' hyperparameters, restored directly (`checkpoints.load_param_groups_only`); the scheduler as the
        # Trainer loads it. Every other optimizer and layout loads as the Trainer loads it.
        if checkpoint is not None and self.is_fsdp_enabled and \
                checkpoints.load_param_groups_only(self.optimizer, checkpoint):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
            return
        super()._load_optimizer_and_scheduler(checkpoint)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        if mode == "train":  # skipped micro-steps since the last log, summed over processes below
            self.metrics.set(mode, "nonfinite_steps", self.guard.take_count() * self.accelerator.num_processes)
        reduced = self.metrics.reduced(mode, self.accelerator.reduce, self.accelerator.device)
        logs.update({prefix + k: v for k, v in reduced.items()})
        # `logs` is updated in place: `evaluate()` returns this same dict, so it carries our metrics too
        super().log(logs, start_time)
        self.metrics.clear(mode)
        if mode == "train":
            self.health.observe(self.state.global_step, logs)  # one warning per onset (docs/HEALTH.md)
        if mode == "train" and self.args.log_completions and self.accelerator.is_main_process:
            self.completions.flush(self.state.global_step)

    # -------------------------------------------------------------------------------- saving and the Hub

    def _run_card(self) -> hub.RunCard:
        args = self.args
        fields = {name: getattr(args, name) for name in hub.CARD_FIELDS}
        checks = getattr(self, "health", None)  # None on a trainer made by `object.__new__` (TRL's white-box tests)
        return hub.RunCard(args.output_dir, getattr(self, "hub_model_id", None) or args.hub_model_id,
                           hub.grpo_settings(fields, self.advantage_fn, args.advantage_estimator),
                           tuple(self.reward_names),
                           None if args.reward_weights is None else tuple(args.reward_weights),
                           health=checks.card_lines(self.state.global_step) if checks is not None else ())

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (only the adapter and tokenizer for a PeftModel), then the run's model card: every
        `save_model` and every checkpoint folder gets a README.md."""
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            hub.write_model_card(self._run_card(), output_dir or self.args.output_dir,
                                 self.accelerator.unwrap_model(self.model))

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs: Any) -> None:
        """Write `output_dir/README.md` (`push_to_hub` calls this before uploading `output_dir`)."""
        if self.is_world_process_zero():
            hub.write_model_card(self._run_card(), self.args.output_dir, self.accelerator.unwrap_model(self.model),
                                 model_name=model_name, dataset_name=dataset_name, tags=tags)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The Trainer copies a checkpoint's weights into output_dir and uploads output_dir; the card goes with them.
        if self.is_world_process_zero():
            self.create_model_card()
        super()._push_from_checkpoint(checkpoint_folder)

    def save_merged_model(self, output_dir: str) -> str:
        """Save the policy with its adapter merged in, as a full model (+ tokenizer and card) loadable without
        peft. The trained adapter model itself is left as it is (the merge happens on a copy)."""
        return hub.save_merged_model(self.accelerator.unwrap_model(self.model), self.processing_class,
                                     self._run_card(), output_dir, self.args.should_save)

