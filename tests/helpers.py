"""Helpers shared by test modules: tiny models of each decoder family, grouped prompts, greedy settings, and rollout
comparisons. Everything is built offline from configs."""

import copy

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
)

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.types import PromptBatch, Rollout

MAX_NEW = 12


def model_of_kind(kind: str, tokenizer, **overrides):
    """A tiny randomly initialised model of each family (seeded); `overrides` go into its config."""
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
                                                  **overrides})}[kind]()
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


def copy_task_trainer(output_dir, tokenizer, dataset, reward_funcs=None, model=None, **overrides):
    """A GRPOTrainer on the toy copy task with a tiny seeded model: 4 completions per step, G=2, short completions,
    no checkpoints unless asked for."""
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_reward

    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, learning_rate=0.01, max_steps=2, report_to="none", save_strategy="no",
                    logging_steps=1, seed=0, disable_tqdm=True)
    settings.update(overrides)
    return GRPOTrainer(model if model is not None else make_tiny_model(tokenizer, seed=7),
                       reward_funcs if reward_funcs is not None else copy_digits_reward,
                       args=GRPOConfig(**settings), train_dataset=dataset, processing_class=tokenizer)


def vlm_families(families) -> list:
    """`families` (keys of `cli.toy_vlm.VLM_FAMILIES`) as pytest parameters; one whose processor the installed
    transformers cannot build offline (Gemma 4's imports torchvision before transformers 5.24) is skipped with the
    import error as the reason."""
    from grpo_trainer.cli.toy_vlm import VLM_FAMILIES

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
    """Run `command` with its output in the file `log` until it exits, or until `timeout_s` pass: then its whole
    process group is killed (a launcher's ranks, a server's workers) and the exit code is -9."""
    import os
    import signal
    import subprocess

    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return -9


def force_onednn(monkeypatch) -> None:
    """Every float32 CPU product that `modeling.kernels` serves goes through oneDNN, however small (the test
    models' products are below `MIN_MACS`); skips where this torch build has no oneDNN linear."""
    from grpo_trainer.modeling import kernels

    if kernels._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(kernels, "_choice", kernels.KernelChoice(True, True, "forced by the test"))
    monkeypatch.setattr(kernels, "MIN_MACS", 0)
