"""`grpo-train plan`: the run's memory plan, itemised, and whether it fits, without loading a weight.

    grpo-train plan --config run.yaml                                  # the same flags and YAML as training
    grpo-train plan --model_name_or_path Qwen/Qwen2.5-7B --per_device_train_batch_size 8 --use_peft \\
        --device cuda --device_memory 80GiB                             # plan for a GPU from any machine
    grpo-train plan --config run.yaml --processes 8 --zero_stage 3      # one process of an 8-GPU ZeRO-3 launch

It reads the model's config (a local directory or a Hub id; `builtin:tiny` for the demo's), builds the model on
the meta device, tokenises the first prompts of the dataset when one is given (else `max_prompt_length`), and prints
the table of `planning.report.format_plan`, the verdict against the device, and, when it does not fit, the settings
that do; then the longest `max_completion_length` that fits the device with these settings and the settings that
reach longer (`planning.longest`; `planning.report.format_longest`). Exit status 0 when the plan fits, 1 when it does
not, 2 for bad input.

The plan's own flags: `--device cpu|cuda` (default: this machine's), `--device_memory SIZE` (the memory per
process; default what the device has free, as `GRPO_TRAINER_DEVICE_MEMORY`), `--processes N`, `--zero_stage
0-3`, `--fsdp` (a multi-process launch planned from one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from grpo_trainer.cli import command, recipe

__all__ = ["main"]


def _plan_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--device_memory")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--zero_stage", type=int, choices=(0, 1, 2, 3))
    parser.add_argument("--fsdp", action="store_true")
    return parser.parse_known_args(argv)


def _tokenizer_and_model(script_args: command.ScriptArguments, config) -> tuple:
    """(model id or config-only model, tokenizer or None): no weights are read."""
    name = script_args.model_name_or_path
    if name == f"{command.BUILTIN}tiny":
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        tokenizer = make_tokenizer()
        return make_tiny_model(tokenizer), tokenizer
    command._check_exists(name, "model")
    try:
        from grpo_trainer.runtime import models

        kwargs = models.init_kwargs(config.model_init_kwargs, config.trust_remote_code)
        tokenizer = models.load_processing_class(name, kwargs["trust_remote_code"], kwargs.get("revision"),
                                                 padding_side="left")
    except (OSError, ValueError):  # offline without the tokenizer: max_prompt_length stands in
        tokenizer = None
    if tokenizer is not None and script_args.chat_template is not None:
        tokenizer.chat_template = script_args.chat_template
    return name, tokenizer


def _dataset(script_args: command.ScriptArguments):
    if script_args.dataset_name is None:
        return None
    try:
        return command.load_train_dataset(script_args)
    except command.UsageError as exc:
        print(f"grpo-train plan: {exc}; planning with max_prompt_length instead.", file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    """Print the plan; the exit status says whether it fits. `--device_memory` is the planner's device budget
    (`GRPO_TRAINER_DEVICE_MEMORY`) for this call only: a caller in the same process keeps its own."""
    options, rest = _plan_options(argv)
    if not options.device_memory:
        return _main(options, rest)
    previous = os.environ.get("GRPO_TRAINER_DEVICE_MEMORY")
    os.environ["GRPO_TRAINER_DEVICE_MEMORY"] = options.device_memory
    try:
        return _main(options, rest)
    finally:
        if previous is None:
            del os.environ["GRPO_TRAINER_DEVICE_MEMORY"]
        else:
            os.environ["GRPO_TRAINER_DEVICE_MEMORY"] = previous


def _main(options: argparse.Namespace, rest: list[str]) -> int:
    cpu_only = options.device == "cuda" and not _cuda_available()
    try:
        # bf16=True fails TrainingArguments' check on a machine without a GPU unless use_cpu is set
        script_args, config = command.parse_args((["--use_cpu", "True"] if cpu_only else []) + rest,
                                                 require_data=False)
        config.model_init_kwargs = recipe.model_init_kwargs(script_args, config)
        model, tokenizer = _tokenizer_and_model(script_args, config)
        dataset = _dataset(script_args)
        overrides = {k: v for k, v in (("processes", options.processes), ("zero_stage", options.zero_stage))
                     if v is not None}
        if options.fsdp:
            overrides["fsdp"] = True
        if options.processes:
            overrides["processes_per_node"] = 1 if options.device == "cuda" else options.processes
        if options.device == "cuda" and options.device_memory:
            from grpo_trainer.planning import parse_size

            overrides["device_total_bytes"] = parse_size(options.device_memory)
        run = _plan(model, config, dataset, tokenizer, script_args, options.device, overrides)
    except (command.UsageError, ValueError, OSError) as exc:
        print(f"grpo-train plan: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from grpo_trainer import planning

    print(planning.format_plan(run.plan, run.device, title=f"Memory plan for {script_args.model_name_or_path}"))
    exact = planning.split_is_exact(config.loss_type, config.top_entropy_quantile)
    fits_now = run.plan.device_bytes <= run.device.total_bytes
    if not fits_now:
        fits = planning.fitting(run.settings, run.shape, run.device, exact)
        global_batch = run.settings.micro_batch * run.settings.accumulation_steps * run.settings.processes
        print("\n" + planning.fit_advice(run.plan, run.device, fits, global_batch))
    print("\n" + _longest(model, config, script_args, run, exact))
    return 0 if fits_now else 1


def _longest(model, config, script_args, run, exact: bool) -> str:
    """How long a completion fits these settings and the device, and what reaches longer."""
    from grpo_trainer import planning
    from grpo_trainer.trainer import memory

    lora = None
    if command.peft_config(script_args) is None and not run.shape.adapter_parameters:
        lora = memory.default_lora_shape(model, config)
    longest = planning.longest_completion(run.settings, run.shape, run.device)
    longer = planning.longer_settings(run.settings, run.shape, run.device, exact, lora)
    context = memory.context_length(model, config)
    return planning.format_longest(longest, longer, run.device, run.settings.completion_length,
                                   run.settings.prompt_length, context)


def _plan(model, config, dataset, tokenizer, script_args, device, overrides):
    from grpo_trainer import planning
    from grpo_trainer.trainer import memory

    run = memory.plan_run(model, config, dataset, tokenizer, command.peft_config(script_args),
                          recipe.quantization_config(script_args), device=device)
    if not overrides:
        return run
    settings = dataclasses.replace(run.settings, **overrides)
    budget = planning.device_memory(settings.device, settings.processes_per_node)
    return dataclasses.replace(run, settings=settings, plan=planning.plan_memory(settings, run.shape), device=budget)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
