"""The run around the steps: `train` under the output_dir lock with signal handling, verified checkpoints and exact
resume (the generation buffer and its position, the adaptive entropy controller), logging, saving and the Hub."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from grpo_trainer.modeling import kernels
from grpo_trainer.reporting import hub, metrics
from grpo_trainer.runtime import checkpoints, distributed, run_lock

__all__ = ["LifecycleMixin"]

_ENTROPY_STATE = "entropy_ctrl_state.json"  # the adaptive entropy controller's state in a checkpoint (TRL's name)


class LifecycleMixin:
    """Checkpoints, resume, logging and saving. Reads `_buffer`, `_micro_step`, `_entropy`, `_signal_stop`, `_metrics`,
    `_completions`, `_completions_upload` set up by `GRPOTrainer.__init__`."""

    def _save_rng_state(self, output_dir: str) -> None:
        """RNG states, plus the generation buffer and its position: a resumed run replays the same micro-steps.
        Part of the checkpoint folder, so covered by its manifest (`runtime.checkpoints`)."""
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
            # Large float32 CPU linears through oneDNN where it beats the BLAS (`modeling.kernels`); engines that
            # shard or hook the weights (DeepSpeed, FSDP) keep their own.
            plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
            with self._signal_stop.handling(save_last_step), \
                    kernels.fast_linears(*(self.model, self.ref_model) if plain else ()):
                output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self._completions_upload is not None:  # the last log steps' files, without waiting for the next tick
            self._completions_upload.push_now()
        return output

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
