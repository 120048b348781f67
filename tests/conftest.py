"""Offline fixtures: a character-level tokenizer with a chat template and a tiny Qwen2 model built from a config.

Nothing here touches the network. `HF_HUB_OFFLINE` makes any accidental Hub access fail fast instead of hanging.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model, make_tokenizer  # noqa: E402

# Tiny models gain nothing from a second thread, and lose a lot when the cores are busy.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    """A fresh randomly initialised tiny causal LM (hidden 64, 2 layers, ~81k parameters), float32."""
    return make_tiny_model(tokenizer)


@pytest.fixture
def toy_dataset():
    return copy_digits_dataset(num_prompts=32)


@pytest.fixture
def toy_conversational_dataset():
    return copy_digits_dataset(num_prompts=32, conversational=True)
