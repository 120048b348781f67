"""Build one generation round: prompts -> rollout -> rewards -> advantages -> `Round`.

Decisions:

1. The builder owns what a round needs and nothing of the trainer: the rollout backend, the multi-turn set-up, the
   reward sources and the advantage estimator, the completion and reward logs, and typed settings. The weights it
   samples with come in per call (`PolicyView`), with the trainer's `TrainerState` (its optimizer step and token
   count, which reward functions may read as `trainer_state`).
2. Rewards are gathered across processes before advantages are computed (a group may span processes); each
   process keeps its own rows. Every collective runs on the calling thread.
3. The builder stops at advantages: old log-probs, importance weights and the mismatch report are
   `trainer.off_policy`'s, which runs between `finish` and `log` (the completions table takes the report's columns).
4. A round is built in two halves: `sample` (prompts, rollout, this process's rewards: no collective, so it may run
   on a producer thread, `trainer.producer`) and `finish` (gathers, advantages, metrics, the completions table,
   the `Round`: on the main thread). `build` is one after the other.
5. With dynamic sampling (`zero_variance_groups='resample'`, `trainer.resample`), `finish` assembles the round from
   several generation rounds: its zero-variance groups are replaced by informative groups of extra prompts, each
   sampled (`sample`) and gathered there. The round's metrics cover every completion generated for it; its
   advantages, normaliser and completions table cover the kept round only.
6. Every rollout's sampler record is stamped with the optimizer step of the weights that sampled it
   (`SamplerRecord.version`); a partial round's (`rollout.partial`) with the oldest of its tokens' own stamps.
7. With partial rollouts (`partial_rollouts`), a training round's rollout is `rollout.partial`'s: the parked groups
   and the round's prompts decoded until enough groups are complete; the round's rows are then the trained groups'
   (dataset rows included), which its rewards, advantages and completions table cover.

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward sources.
"""

from __future__ import annotations

import dataclasses
import logging
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
from grpo_trainer.algorithms.advantage import as_reward_vector
from grpo_trainer.data.checks import is_conversational
from grpo_trainer.data.images import row_images, row_prompts, strip_images
from grpo_trainer.diagnosis.signals import round_signals
from grpo_trainer.modeling.logprobs import LogProbs
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.reporting import metrics
from grpo_trainer.reporting.completions import CompletionLog
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.reporting.reward_logs import RewardLogs
from grpo_trainer.rewards.sources import RewardSources
from grpo_trainer.rollout import capture, multimodal, multiturn
from grpo_trainer.rollout.multiturn.loop import ToolCounts
from grpo_trainer.rollout.partial.parking import PartialRollouts
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import PromptSettings, SamplingSettings, make_generation_config
from grpo_trainer.rollout.types import ImageInputs, special_tokens
from grpo_trainer.runtime import compat
from grpo_trainer.trainer.resample import Resampler, Selection
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.schedule import Schedule, window_tokens

__all__ = ["PolicyView", "RoundBuilder", "RoundLog", "RoundSettings", "Sampled"]

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
    keep_sampling_mask: bool = True  # the loss scores over the sampler's kept supports (`rollout.capture`, 5)
    routing_replay: bool = False  # record a Mixture-of-Experts rollout's routing for replay (`rollout.capture`, 6)


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
    # The trainer's log-probs at the sampling weights, where the round was sampled ahead in-process and the mismatch
    # report wants them (`trainer.producer`, `trainer.off_policy` decision 3); None otherwise.
    trainer_scores: LogProbs | None = None


@dataclass
class CompletionRows:
    """Every process's rows of one generation round for the completions table, in global row order."""

    prompts: list
    completions: list
    extra: dict[str, list]  # the `log_extra` columns
    images: list | None


@dataclass
class RoundLog:
    """A training round's rows for the completions table (`RoundBuilder.log`), over every process."""

    rows: CompletionRows
    rewards: Tensor  # [B_global, F]
    advantages: Tensor  # [B_global]


@dataclass
class Generated:
    """One generation round after its collective half's gathers: its `Round` (no advantages yet) and what the
    round's metrics and log need, over every process."""

    round: Round
    rewards: Tensor  # [B_global, F]
    lengths: Tensor  # [B_global] tokens the policy sampled per completion
    truncated: Tensor  # [B_global] int
    prompt_tokens: Tensor  # [] prompt tokens over every process
    reward_logs: RewardLogs  # what its reward functions logged (metrics; the columns are in `log`)
    log: CompletionRows | None  # with `log_completions`


class RoundBuilder:
    """Decision 1."""

    def __init__(self, *, settings: RoundSettings, schedule: Schedule, processing_class: Any,
                 backend: rollout.RolloutBackend, rewards: RewardSources, estimator: Callable,
                 accelerator: Accelerator, metrics_window: MetricsWindow, completions: CompletionLog,
                 multi_turn: multiturn.MultiTurn | None = None,
                 first_turn: Callable[[list], multiturn.RolloutFuncOutput] | None = None,
                 resampler: Resampler | None = None, partial: PartialRollouts | None = None) -> None:
        self.settings, self.schedule = settings, schedule
        self.processing_class, self.tokenizer = processing_class, multimodal.text_tokenizer(processing_class)
        self.backend, self.rewards, self.estimator = backend, rewards, estimator
        self.accelerator, self.metrics, self.completions = accelerator, metrics_window, completions
        self.multi_turn, self.first_turn = multi_turn, first_turn
        self.resampler = resampler  # decision 5
        self.partial = partial  # decision 7

    def num_generations(self, mode: str) -> int:
        return self.settings.num_generations_eval if mode == "eval" else self.settings.num_generations

    # ------------------------------------------------------------------------------------------------ the round

    def build(self, batch: list[dict], mode: str, policy: PolicyView, state: TrainerState
              ) -> tuple[Round, RoundLog | None]:
        """This process's share of one round from its dataset rows `batch` (each prompt G times in a row), with its
        completions-table rows (`finish`)."""
        return self.finish(self.sample(batch, mode, policy, state), mode, policy, state)

    def sample(self, batch: list[dict], mode: str, policy: PolicyView, state: TrainerState) -> Sampled:
        """The round's local half (decision 4): rollout and this process's rewards, no collective."""
        device = self.accelerator.device
        if self.multi_turn is None and self.partial is not None and mode == "train":  # decision 7
            batch, out = self._partial_rollout(batch, policy)
            prompts, images, prompt_images = row_prompts(batch), None, None  # text prompts only (checked)
            completions, episode_columns, tool_counts = self._completion_texts(out, prompts), {}, None
        elif self.multi_turn is None:
            prompts = row_prompts(batch)  # with their images: rewards and the log see them as TRL passes them
            images = row_images(batch)  # [B] the rows' images for the completions table, or None for text only
            prompt_settings = self.settings.prompts
            prompt_batch = tokenize_prompts(self.processing_class, prompts, prompt_settings.max_prompt_length,
                                            prompt_settings.chat_template_kwargs,
                                            prompt_settings.pad_to_multiple_of).to(device)
            out = self.rollout(prompt_batch, mode, policy, routes=self.settings.routing_replay)
            completions, episode_columns, tool_counts = self._completion_texts(out, prompts), {}, None
            prompt_images = prompt_batch.images
        else:
            episode = self.multi_turn.run(batch, self._turns(mode, policy), self.first_turn, device)
            prompts, out, completions = episode.prompts, episode.rollout, episode.completions
            episode_columns, tool_counts = episode.reward_kwargs, episode.tool_counts
            images = prompt_images = None  # multi-turn rounds are text-only (`rollout.prompts` rejects images)
        if out.sampler.versions is None:  # decision 6
            out = dataclasses.replace(out, sampler=dataclasses.replace(out.sampler, version=policy.version))
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

    def finish(self, sampled: Sampled, mode: str, policy: PolicyView, state: TrainerState
               ) -> tuple[Round, RoundLog | None]:
        """The round's collective half (decision 4): every process's rewards, the advantages, the round's metrics,
        and the `Round`; with dynamic sampling, after its zero-variance groups were replaced (decision 5). `policy`:
        the weights extra prompts are sampled with. Also a training round's completions-table rows (`log` adds
        them; None when not logged)."""
        generated = [self._gathered(sampled, mode)]
        if self.resampler is None or mode != "train":
            round_, rewards, log = generated[0].round, generated[0].rewards, generated[0].log
        else:
            def more(rows: list[dict]) -> Tensor:
                generated.append(self._gathered(self.sample(rows, mode, policy, state), mode))
                return generated[-1].rewards

            selection = self.resampler.fill(generated[0].rewards, sampled.rows, more)
            round_, rewards, log = self._kept(generated, selection)
            for key, value in metrics.resample_metrics(selection.extra_rounds, selection.prompts_generated,
                                                       selection.zero_variance_fraction,
                                                       selection.kept_zero_variance).items():
                self.metrics.add(mode, key, value)
        all_advantages = self.rewards.advantages(self.estimator, rewards.cpu(), self.num_generations(mode))
        start = self.accelerator.process_index * round_.rows
        advantages = all_advantages[start:start + round_.rows].to(self.accelerator.device)  # [B]
        self._record_round_metrics(mode, generated, state)
        round_ = dataclasses.replace(round_, advantages=advantages,
                                     window_tokens=self._window_tokens(round_.loss_mask, mode))
        return round_, RoundLog(log, rewards.cpu(), all_advantages) if log is not None and mode == "train" else None

    def log(self, entry: RoundLog | None, columns: dict[str, list]) -> None:
        """A training round's rows in the completions table, with this process's per-row `columns` (the mismatch
        report's) gathered over every process."""
        if entry is None:
            return
        rows = entry.rows
        extra = {**rows.extra, **{name: gather_object(values) for name, values in columns.items()}}
        self.completions.add(rows.prompts, rows.completions, entry.rewards, entry.advantages, extra, images=rows.images)

    def _gathered(self, sampled: Sampled, mode: str) -> Generated:
        """One generation round's gathers (rewards, lengths, the completions table's rows) and its `Round` without
        advantages."""
        out = sampled.rollout
        if sampled.tool_counts is not None:
            counts = torch.tensor([sampled.tool_counts.calls, sampled.tool_counts.failures, sampled.rows],
                                  device=self.accelerator.device)
            for key, value in metrics.tool_metrics(*gather(counts[None]).sum(0)).items():
                self.metrics.add(mode, key, value)
        rewards = gather(sampled.local_rewards)  # [B_global, F]
        loss_mask = out.completion_mask * (~out.is_truncated).unsqueeze(1) \
            if self.settings.mask_truncated_completions else out.completion_mask  # [B, T]; tool tokens: `env_mask`
        round_ = Round.from_rollout(out, sampled.prompt_images, None, loss_mask, None,
                                    self.settings.prompts.pad_to_multiple_of, self.tokenizer.pad_token_id)
        lengths = gather(out.sampled_mask.sum(1))  # [B_global]; TRL: the tokens the policy sampled, no tool's
        prompt_tokens = gather(out.prompt_mask.sum().reshape(1)).sum()
        return Generated(round_, rewards, lengths, gather(out.is_truncated.int()), prompt_tokens, sampled.reward_logs,
                         self._completion_rows(sampled))

    def _completion_rows(self, sampled: Sampled) -> CompletionRows | None:
        """Every process's rows of one generation round for the completions table (`log_completions` only)."""
        if not self.settings.log_completions:
            return None
        extra = sampled.reward_logs.gather_columns(len(sampled.prompts), gather_object)
        images = sampled.images
        logged_images = gather_object(images) if images is not None and self.settings.log_multimodal else None
        return CompletionRows(gather_object([strip_images(p) for p in sampled.prompts]),
                              gather_object(sampled.completions), extra, logged_images)

    def _kept(self, generated: list[Generated], selection: Selection) -> tuple[Round, Tensor, CompletionRows | None]:
        """The kept round on this process, its rewards over every process `[B_global, F]` and its logged rows, from
        the generation rounds `generated` (`resample.Selection`)."""
        pieces = [generated[chunk].round.select(slice(first, first + rows)) for chunk, first, rows in selection.blocks]
        round_ = Round.concat(pieces, self.tokenizer.pad_token_id)
        rewards = torch.stack([generated[chunk].rewards[row] for chunk, row in selection.global_rows])
        if generated[0].log is None:
            return round_, rewards, None
        logs = [generated[chunk].log for chunk, _ in selection.global_rows]
        rows = [row for _, row in selection.global_rows]
        names = sorted({name for entry in logs for name in entry.extra})
        log = CompletionRows([entry.prompts[r] for entry, r in zip(logs, rows)],
                             [entry.completions[r] for entry, r in zip(logs, rows)],
                             {name: [entry.extra[name][r] if name in entry.extra else None
                                     for entry, r in zip(logs, rows)] for name in names},
                             None if any(entry.images is None for entry in logs)
                             else [entry.images[r] for entry, r in zip(logs, rows)])
        return round_, rewards, log

    # ------------------------------------------------------------------------------------------------ the rollout

    def rollout(self, prompts: rollout.PromptBatch, mode: str, policy: PolicyView, max_new_tokens: int | None = None,
                continuation: bool = False, routes: bool = False) -> rollout.Rollout:
        """Completions for `prompts` from the rollout backend. A multi-turn `continuation` (a turn after tool
        results, `max_new_tokens` long) keeps only tokens (`capture`, decision 4). `routes`: with the experts a
        Mixture-of-Experts model routed every token to (`capture`, decision 6; in-process backends only)."""
        lm = causal_lm(policy.model)
        plan = capture.KEEP_NOTHING if continuation else capture.plan(
            training=mode == "train", on_policy=self.schedule.on_policy(mode),
            plain_single_process=policy.plain_single_process, checkpointing=compat.checkpointing_is_on(lm),
            kept_support=self.settings.keep_sampling_mask)
        sampling = self.settings.sampling
        backend = rollout.serving(self.backend, prompts)
        if backend.capabilities.own_weights:  # an engine: new weights in, nothing gathered to generate
            backend.sync_weights(self.accelerator.unwrap_model(policy.model), policy.version)
            config = make_generation_config(sampling, lm.generation_config, self.tokenizer, max_new_tokens,
                                            suppress_tokens=self._suppressed(lm))
            out = backend.generate(policy.model, prompts, config, plan)
        else:
            with policy.for_generation() as model:
                config = make_generation_config(sampling, model.generation_config, self.tokenizer, max_new_tokens,
                                                suppress_tokens=self._suppressed(model))
                with torch.no_grad():
                    if routes:
                        out = capture.routed(causal_lm(model), prompts,
                                             lambda: backend.generate(model, prompts, config, plan))
                    else:
                        out = backend.generate(model, prompts, config, plan)
        if out.decode is not None:  # speculative rollouts: what the round's decoding cost (rollout.speculative)
            for key, value in out.decode.metrics().items():
                self.metrics.add(mode, key, value)
        return capture.drop_unusable(out, config, sampling.temperature, plan)

    def _partial_rollout(self, batch: list[dict], policy: PolicyView) -> tuple[list[dict], rollout.Rollout]:
        """Decision 7: the trained rows of a partial training round and their rollout (on this process's device)."""
        device, prompt_settings = self.accelerator.device, self.settings.prompts

        def tokenize(rows: list[dict]) -> list[list[int]]:
            encoded = tokenize_prompts(self.processing_class, row_prompts(rows), prompt_settings.max_prompt_length,
                                       prompt_settings.chat_template_kwargs)
            return [ids[mask.bool()].tolist() for ids, mask in zip(encoded.ids, encoded.mask)]

        def generate(prompts: rollout.PromptBatch) -> rollout.Rollout:  # the cache as wide as the longest budget
            return self.rollout(prompts.to(device), "train", policy, int(prompts.end.budgets.max()),
                                continuation=True)

        config = make_generation_config(self.settings.sampling, causal_lm(policy.model).generation_config,
                                        self.tokenizer)
        eos, pad = special_tokens(config)
        part = self.partial.round(batch, policy.version, tokenize, generate, pad, eos)
        for key, value in part.metrics.items():
            self.metrics.add("train", key, value)
        out = part.rollout
        moved = {f.name: getattr(out, f.name).to(device) for f in dataclasses.fields(out)
                 if isinstance(getattr(out, f.name), Tensor)}
        sampler = out.sampler
        sampler = dataclasses.replace(sampler, logps=sampler.logps.to(device), versions=sampler.versions.to(device))
        return part.rows, dataclasses.replace(out, **moved, sampler=sampler)

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
        return window_tokens(loss_mask, mode, self.schedule, self.accelerator)

    def _record_round_metrics(self, mode: str, generated: list[Generated], state: TrainerState) -> None:
        """TRL's round metrics over every completion generated for the round (with dynamic sampling, the extra
        rounds' too: the policy's own reward and lengths, not those of the groups kept), and the round's
        `log_metric` values. `num_tokens` is the running total of prompt and completion tokens generated
        (`state.num_input_tokens_seen`)."""
        lengths = torch.cat([g.lengths for g in generated])  # [B_generated]
        truncated = torch.cat([g.truncated for g in generated])
        rewards = torch.cat([g.rewards for g in generated])  # [B_generated, F]
        if mode == "train":
            state.num_input_tokens_seen += int(sum(g.prompt_tokens for g in generated) + lengths.sum())
        self.metrics.set(mode, "num_tokens", state.num_input_tokens_seen)
        reward_logs = generated[0].reward_logs
        for g in generated[1:]:  # every value logged for the round, whichever generation round logged it
            for name, values in g.reward_logs.metrics.items():
                reward_logs.metrics[name].extend(values)
        scale = self.rewards.settings.scale_rewards
        round_metrics = {**metrics.completion_length_metrics(lengths, truncated),
                         **metrics.reward_metrics(rewards, self.rewards.weights, self.rewards.names,
                                                  self.num_generations(mode), scale, with_pass_at_k=mode == "eval"),
                         **reward_logs.gather_metrics(gather_object),
                         # the health checks' (docs/HEALTH.md): missing rewards, the reward cut completions lose
                         **round_signals(rewards, as_reward_vector(rewards, self.rewards.weights), truncated,
                                         self.rewards.names)}
        for key, value in round_metrics.items():
            self.metrics.add(mode, key, value)
