"""Training on supplied completions: the parts shared by the benchmarks that feed both trainers identical completions
through `rollout_func` (no generation), so that only the training step differs (`first_step.py`,
`long_completions.py`)."""

from __future__ import annotations

import time


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MiB."""
    return _status_mb("VmHWM")


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    return _status_mb("VmRSS")


def random_completions(tokenizer, vocab: int, T: int):
    """A `rollout_func` whose completions are exactly T random tokens, the same for a given number of prompts in
    either trainer, with a uniform sampler's log-probs, -ln(151936) = -11.93 (TRL 1.16 requires the key)."""
    import torch

    def rollout_func(prompts, trainer):
        generator = torch.Generator().manual_seed(len(prompts))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        completion_ids = torch.randint(1000, vocab - 1000, (len(prompts), T), generator=generator).tolist()
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[-11.93] * T] * len(prompts)}

    return rollout_func


def training_args(config_class, output: str, T: int, steps: int, device: str = "cpu", **options):
    """The same run settings in either trainer's config class: 2 rows (one prompt, G = 2), completions of T tokens,
    float32 on CPU or bfloat16 mixed precision on a GPU (`device` "cuda"), each trainer's defaults otherwise
    (`options`: settings of one trainer's own, given by name)."""
    return config_class(output_dir=output, per_device_train_batch_size=2, num_generations=2, max_completion_length=T,
                        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
                        use_cpu=device == "cpu", bf16=device == "cuda", learning_rate=1e-6, seed=0, **options)


def prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"copy {i:03d}:" for i in range(16)]})


def distinct_rewards(completions, **kwargs) -> list[float]:
    return [float(i) for i in range(len(completions))]  # rewards differ within the group: a real backward


def step_timer(times: list[dict]):
    """A TrainerCallback appending each optimizer step's CPU seconds (`time.process_time`, the steadier number on a
    shared machine) and wall seconds to `times`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            times.append({"cpu_s": time.process_time() - self.start[0],
                          "wall_s": time.perf_counter() - self.start[1]})

    return StepTimer()
