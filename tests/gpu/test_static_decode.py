"""On a CUDA GPU: the static decode steps (`rollout.fast.static`) with finished rows compacted out and the step
replayed as CUDA graphs per bucket. A graph replay equals the eager static step (the same kernels: bitwise); greedy
tokens equal `model.generate`'s in float32; in bfloat16 the graphs' log-probs stay within bf16 rounding of the eager
decoder's. The module imports and collects everywhere; without a CUDA device each test is skipped, with the reason
(the `gpu` marker, tests/conftest.py). The bodies are tests/gpu/bodies.py's, which tests/rollout/fast/test_static.py
runs on CPU, where the same steps run eagerly (graphs refused off CUDA): bucket choice, compaction in place,
exactness against the eager decoder, bf16 rounding.

    python -m pytest -q tests/gpu/test_static_decode.py
"""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.rollout.fast import static
from tests.gpu.bodies import (
    bf16_static_logps_within_rounding,
    compactions_in_place,
    graphs_against_the_eager_static_step,
    static_greedy_tokens_equal_generate,
)

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)

CUDA = torch.device("cuda:0")


def test_graph_replay_equals_the_eager_static_step(tokenizer):
    """The same static step (masked full-width attention, tensor column) with and without CUDA graphs: graphs were
    captured for more than one bucket (rows were compacted), and tokens and log-probs are equal."""
    graphs, _ = graphs_against_the_eager_static_step(tokenizer, CUDA)
    assert graphs.use_graphs and len(graphs.graphs) >= 2


@pytest.mark.parametrize("mode", ["compact", "graphs"])
@pytest.mark.parametrize("kind", ["qwen2.5-0.5b", "llama", "qwen3"])
def test_greedy_tokens_equal_generate_in_fp32(tokenizer, kind, mode):
    static_greedy_tokens_equal_generate(tokenizer, kind, mode, CUDA)


def test_bf16_graph_logps_within_rounding_of_the_eager_decoder(tokenizer):
    bf16_static_logps_within_rounding(tokenizer, CUDA)


def test_the_cache_is_never_reallocated_and_graphs_share_one_pool(tokenizer):
    run = compactions_in_place(tokenizer, CUDA)
    assert run.use_graphs and run.pool is not None and set(run.graphs) <= set(static.buckets(16))
