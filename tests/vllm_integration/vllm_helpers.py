"""Helpers of the vLLM tests (see conftest.py): the tiny model vLLM can run, trainer settings, server start and stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.vllm.checks import installed_version

REPO = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT_S = 420  # the first start imports vLLM and builds the engine; slow on a busy 2-core box
HAS_VLLM = installed_version() is not None
ON_GPU = torch.cuda.is_available()

requires_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: build its environment with "
                                                        "`bash scripts/vllm_cpu_env.sh` and run `bash "
                                                        "scripts/test_vllm.sh` (or install the `vllm` extra on a GPU)")


def vllm_tiny_model(tokenizer, seed: int = 0):
    """The tiny model vLLM can run (head_dim 32), with weights spread enough that greedy decoding varies."""
    model = make_tiny_model(tokenizer, hidden_size=128, num_heads=4, seed=seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def vllm_tiny_moe(tokenizer, seed: int = 0):
    """A tiny Qwen3-MoE vLLM's CPU build runs (head_dim 32; 2 MoE layers of 8 experts, top 2, renormalised), in
    float32, its weights spread as `vllm_tiny_model`'s."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128,
                            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.add_(torch.randn_like(param) * 0.05)
    return model


def vllm_tiny_vlm(family: str, seed: int = 0):
    """`tests/toy_vlm.py`'s tiny VLM of `family` with a text model vLLM's CPU build can run (head size 32, hidden 128),
    its text config tying the embeddings as the model does (vLLM reads the text config's flag), and its processor."""
    from transformers import AutoModelForImageTextToText

    from tests.toy_vlm import VLM_FAMILIES, make_tiny_vlm

    config, processor = VLM_FAMILIES[family]()
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.head_dim = 128, 256, 32
    text.tie_word_embeddings = config.tie_word_embeddings
    reference, _ = make_tiny_vlm(family)  # its generation settings (EOS ids, padding)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # spread as vllm_tiny_model's, so greedy completions depend on the image
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.add_(torch.randn_like(param) * 0.05)
    model.generation_config = reference.generation_config
    return model, processor


def trainer_args(output_dir, **overrides):
    """A GRPOConfig for a few quick steps with vLLM, on the GPU when there is one."""
    from grpo_trainer import GRPOConfig

    settings = {"output_dir": str(output_dir), "use_vllm": True, "per_device_train_batch_size": 8,
                "num_generations": 4, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
                "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "learning_rate": 1e-2,
                "use_cpu": not ON_GPU, "vllm_gpu_memory_utilization": 0.2, "seed": 0,
                "activation_checkpointing": False}
    return GRPOConfig(**{**settings, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"the vLLM server at {url} did not start within {timeout} s:\n{log.read_text()[-4000:]}")


def stop(process: subprocess.Popen) -> None:
    """Stop the server and every process it started (its own session)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def served(model_dir: Path, log: Path, *extra: str, launcher: tuple[str, ...] = (),
           kv_cache_gib: str = "0.25") -> Iterator[str]:
    """`grpo-train vllm-serve` serving `model_dir` in float32 (so its log-probs compare with the trainer's at tight
    tolerance) on a free loopback port, its output in `log`; yields its URL, and stops it and every process it
    started on leaving. `launcher`: a command prefix (e.g. `taskset -c 0`, to pin it to a core)."""
    port = free_port()
    command = [*launcher, sys.executable, "-m", "grpo_trainer.cli", "vllm-serve", "--model", str(model_dir), "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max_model_len", "512", "--kv_cache_gib",
               kv_cache_gib, "--seed", "0", *extra]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                                           "OMP_NUM_THREADS": "1"},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log, SERVER_START_TIMEOUT_S)
        yield url
    finally:
        stop(process)
