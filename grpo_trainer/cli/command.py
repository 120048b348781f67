"""`grpo-train`: a YAML file and/or flags -> dataset, reward functions, model -> `GRPOTrainer.train()`.

    grpo-train                                   # the offline demo (same as --demo)
    grpo-train --config run.yaml --learning_rate 1e-6
    accelerate launch -m grpo_trainer.cli --config run.yaml   # on CPU: ACCELERATE_USE_CPU=true
    grpo-train vllm-serve --model <model>        # the vLLM server of vllm_mode='server' (`cli.vllm_serve`)
    grpo-train plan --config run.yaml            # the run's memory plan, no weights loaded (`cli.plan`)
    grpo-train doctor outputs/demo               # a run's training-health diagnosis from its logs (`cli.doctor`)

Decisions:

1. Every option is a dataclass field: `ScriptArguments` (model, data, rewards, LoRA) and `GRPOConfig` (training),
   parsed by `HfArgumentParser`. A YAML file and the demo only change the parser's defaults, so a flag always
   wins over the file, and the file over the demo.
2. Bad input (an unknown field or reward, a missing file or column, an invalid value) is found before any model
   is loaded and reported as one line on stderr naming the thing and the choices, with exit code 2.
3. `builtin:tiny` and `builtin:copy_digits` name the offline model and toy task of `cli.toy`, so the
   demo needs no network. Any other model or dataset is a Hub id or a local path.
4. The script only wires; under `accelerate launch` each process runs it and the trainer does the rest.
5. Recipes written for `trl grpo` or open-r1 run unchanged: their keys are fields here or are translated, warned
   about or refused by name (`cli.recipe`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import HfArgumentParser

from grpo_trainer.cli import recipe
from grpo_trainer.config import GRPOConfig
from grpo_trainer.config.grpo_config import _opt
from grpo_trainer.data.checks import check_dataset
from grpo_trainer.reporting.run_log import RunLogCallback, read_metrics, reward_rise
from grpo_trainer.rewards import library as reward_library
from grpo_trainer.rewards.checks import check_reward_setup

__all__ = ["DEMO", "ScriptArguments", "UsageError", "main", "parse_args"]

BUILTIN = "builtin:"
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

# The demo: a random ~80k-parameter model learns to copy 3 digits, on CPU, in about a minute. The completion
# budget equals the answer's length, so the model learns *what* to write. lr 1e-3 suits a random model (1e-6
# suits a pretrained one; 2e-3 and up collapse early on a wrong digit); 16 samples per prompt give a usable
# signal from the first steps; a tiny beta only makes the KL to the starting model visible in the plot.
DEMO: dict[str, Any] = {
    "model_name_or_path": f"{BUILTIN}tiny", "dataset_name": f"{BUILTIN}copy_digits", "reward_funcs": ["copy_digits"],
    "output_dir": "outputs/demo", "max_steps": 600, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
    "per_device_train_batch_size": 128, "num_generations": 16, "max_completion_length": 3, "beta": 0.001,
    "logging_steps": 10, "save_steps": 300, "save_total_limit": 2, "log_completions": True,
    "num_completions_to_print": 2, "activation_checkpointing": False, "report_to": "none", "seed": 0,
}


class UsageError(ValueError):
    """Bad command-line or config input; main() prints it as one line and exits with code 2."""


@dataclass
class ScriptArguments:
    """What to train and on what; the training settings are GRPOConfig's fields."""

    model_name_or_path: str | None = _opt(None, "Policy: a Hub id, a local directory, or 'builtin:tiny'.")
    dataset_name: str | None = _opt(
        None, "A Hub dataset id, a local .json/.jsonl/.csv/.parquet file, or 'builtin:copy_digits'.")
    dataset_config: str | None = _opt(None, "Dataset configuration (subset) name, e.g. 'main' for openai/gsm8k.")
    dataset_train_split: str = _opt("train", "Split to train on.")
    dataset_test_split: str = _opt("test", "Split to evaluate on (when eval_strategy is not 'no').")
    dataset_streaming: bool = _opt(False, "Stream the dataset instead of downloading it (needs max_steps > 0).")
    prompt_column: str = _opt("prompt", "Column holding the prompts (renamed to 'prompt').")
    system_prompt: str | None = _opt(None, "If set, text prompts become [system, user] chat messages.")
    conversational: bool = _opt(False, "Wrap text prompts as a user message so the chat template applies.")
    chat_template: str | None = _opt(None, "A Jinja chat template replacing the tokenizer's.")
    # What is loaded, under TRL's ModelConfig names (passed through model_init_kwargs, which wins when it sets one)
    model_revision: str | None = _opt(None, "Model revision: a branch, tag or commit id.")
    dtype: str | None = _opt(None, "Weights' dtype: 'auto', 'bfloat16', 'float16' or 'float32' (default float32).")
    attn_implementation: str | None = _opt(None, "Attention implementation, e.g. 'sdpa', 'eager', 'flash_attention_2'.")
    load_in_4bit: bool = _opt(False, "QLoRA: load the base model in 4 bits (bitsandbytes; needs a CUDA GPU).")
    load_in_8bit: bool = _opt(False, "Load the base model in 8 bits (bitsandbytes; needs a CUDA GPU).")
    bnb_4bit_quant_type: str = _opt("nf4", "4-bit quantisation type: 'nf4' or 'fp4'.")
    use_bnb_nested_quant: bool = _opt(False, "Quantise the 4-bit quantisation constants too.")
    bnb_4bit_quant_storage: str | None = _opt(None, "Storage dtype of the 4-bit weights.")
    reward_funcs: list[str] | None = _opt(
        None, f"Reward functions: names from {sorted(reward_library.REWARD_FUNCS)}, or 'module:function' / "
              "'file.py:function'. Extra dataset columns reach them as keyword arguments.")
    reward_model_name_or_path: str | None = _opt(
        None, "A sequence-classification reward model (Hub id or local directory), added to reward_funcs.")
    use_peft: bool = _opt(False, "Train a LoRA adapter instead of all weights.")
    lora_r: int = _opt(16, "LoRA rank.")
    lora_alpha: int = _opt(32, "LoRA alpha (scale = alpha / r).")
    lora_dropout: float = _opt(0.05, "Dropout on the LoRA input.")
    lora_target_modules: list[str] | None = _opt(None, "Modules to adapt (default: all linear layers but lm_head).")
    lora_target_parameters: list[str] | None = _opt(None, "Parameters to adapt directly (e.g. MoE expert weights).")
    lora_modules_to_save: list[str] | None = _opt(None, "Modules trained in full beside the adapter.")
    lora_task_type: str = _opt("CAUSAL_LM", "PEFT task type.")
    use_rslora: bool = _opt(False, "Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r.")
    use_dora: bool = _opt(False, "DoRA: weight-decomposed low-rank adaptation.")


class _Parser(HfArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the whole usage block, then exit
        raise UsageError(message)


def _parser() -> _Parser:
    parser = _Parser((ScriptArguments, GRPOConfig), prog="grpo-train", allow_abbrev=False,
                     description="Train a causal LM with GRPO/RLOO. Every field can also be set in --config.")
    parser.add_argument("--config", help="YAML file of field: value pairs; flags override it.")
    parser.add_argument("--demo", action="store_true", help="Run the offline demo (the default with no arguments).")
    return parser


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3)
    return f"did you mean {', '.join(close)}? " if close else ""


def _read_yaml(path: str, actions: dict[str, argparse.Action]) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} does not exist.")
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read config file {path!r}: {' '.join(str(exc).split())}") from None
    if not isinstance(values, dict):
        raise UsageError(f"config file {path!r} must hold 'field: value' pairs, not a {type(values).__name__}.")
    try:
        values = recipe.translate(values, path, actions)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for key, value in values.items():
        if key not in actions:
            raise UsageError(f"unknown field {key!r} in {path}; {_suggest(key, sorted(actions))}"
                             "`grpo-train --help` lists every field.")
        if actions[key].nargs == "+" and value is not None and not isinstance(value, list):
            values[key] = [value]  # `reward_funcs: accuracy` means [accuracy]
    return values


def parse_args(argv: list[str], require_data: bool = True) -> tuple[ScriptArguments, GRPOConfig]:
    """Demo defaults < YAML file < flags. Raises UsageError for anything unknown or invalid. `require_data`: a
    dataset and rewards must be named (training; `grpo-train plan` needs only the model)."""
    parser = _parser()
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "demo")}
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("--demo", action="store_true")
    early, _ = pre.parse_known_args(argv)
    defaults = dict(DEMO) if early.demo or not argv else {}
    if early.config:
        defaults.update(_read_yaml(early.config, actions))
    parser.set_defaults(**defaults)
    try:
        script_args, config, _, unknown = parser.parse_args_into_dataclasses(
            argv, return_remaining_strings=True, look_for_args_file=False)
    except (TypeError, ValueError) as exc:  # a dataclass rejected a value (GRPOConfig's checks)
        raise UsageError(" ".join(str(exc).split())) from None
    if unknown:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0])
        raise UsageError(f"unknown argument {flag!r}; {_suggest(flag, [f'--{k}' for k in actions])}"
                         "`grpo-train --help` lists every field.")
    no_data = script_args.dataset_name is None or not (script_args.reward_funcs
                                                       or script_args.reward_model_name_or_path)
    if script_args.model_name_or_path is None and not require_data:
        raise UsageError("model_name_or_path is required; run with no arguments or --demo for the offline demo.")
    if script_args.model_name_or_path is None or (require_data and no_data):
        raise UsageError("model_name_or_path, dataset_name and reward_funcs (or reward_model_name_or_path) are "
                         "required; run with no arguments or --demo for the offline demo.")
    return script_args, config


def _is_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or os.path.splitext(path)[1] in DATA_FILE_BUILDERS or os.path.exists(path)


def _check_exists(path: str, what: str) -> None:
    if _is_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise UsageError(f"{what} {path!r} does not exist (a local path; Hub ids look like 'org/name').")


def load_rewards(script_args: ScriptArguments, config: GRPOConfig) -> list:
    try:
        funcs = [reward_library.get_reward_func(spec, config.max_completion_length)
                 for spec in script_args.reward_funcs or []]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if script_args.reward_model_name_or_path:
        _check_exists(script_args.reward_model_name_or_path, "reward model")
        funcs.append(script_args.reward_model_name_or_path)
    return funcs


def load_train_dataset(script_args: ScriptArguments) -> Any:
    """The training split with its prompts in a `prompt` column (chat messages if asked for)."""
    return _load_split(script_args, script_args.dataset_train_split)


def load_eval_dataset(script_args: ScriptArguments, config: GRPOConfig) -> Any:
    """The evaluation split (`dataset_test_split`) when the run evaluates (eval_strategy is not 'no'), else None."""
    if str(getattr(config.eval_strategy, "value", config.eval_strategy)) == "no":
        return None
    name = script_args.dataset_name
    if name.startswith(BUILTIN) or os.path.splitext(name)[1] in DATA_FILE_BUILDERS:
        raise UsageError(f"eval_strategy={config.eval_strategy.value!r} needs a test split, but dataset {name!r} is a "
                         "single split; pass a dataset directory or Hub id with a "
                         f"{script_args.dataset_test_split!r} split, or set eval_strategy to 'no'.")
    return _load_split(script_args, script_args.dataset_test_split)


def _load_split(script_args: ScriptArguments, split: str) -> Any:
    from datasets import load_dataset

    name = script_args.dataset_name
    if name == f"{BUILTIN}copy_digits":
        from grpo_trainer.cli.toy import copy_digits_dataset

        dataset = copy_digits_dataset(num_prompts=512)
    elif name.startswith(BUILTIN):
        raise UsageError(f"unknown built-in dataset {name!r}; the built-in one is '{BUILTIN}copy_digits'.")
    else:
        _check_exists(name, "dataset")
        builder = DATA_FILE_BUILDERS.get(os.path.splitext(name)[1])
        streaming = script_args.dataset_streaming
        try:
            dataset = load_dataset(builder, data_files={split: name}, split=split, streaming=streaming) if builder \
                else load_dataset(name, script_args.dataset_config, split=split, streaming=streaming)
        except (FileNotFoundError, ConnectionError, ValueError) as exc:  # not found, offline, unknown split/config
            raise UsageError(f"cannot load dataset {name!r}: {' '.join(str(exc).split())}") from None
    column, columns = script_args.prompt_column, dataset.column_names  # None for some streamed datasets
    if columns is not None and column not in columns:
        raise UsageError(f"dataset {name!r} has no prompt column {column!r}; its columns are "
                         f"{columns} (choose one with --prompt_column).")
    if column != "prompt":
        dataset = dataset.remove_columns([c for c in ["prompt"] if c in (columns or [])])
        dataset = dataset.rename_column(column, "prompt")
    if script_args.system_prompt or script_args.conversational:
        system = [{"role": "system", "content": script_args.system_prompt}] if script_args.system_prompt else []
        dataset = dataset.map(lambda row: {"prompt": system + [{"role": "user", "content": row["prompt"]}]}
                              if isinstance(row["prompt"], str) else {"prompt": row["prompt"]})
    return dataset


def check_columns(reward_funcs: list, dataset: Any, script_args: ScriptArguments) -> None:
    if dataset.column_names is None:  # a stream that does not declare them: the trainer checks the first row
        return
    columns = set(dataset.column_names)
    for spec, func in zip(script_args.reward_funcs or [], reward_funcs):
        missing = sorted(reward_library.required_columns(func) - columns)
        if missing:
            raise UsageError(f"reward function {spec!r} needs dataset column(s) {missing}, which "
                             f"{script_args.dataset_name!r} lacks; its columns are {sorted(columns)}.")


def load_model(script_args: ScriptArguments, config: GRPOConfig | None = None) -> tuple[Any, Any]:
    """(model or model id, tokenizer or None); the trainer loads ids itself, and their tokenizer unless the recipe
    replaces its chat template."""
    name = script_args.model_name_or_path
    if name == f"{BUILTIN}tiny":
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        # Matrices this small run fastest on one thread: on 2 busy cores a step took 7x longer with two.
        torch.set_num_threads(1)
        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer)
    elif name.startswith(BUILTIN):
        raise UsageError(f"unknown built-in model {name!r}; the built-in one is '{BUILTIN}tiny'.")
    else:
        _check_exists(name, "model")
        model, tokenizer = name, None
        if script_args.chat_template is not None:
            from grpo_trainer.runtime import models

            kwargs = models.init_kwargs(recipe.model_init_kwargs(script_args, config),
                                        config.trust_remote_code if config is not None else False)
            models.check_remote_code(name, kwargs["trust_remote_code"], kwargs.get("revision"))
            tokenizer = models.load_tokenizer(name, kwargs["trust_remote_code"], kwargs.get("revision"),
                                              padding_side="left", truncation_side="left")
    if script_args.chat_template is not None:
        tokenizer.chat_template = script_args.chat_template
    return model, tokenizer


def peft_config(script_args: ScriptArguments) -> Any:
    if not script_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(task_type=script_args.lora_task_type, r=script_args.lora_r, lora_alpha=script_args.lora_alpha,
                      lora_dropout=script_args.lora_dropout,
                      target_modules=script_args.lora_target_modules or "all-linear",
                      target_parameters=script_args.lora_target_parameters,
                      modules_to_save=script_args.lora_modules_to_save, use_rslora=script_args.use_rslora,
                      use_dora=script_args.use_dora)


def prepare(argv: list[str]) -> tuple[ScriptArguments, GRPOConfig, list, Any, Any]:
    """Everything that can fail on bad input, before a model is loaded: (script args, config, rewards, train and
    eval datasets). The model keys land in `config.model_init_kwargs`."""
    script_args, config = parse_args(argv)
    reward_funcs = load_rewards(script_args, config)
    dataset = load_train_dataset(script_args)
    eval_dataset = load_eval_dataset(script_args, config)
    check_columns(reward_funcs, dataset, script_args)
    try:
        check_reward_setup(reward_funcs, config.reward_weights, None)
        check_dataset(dataset, "train_dataset", None)
        check_dataset(eval_dataset, "eval_dataset", None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config.model_init_kwargs = recipe.model_init_kwargs(script_args, config)
    return script_args, config, reward_funcs, dataset, eval_dataset


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm-serve"]:
        from grpo_trainer.cli import vllm_serve

        return vllm_serve.main(argv[1:])
    if argv[:1] == ["doctor"]:
        from grpo_trainer.cli import doctor

        return doctor.main(argv[1:])
    try:
        script_args, config, reward_funcs, dataset, eval_dataset = prepare(argv)
        model, tokenizer = load_model(script_args, config)
    except UsageError as exc:
        print(f"grpo-train: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    from grpo_trainer.trainer import GRPOTrainer

    trainer = GRPOTrainer(model, reward_funcs, args=config, train_dataset=dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, callbacks=[RunLogCallback()],
                          peft_config=peft_config(script_args),
                          quantization_config=recipe.quantization_config(script_args))
    trainer.train()
    trainer.save_model(config.output_dir)
    if trainer.is_world_process_zero():
        _print_summary(config.output_dir, trainer.health.summary)
    # Under `accelerate launch`, a gloo/NCCL group left alive at interpreter exit can abort a rank
    # ("terminate called without an active exception") after everything was saved.
    trainer.accelerator.end_training()


def _print_summary(output_dir: str, health: Any = None) -> None:
    """The run's reward rise, its training-health summary (`diagnosis.monitor.Summary`, None with
    health_checks=False; docs/HEALTH.md) and where its files are."""
    metrics = os.path.join(output_dir, "metrics.jsonl")
    first, last = reward_rise(read_metrics(metrics)) if os.path.exists(metrics) else (float("nan"),) * 2
    print(f"\nreward: {first:.3f} (first 10% of log steps) -> {last:.3f} (last 10%)")
    if health is not None:
        print("\n".join(health.lines()))
    for name in ("metrics.jsonl", "metrics.png", "completions"):
        if os.path.exists(os.path.join(output_dir, name)):
            print(f"{name}: {os.path.join(output_dir, name)}")
    print(f"model and checkpoints: {output_dir}")


if __name__ == "__main__":
    main()
