"""Build one generation round: prompts -> rollout -> rewards -> advantages -> `Round`.

Decisions:

1. The builder owns what a round needs and nothing of the trainer: the rollout backend, the multi-turn set-up, the
   reward sources and the advantage estimator, the completion and reward logs, and typed settings. The weights it
   samples with come in per call (`PolicyView`), with the trainer's `TrainerState` (its optimizer step and token
   count, which reward functions may read as `trainer_state`).
2. Rewards are gathered across processes before advantages are computed (a group may span processes); each
   process keeps its own rows. Every collective runs on the calling thread.
3. A round sampled by an inference engine with the importance-sampling correction on gets the trainer's log-probs
   at the sampling weights in one no-grad forward (`trainer.engine`).
4. A round is built in two halves: `sample` (prompts, rollout, this process's rewards: no collective, so it may run
   on a producer thread, `trainer.producer`) and `finish` (gathers, advantages, metrics, the completions table,
   the `Round`: on the main thread). `build` is one after the other.

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward sources.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather, gather_object
from torch import Tensor, nn
from transformers import TrainerState

from grpo_trainer import rollout
from grpo_trainer.algorithms.engine_correction import CROSS_PROCESS, EngineCorrection
from grpo_trainer.data.checks import is_conversational
from grpo_trainer.data.images import attach_images, row_images, strip_images
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.reporting import metrics
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.reporting.reward_logs import RewardLogs
from grpo_trainer.rewards.sources import RewardSources
from grpo_trainer.rollout import capture, multimodal, multiturn
from grpo_trainer.rollout.multiturn.loop import ToolCounts
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import PromptSettings, SamplingSettings, make_generation_config
from grpo_trainer.rollout.types import ImageInputs
from grpo_trainer.runtime import compat
from grpo_trainer.trainer.engine import apply_engine_correction
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.schedule import Schedule

__all__ = ["PolicyView", "RoundBuilder", "RoundSettings", "Sampled"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")  # the trainer's one logger (as TRL's is)


@dataclass(frozen=True)
class RoundSettings:
    sampling: SamplingSettings
    prompts: PromptSettings
    num_generations: int
    num_generations_eval: int
    mask_truncated_completions: bool = False
    log_completions: bool = False
    log_multimodal: bool = True


@dataclass(frozen=True)
class PolicyView:
    """The weights a round is sampled with (decision 1)."""

    model: nn.Module  # the model as the trainer trains it (DDP / DeepSpeed wrapped or not)
    for_generation: Callable[[], AbstractContextManager[nn.Module]]  # the bare model, ready to sample in place
    version: int  # optimizer steps taken: an engine's weights are pushed when it changed
    plain_single_process: bool  # one process, no engine hooking the forward (replay's condition)


@dataclass
class Sampled:
    """A round's local half (`RoundBuilder.sample`): what the collective half needs."""

    prompts: list  # [B] as the model saw them (images attached, a tool round's resets appended)
    completions: list  # [B] texts, or chat messages
    rollout: rollout.Rollout
    prompt_images: ImageInputs | None  # the processor's image inputs of the prompts
    images: list | None  # [B] the rows' images, for the completions table
    local_rewards: Tensor  # [B, F] this process's rewards, NaN where a source returned None
    reward_logs: RewardLogs  # what the round's reward functions logged
    tool_counts: ToolCounts | None
    rows: int  # dataset rows of the round on this process
    version: int  # the optimizer step of the weights that sampled it


class RoundBuilder:
    """Decision 1. `score(model, round_)` gives a round's log-probs `[B, T]` (the engine correction's forward)."""

    def __init__(self, *, settings: RoundSettings, schedule: Schedule, processing_class: Any,
                 backend: rollout.RolloutBackend, rewards: RewardSources, estimator: Callable,
                 accelerator: Accelerator, metrics_window: MetricsWindow, completions: CompletionLog,
                 score: Callable[[nn.Module, Round], Tensor],
                 engine_correction: EngineCorrection | None = None,
                 multi_turn: multiturn.MultiTurn | None = None,
                 first_turn: Callable[[list], multiturn.RolloutFuncOutput] | None = None) -> None:
        self.settings, self.schedule = settings, schedule
        self.processing_class, self.tokenizer = processing_class, multimodal.text_tokenizer(processing_class)
        self.backend, self.rewards, self.estimator = backend, rewards, estimator
        self.accelerator, self.metrics, self.completions = accelerator, metrics_window, completions
        self.score, self.engine_correction = score, engine_correction
        self.multi_turn, self.first_turn = multi_turn, first_turn

    def num_generations(self, mode: str) -> int:
        return self.settings.num_generations_eval if mode == "eval" else self.settings.num_generations

    # ------------------------------------------------------------------------------------------------ the round

    def build(self, batch: list[dict], mode: str, policy: PolicyView, state: TrainerState) -> Round:
        """This process's share of one round from its dataset rows `batch` (each prompt G times in a row)."""
        return self.finish(self.sample(batch, mode, policy, state), mode, policy, state)

    def sample(self, batch: list[dict], mode: str, policy: PolicyView, state: TrainerState) -> Sampled:
        """The round's local half (decision 4): rollout and this process's rewards, no collective."""
        device = self.accelerator.device
        if self.multi_turn is None:
            prompts = [row["prompt"] for row in batch]
            images = row_images(batch)  # [B] lists of images, or None for a text-only round
            if images is not None:
                prompts = attach_images(prompts, images)  # rewards and the log see them as TRL passes them
            prompt_settings = self.settings.prompts
            prompt_batch = tokenize_prompts(self.processing_class, prompts, prompt_settings.max_prompt_length,
                                            prompt_settings.chat_template_kwargs,
                                            prompt_settings.pad_to_multiple_of).to(device)
            out = self.rollout(prompt_batch, mode, policy)
            completions, episode_columns, tool_counts = self._completion_texts(out, prompts), {}, None
            prompt_images = prompt_batch.images
        else:
            episode = self.multi_turn.run(batch, self._turns(mode, policy), self.first_turn, device)
            prompts, out, completions = episode.prompts, episode.rollout, episode.completions
            episode_columns, tool_counts = episode.reward_kwargs, episode.tool_counts
            images = prompt_images = None  # multi-turn rounds are text-only (`rollout.prompts` rejects images)
        columns = {k: [row[k] for row in batch] for k in batch[0] if k not in ("prompt", "completion",
                                                                            "completion_ids")}
        columns.update(episode_columns)
        reward_logs = RewardLogs()  # what this round's reward functions pass to log_extra / log_metric
        completion_ids = [ids[m.bool()].tolist() for ids, m in zip(out.completion_ids, out.completion_mask)]
        local_rewards = self.rewards.score(prompts, completions, completion_ids, columns, trainer_state=state,
                                           log_extra=reward_logs.log_extra,
                                           log_metric=reward_logs.log_metric).to(device)  # [B, F]
        unrewarded = torch.isnan(local_rewards).all(dim=1).nonzero()  # rows no reward function scored
        if len(unrewarded):
            row = int(unrewarded[0])
            sample = {**{k: v[row] for k, v in columns.items()}, "prompt": prompts[row], "completion": completions[row]}
            logger.warning(f"All reward functions returned None for the following kwargs:\n{sample}\nSuch completions "
                           "get advantage 0; make sure at least one reward function returns a valid reward.")
        return Sampled(prompts, completions, out, prompt_images, images, local_rewards, reward_logs, tool_counts,
                       len(batch), policy.version)

    def finish(self, sampled: Sampled, mode: str, policy: PolicyView, state: TrainerState) -> Round:
        """The round's collective half (decision 4): every process's rewards, the advantages, the round's metrics
        and log, and the `Round`. `policy`: the weights the loss starts from (the engine correction's forward)."""
        out = sampled.rollout
        if sampled.tool_counts is not None:
            counts = torch.tensor([sampled.tool_counts.calls, sampled.tool_counts.failures, sampled.rows],
                                  device=self.accelerator.device)
            for key, value in metrics.tool_metrics(*gather(counts[None]).sum(0)).items():
                self.metrics.add(mode, key, value)
        all_rewards = gather(sampled.local_rewards)  # [B_global, F]
        all_advantages = self.rewards.advantages(self.estimator, all_rewards.cpu(), self.num_generations(mode))
        start = self.accelerator.process_index * len(sampled.prompts)
        advantages = all_advantages[start:start + len(sampled.prompts)].to(self.accelerator.device)  # [B]
        loss_mask = out.completion_mask * (~out.is_truncated).unsqueeze(1) \
            if self.settings.mask_truncated_completions else out.completion_mask  # [B, T]; tool tokens: `env_mask`
        self._record_rollout_metrics(mode, out, all_rewards, sampled.reward_logs, state)
        self._log_completions(mode, sampled, all_rewards, all_advantages)
        round_ = Round.from_rollout(out, sampled.prompt_images, advantages, loss_mask, self._window_tokens(
            loss_mask if out.env_mask is None else loss_mask * out.env_mask, mode),
            self.settings.prompts.pad_to_multiple_of, self.tokenizer.pad_token_id)
        asynchronous = mode == "train" and self.schedule.rounds_ahead > 0  # sampled ahead (`trainer.producer`)
        return self.correct_off_policy(round_, mode, policy, asynchronous)

    def _log_completions(self, mode: str, sampled: Sampled, all_rewards: Tensor, all_advantages: Tensor) -> None:
        log = self.settings.log_completions
        extra = sampled.reward_logs.gather_columns(len(sampled.prompts), gather_object) if log else {}
        if log and mode == "train":
            images = sampled.images
            logged_images = gather_object(images) if images is not None and self.settings.log_multimodal else None
            self.completions.add(gather_object([strip_images(p) for p in sampled.prompts]),
                                 gather_object(sampled.completions), all_rewards.cpu(), all_advantages, extra,
                                 images=logged_images)

    def correct_off_policy(self, round_: Round, mode: str, policy: PolicyView, asynchronous: bool = False) -> Round:
        """Decision 3, for a round whose `engine_logps` are the sampler's (an engine's; or, `asynchronous`, the
        producer's behaviour policy, `trainer.producer`): the trainer's log-probs under `policy`'s weights become the
        old ones, weighed against the sampler's by `engine_correction` (when set); records the `sampling/*` metrics
        and, `asynchronous`, the raw importance ratio before truncation."""
        if round_.engine_logps is None or (self.engine_correction is None and not asynchronous):
            return round_
        with torch.no_grad():
            old = self.score(policy.model, round_.trimmed())
        old = nn.functional.pad(old, (0, round_.completion_ids.shape[1] - old.shape[1]))  # [B, T]
        if asynchronous:
            mask = round_.loss_mask.bool()
            raw = torch.exp(old - round_.engine_logps.nan_to_num())[mask]  # pi_old / pi_behaviour per token
            empty = raw.numel() == 0  # every process records every key (they are reduced together)
            self.metrics.add(mode, "async/importance_ratio_raw_mean", math.nan if empty else raw.mean())
            self.metrics.add_min(mode, "async/importance_ratio_raw_min", math.inf if empty else float(raw.min()))
            self.metrics.add_max(mode, "async/importance_ratio_raw_max", -math.inf if empty else float(raw.max()))
        if self.engine_correction is None:
            return dataclasses.replace(round_, old_logps=old, engine_logps=None)
        round_, values = apply_engine_correction(round_, old, self.engine_correction,
                                                 self.schedule.on_policy(mode) and not asynchronous)
        for key, value in values.items():
            self.metrics.add(mode, key, CROSS_PROCESS[key](gather(value.reshape(1).float())))
        return round_

    # ------------------------------------------------------------------------------------------------ the rollout

    def rollout(self, prompts: rollout.PromptBatch, mode: str, policy: PolicyView, max_new_tokens: int | None = None,
                continuation: bool = False) -> rollout.Rollout:
        """Completions for `prompts` from the rollout backend. A multi-turn `continuation` (a turn after tool
        results, `max_new_tokens` long) keeps only tokens (`capture`, decision 4)."""
        lm = causal_lm(policy.model)
        plan = capture.KEEP_NOTHING if continuation else capture.plan(
            training=mode == "train", on_policy=self.schedule.on_policy(mode),
            plain_single_process=policy.plain_single_process, checkpointing=compat.checkpointing_is_on(lm))
        sampling = self.settings.sampling
        backend = rollout.serving(self.backend, prompts)
        if backend.capabilities.own_weights:  # an engine: new weights in, nothing gathered to generate
            backend.sync_weights(self.accelerator.unwrap_model(policy.model), policy.version)
            config = make_generation_config(sampling, lm.generation_config, self.tokenizer, max_new_tokens,
                                            suppress_tokens=self._suppressed(lm))
            out = backend.generate(policy.model, prompts, config, plan)
            return capture.drop_unusable(out, config, sampling.temperature)
        with policy.for_generation() as model:
            config = make_generation_config(sampling, model.generation_config, self.tokenizer, max_new_tokens,
                                            suppress_tokens=self._suppressed(model))
            with torch.no_grad():
                out = backend.generate(model, prompts, config, plan)
        return capture.drop_unusable(out, config, sampling.temperature)

    def _turns(self, mode: str, policy: PolicyView) -> Callable:
        """A multi-turn round's turn on the rollout backend (`rollout.multiturn`'s `generate`)."""
        device = self.accelerator.device

        def generate(prompts: rollout.PromptBatch, max_new_tokens: int | None, continuation: bool) -> rollout.Rollout:
            return self.rollout(prompts.to(device), mode, policy, max_new_tokens, continuation)

        return generate

    def _suppressed(self, model: nn.Module) -> list[int] | None:
        """Tokens sampling must never produce: a vision-language model's image placeholders (TRL's rule)."""
        return multimodal.image_token_ids(model) if multimodal.is_processor(self.processing_class) else None

    def _completion_texts(self, out: rollout.Rollout, prompts: list) -> list:
        texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        if is_conversational(prompts[0]):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    # ------------------------------------------------------------------------------------------------ metrics

    def _window_tokens(self, loss_mask: Tensor, mode: str) -> Tensor:
        """The `dapo` normaliser: active tokens per process per gradient-accumulation window."""
        if mode == "eval":  # evaluation: each batch on its own
            return loss_mask.sum().float()
        global_tokens = gather(loss_mask.sum().reshape(1).float()).sum()
        return global_tokens / self.accelerator.num_processes * self.schedule.gradient_accumulation_steps \
            / self.schedule.steps_per_generation

    def _record_rollout_metrics(self, mode: str, out: rollout.Rollout, all_rewards: Tensor, reward_logs: RewardLogs,
                                state: TrainerState) -> None:
        """TRL's round metrics, from the gathered round, and the round's `log_metric` values. `num_tokens` is the
        running total of prompt and completion tokens trained on (`state.num_input_tokens_seen`)."""
        lengths = gather(out.sampled_mask.sum(1))  # [B_global]; TRL: the tokens the policy sampled, no tool's
        if mode == "train":
            state.num_input_tokens_seen += int(gather(out.prompt_mask.sum().reshape(1)).sum() + lengths.sum())
        self.metrics.set(mode, "num_tokens", state.num_input_tokens_seen)
        scale = self.rewards.settings.scale_rewards
        round_metrics = {**metrics.completion_length_metrics(lengths, gather(out.is_truncated.int())),
                         **metrics.reward_metrics(all_rewards, self.rewards.weights, self.rewards.names,
                                                  self.num_generations(mode), scale, with_pass_at_k=mode == "eval"),
                         **reward_logs.gather_metrics(gather_object)}
        for key, value in round_metrics.items():
            self.metrics.add(mode, key, value)

