"""Helpers shared by test modules: the one trainer builder (`make_trainer`, `make_args` over `TRAINER_DEFAULTS`),
tiny models of each decoder family and of Qwen2.5-0.5B's layout, grouped prompts, greedy settings, and rollout
comparisons. Everything is built offline from configs."""

import contextlib
import copy
import inspect
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    TrainerCallback,
)

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model
from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.types import PromptBatch, Rollout
from grpo_trainer.runtime import compat

MAX_NEW = 12
# The repository's root: a subprocess's PYTHONPATH, so that it imports this checkout's `grpo_trainer` and `tests`
# (an editable install elsewhere would otherwise win).
REPO = str(Path(__file__).resolve().parents[1])


# Qwen2.5-0.5B's layout at reduced width: its 14 query and 2 key/value heads (grouped-query attention, 7 query heads
# per key/value head), q/k/v biases (Qwen2's), tied input and output embeddings, rope theta 1e6, RMS-norm eps 1e-6,
# and its MLP ratio (4864 / 896); head_dim 16 instead of 64 (hidden 224 instead of 896), 2 layers instead of 24 and
# the test tokenizer's vocabulary instead of 151,936, so a test runs in seconds.
QWEN2_5_0_5B_LAYOUT = dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=14 * 16,
                           intermediate_size=4864 * 14 * 16 // 896, num_hidden_layers=2, tie_word_embeddings=True,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def model_of_kind(kind: str, tokenizer, **overrides):
    """A tiny randomly initialised model of each family (seeded), or of one real checkpoint's layout
    (`qwen2.5-0.5b`); `overrides` go into its config."""
    if kind == "qwen2" and not overrides:
        return make_tiny_model(tokenizer, seed=1)
    common = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = {"qwen2": lambda: Qwen2Config(**{**common, **overrides}),
              "llama": lambda: LlamaConfig(**{"attention_bias": True, **common, **overrides}),  # biased q/k/v/o
              "qwen3": lambda: Qwen3Config(**{**common, "head_dim": 24, **overrides}),  # q/k norms, head_dim != E / H
              # a window longer than any test unless overridden
              "mistral": lambda: MistralConfig(**{**common, "sliding_window": 4096, **overrides}),
              # Llama 3.x: frequency-dependent rotary scaling, untied LM head, no biases.
              "llama3": lambda: LlamaConfig(**{**common, "rope_scaling": {
                  "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}, **overrides}),
              "gpt2": lambda: GPT2Config(**{"vocab_size": len(tokenizer), "n_embd": 32, "n_layer": 1, "n_head": 2,
                                            **overrides}),
              "gpt2_no_dropout": lambda: GPT2Config(**{"vocab_size": len(tokenizer), "n_embd": 32, "n_layer": 2,
                                                       "n_head": 2, **no_dropout, **overrides}),
              # local/global layers (a sliding window of 4), attention and final logit soft-capping
              "gemma2": lambda: Gemma2Config(**{**common, "head_dim": 16, "sliding_window": 4, **overrides}),
              "phi3": lambda: Phi3Config(**{**common, **overrides}),  # fused qkv and gate|up projections
              "mixtral": lambda: MixtralConfig(**{**common, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                  **overrides}),
              "qwen2.5-0.5b": lambda: Qwen2Config(**{**common, **QWEN2_5_0_5B_LAYOUT, **overrides})}[kind]()
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def fresh_copy(model):
    """A copy of `model` for a reference run, so the run under test starts from the same state. Dynamic RoPE keeps
    state between calls: transformers < 5.14 left the frequencies grown by a long call in place for the next call
    (it recorded the cached length under another attribute name), so a second run would start from other ones."""
    return copy.deepcopy(model)


def grouped_prompts(tokenizer, repeats: int = 2) -> PromptBatch:
    """Three prompts of different lengths (left padding differs per row), each repeated as a GRPO group."""
    texts = [t for t in ["copy 123:", "copy 98765:", "c"] for _ in range(repeats)]
    return tokenize_prompts(tokenizer, texts, None)


def greedy_config(tokenizer, **overrides) -> GenerationConfig:
    settings = {"do_sample": False, "max_new_tokens": MAX_NEW, "eos_token_id": [tokenizer.eos_token_id],
                "pad_token_id": tokenizer.pad_token_id, "disable_compile": True}
    return GenerationConfig(**{**settings, **overrides})


def fast_rollout(model, prompts: PromptBatch, config: GenerationConfig, **capture) -> Rollout:
    """The fast backend's rollout, keeping the replay tensors named in `capture` (`layer_outputs`, `probs`); on CUDA
    through its decoder (which the backend's default leaves to `generate` there)."""
    return FastBackend(cuda="decoder").generate(model, prompts, config, Capture(**capture))


def assert_same_rollout(fast: Rollout, reference: Rollout) -> None:
    assert torch.equal(fast.completion_ids, reference.completion_ids)
    assert torch.equal(fast.completion_mask, reference.completion_mask)
    assert torch.equal(fast.is_truncated, reference.is_truncated)


# A model architecture that transformers does not ship: it exists only as the Python files saved beside the weights
# (an `auto_map` in config.json and tokenizer_config.json), so it loads only with trust_remote_code=True.
REMOTE_CODE = {
    "configuration_tinyremote.py": """
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
""",
    "modeling_tinyremote.py": """
from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_tinyremote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig


class TinyRemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyRemoteConfig

    def __init__(self, config):  # transformers' AutoModel does not know this config: build the body directly
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()
""",
    "tokenization_tinyremote.py": """
from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    pass
""",
}


def write_remote_code_model(folder, tokenizer, task: str = "causal-lm") -> str:
    """Save a tiny Llama-shaped model (task 'causal-lm' or 'reward') and `tokenizer` to `folder` as a checkpoint
    whose model, config and tokenizer classes live in the folder's own code. Returns the folder as a string."""
    import json
    import os

    from transformers import LlamaForSequenceClassification

    folder = str(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if task == "causal-lm":
        model, auto, name = AutoModelForCausalLM.from_config(config), "AutoModelForCausalLM", "TinyRemoteForCausalLM"
    else:
        model = LlamaForSequenceClassification(config)
        auto, name = "AutoModelForSequenceClassification", "TinyRemoteForSequenceClassification"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for file, code in REMOTE_CODE.items():
        with open(os.path.join(folder, file), "w") as f:
            f.write(code)

    def update(file: str, **values) -> None:
        path = os.path.join(folder, file)
        with open(path) as f:
            content = json.load(f)
        with open(path, "w") as f:
            json.dump({**content, **values}, f)

    update("config.json", model_type="tiny_remote", architectures=[name],
           auto_map={"AutoConfig": "configuration_tinyremote.TinyRemoteConfig", auto: f"modeling_tinyremote.{name}"})
    update("tokenizer_config.json", tokenizer_class="TinyRemoteTokenizer",
           auto_map={"AutoTokenizer": [None, "tokenization_tinyremote.TinyRemoteTokenizer"]})
    return folder


# The settings every test trainer starts from: one round of 4 completions (2 prompts x G=2) per step, 6 completion
# tokens, a learning rate high enough that every trainable parameter visibly moves within the 2 steps, a log entry
# every step, no checkpoints, no progress bar, seed 0. A test passes only the fields where it differs.
TRAINER_DEFAULTS = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, learning_rate=0.1,
                        max_steps=2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
# The other round shape the tests use: 2 prompts x G=4 (wider groups: rarely all rewards equal).
TWO_GROUPS_OF_4 = dict(per_device_train_batch_size=8, num_generations=4)


def make_args(output_dir, **overrides):
    """A `GRPOConfig` writing to `output_dir`: `TRAINER_DEFAULTS` with `overrides` (any GRPOConfig field) over them."""
    return GRPOConfig(**{**TRAINER_DEFAULTS, "output_dir": str(output_dir), **overrides})


# GRPOTrainer's keyword arguments that `make_trainer` passes through; the others, and a name that is both
# (`advantage_estimator`), are GRPOConfig fields.
_TRAINER_KWARGS = set(inspect.signature(GRPOTrainer.__init__).parameters) - {
    "self", "model", "reward_funcs", "train_dataset", "processing_class"} - {f.name for f in fields(GRPOConfig)}


def make_trainer(output_dir, processing_class, dataset=None, reward_funcs=None, model=None, **settings):
    """The one builder of the tests' trainers: a `GRPOTrainer` on `dataset` (the toy copy task's 32 prompts when None)
    with `reward_funcs` (`copy_digits_reward` when None) and `model` (a fresh tiny model, seed 0, when None).
    `settings` are `GRPOTrainer`'s own keyword arguments (`peft_config`, `callbacks`, `tools`, `eval_dataset`, an
    `args` built elsewhere, ...) and GRPOConfig fields over `TRAINER_DEFAULTS` (through `make_args`)."""
    trainer_kwargs = {k: settings.pop(k) for k in list(settings) if k in _TRAINER_KWARGS}
    if "args" not in trainer_kwargs:
        trainer_kwargs["args"] = make_args(output_dir, **settings)
    elif settings:
        raise TypeError(f"config fields {sorted(settings)} given with a ready `args`: set them on it")
    return GRPOTrainer(make_tiny_model(processing_class) if model is None else model,
                       copy_digits_reward if reward_funcs is None else reward_funcs,
                       train_dataset=copy_digits_dataset(num_prompts=32) if dataset is None else dataset,
                       processing_class=processing_class, **trainer_kwargs)


def checkpointing_trainer(output_dir, tokenizer, dataset, model=None, **settings):
    """For tests that drive rounds and losses by hand: a trainer (2 prompts x G=4, 8 completion tokens, temperature
    1.3, `model` or the tiny model of seed 2) whose model is in training mode with activation checkpointing on, as
    `Trainer.train` sets it up."""
    model = make_tiny_model(tokenizer, seed=2) if model is None else model
    trainer = make_trainer(output_dir, tokenizer, dataset, model=model,
                           **{**TWO_GROUPS_OF_4, "max_completion_length": 8, "temperature": 1.3, **settings})
    compat.enable_checkpointing(trainer.model)  # what Trainer.train does first
    trainer.model.train()
    return trainer


def varied_reward(completions, **kwargs):
    """A reward that always separates the completions of a group (their lengths, plus 0.1 x the row), so every step
    has a gradient."""
    return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]


class StopAt(TrainerCallback):
    """Interrupts training after `step` optimizer steps, as a crash would (the schedule still plans max_steps)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def logged(trainer, key: str) -> list:
    """Every value of `key` in the trainer's log history, in order."""
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def train_and_compare(trainer) -> dict:
    """`trainer.train()`, then: its last logged train_loss is finite, and {parameter name: whether it changed}."""
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    loss = trainer.state.log_history[-1]["train_loss"]
    assert loss is not None and math.isfinite(loss)
    return {n: not torch.equal(p, before[n]) for n, p in model.named_parameters()}


def vlm_families(families) -> list:
    """`families` (keys of `tests.toy_vlm.VLM_FAMILIES`) as pytest parameters; one whose processor the installed
    transformers cannot build offline (Gemma 4's imports torchvision before transformers 5.24) is skipped with the
    import error as the reason."""
    from tests.toy_vlm import VLM_FAMILIES

    params = []
    for family in families:
        try:
            VLM_FAMILIES[family]()
            marks = ()
        except ImportError as error:
            marks = pytest.mark.skip(reason=f"{family}'s processor cannot be built here: {error}")
        params.append(pytest.param(family, marks=marks))
    return params


def run_bounded(command: list[str], cwd, env: dict, log, timeout_s: float) -> int:
    """Run `command` with its output in the file `log` until it exits, or until `timeout_s` pass: then every process
    it started is killed (a launcher's ranks, a server's workers) and the exit code is -9. The descendants are
    collected before the process group is killed: torch's elastic agent can start ranks outside the launcher's
    group, and a rank left waiting (on a collective, or on the lock of a DeepSpeed op build) held that lock and
    hung every later launch of the session."""
    import os
    import signal
    import subprocess

    import psutil

    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            descendants = []
            with contextlib.suppress(psutil.NoSuchProcess):
                descendants = psutil.Process(process.pid).children(recursive=True)
            os.killpg(process.pid, signal.SIGKILL)
            for child in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            process.wait()
            return -9


def fast_path_blocker(model, config, prompt_length: int) -> str | None:
    """Why the hand-written decoder must not run this model/config (None when it reproduces it): the settings'
    guard, then the architecture's, as `FastBackend.generate` asks them."""
    from grpo_trainer.modeling.unwrap import causal_lm
    from grpo_trainer.rollout.fast.guard import decoder_blocker, resolved, settings_blocker
    from grpo_trainer.rollout.settings import max_new_tokens

    reason = settings_blocker(model, config, prompt_length)
    if reason is not None:
        return reason
    lm = causal_lm(model)
    return decoder_blocker(lm, prompt_length + max_new_tokens(resolved(lm, config), prompt_length))


def sgd_step_args(output_dir, **overrides):
    """One SGD step (lr 1, no clipping) on the copy-digits task with checkpointing and a KL term: the settings under
    which an exact option (the tiled MLP, activation offloading) must move the weights as the plain run does."""
    from grpo_trainer import GRPOConfig

    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=12, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, max_steps=1,
                    report_to="none", save_strategy="no", logging_steps=1, seed=0, gradient_checkpointing=True,
                    loss_type="dapo", disable_dropout=True, beta=0.04)
    return GRPOConfig(**{**settings, **overrides})


def sgd_step_deltas(model_dir, tokenizer, args, offloading=None) -> dict:
    """{name: weight change} of training the model saved at `model_dir` with `args`; `offloading`: a context manager
    around each training step (what `activation_offloading=True` installs on a GPU)."""
    from grpo_trainer import GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward

    trainer = GRPOTrainer(str(model_dir), copy_digits_reward, args=args,
                          train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
    if offloading is not None:
        trainer.offloading = offloading  # what activation_offloading=True sets (trainer.parts.activation_offloading)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
