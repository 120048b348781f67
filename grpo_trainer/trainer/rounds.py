"""The generation round of `GRPOTrainer`: sample, score, compute advantages, and serve the round's micro-batches.

One round serves `steps_per_generation x num_iterations` micro-steps (the trainer's decision 1). A micro-batch is
trimmed once and carries the old and reference log-probs its loss needs (decisions 4-6 of `trainer.grpo_trainer`).

Shapes: `B` completions (local), `S` prompt tokens, `T` completion tokens, `F` reward functions.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from accelerate.utils import gather, gather_object
from torch import Tensor, nn

from grpo_trainer import rollout
from grpo_trainer.algorithms.advantage import MULTI_OBJECTIVE_AGGREGATIONS
from grpo_trainer.algorithms.engine_correction import CROSS_PROCESS
from grpo_trainer.data.checks import is_conversational
from grpo_trainer.data.images import attach_images, row_images, strip_images
from grpo_trainer.modeling import unwrap
from grpo_trainer.reporting import metrics
from grpo_trainer.rewards import scoring as rewards
from grpo_trainer.rollout import capture, multimodal, multiturn
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import make_generation_config
from grpo_trainer.runtime import compat, distributed, models
from grpo_trainer.trainer.engine import apply_engine_correction
from grpo_trainer.trainer.round import Round

__all__ = ["RoundsMixin"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")  # the trainer's one logger (as TRL's is)

ADVANTAGE_EPS = 1e-4  # TRL's: keeps a group whose rewards barely differ from being amplified 1e8-fold


class RoundsMixin:
    """Rollout and scoring. Reads what `GRPOTrainer.__init__` sets up: `rollout_backend`, `reward_funcs`,
    `reward_names`, `reward_weights`, `advantage_fn`, `_multi_turn`, `_metrics`, `_completions`, `_reward_logs`,
    `_buffer`, `_micro_step`."""

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
            and not self.is_fsdp_enabled, checkpointing=compat.checkpointing_is_on(unwrap.causal_lm(self.model)))
        max_new_tokens = max_new_tokens or self.args.max_completion_length
        backend = rollout.serving(self.rollout_backend, prompts)
        if backend.capabilities.own_weights:  # an engine: new weights in, nothing gathered to generate
            backend.sync_weights(self.accelerator.unwrap_model(self.model), self.state.global_step)
            lm = unwrap.causal_lm(self.model)
            config = make_generation_config(self.args, lm.generation_config, self._tokenizer, max_new_tokens,
                                            suppress_tokens=self._suppressed(lm))
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
