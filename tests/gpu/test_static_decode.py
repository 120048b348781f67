"""On a CUDA GPU: the static decode steps (`rollout.fast.static`) with finished rows compacted out and the step
replayed as CUDA graphs per bucket. A graph replay equals the eager static step (the same kernels: bitwise); greedy
tokens equal `model.generate`'s in float32; in bfloat16 the graphs' log-probs stay within bf16 rounding of the eager
decoder's. Skipped, with the reason, where no CUDA device is available: tests/rollout/fast/test_static.py tests
the same steps eagerly on CPU (bucket choice, compaction, exactness against the eager decoder).

    python -m pytest -q tests/gpu/test_static_decode.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests need one (CUDA graphs run on cuda:0)", allow_module_level=True)

from grpo_trainer.rollout.fast import static  # noqa: E402
from grpo_trainer.rollout.fast.backend import FastBackend  # noqa: E402
from grpo_trainer.rollout.generate import generate_rollout  # noqa: E402
from grpo_trainer.rollout.types import end_at_first_eos  # noqa: E402
from tests.helpers import assert_same_rollout, greedy_config, model_of_kind  # noqa: E402
from tests.static_helpers import decode, early_eos_config, varied_prompts  # noqa: E402

CUDA = torch.device("cuda:0")


def _setup(tokenizer, kind="qwen2.5-0.5b", dtype=torch.float32):
    model = model_of_kind(kind, tokenizer).to(device=CUDA, dtype=dtype).eval()
    prompts = varied_prompts(tokenizer).to(CUDA)
    return model, prompts


def test_graph_replay_equals_the_eager_static_step(tokenizer, monkeypatch):
    """The same static step (masked full-width attention, tensor column) with and without CUDA graphs: graphs were
    captured for more than one bucket (rows were compacted), and tokens and log-probs are equal."""
    model, prompts = _setup(tokenizer)
    config = early_eos_config(tokenizer, model, prompts)
    runs = []
    graphs = decode(model, prompts, config, "graphs", runs=runs)
    assert runs[0].use_graphs and len(runs[0].graphs) >= 2 and runs[0].compactions
    # the eager static step: the same module with graphs refused (as off CUDA), on the same device
    monkeypatch.setattr(static, "graphs_blocker", lambda device, outputs: "switched off by the test")
    eager_runs = []
    eager = decode(model, prompts, config, "graphs", runs=eager_runs)
    assert not eager_runs[0].use_graphs and not eager_runs[0].graphs
    assert torch.equal(graphs.completion_ids, eager.completion_ids)
    # The same kernels replayed: equal bits are expected; the float32 tolerance of one ulp at |log p| ~ 10 leaves
    # room only for cuBLAS picking another algorithm under capture, not for a wrong column, row or mask.
    torch.testing.assert_close(graphs.logps, eager.logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(graphs.entropy, eager.entropy, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["compact", "graphs"])
@pytest.mark.parametrize("kind", ["qwen2.5-0.5b", "llama", "qwen3"])
def test_greedy_tokens_equal_generate_in_fp32(tokenizer, kind, mode):
    model, prompts = _setup(tokenizer, kind)
    config = early_eos_config(tokenizer, model, prompts)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    lengths = reference.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # mixed lengths: rows were compacted
    fast = FastBackend(cuda=mode).generate(model, prompts, config)
    assert_same_rollout(fast, reference)


def test_bf16_graph_logps_within_rounding_of_the_eager_decoder(tokenizer):
    """bf16 (8 significant bits): the graphs' attention sums over masked columns too, so log-probs move by bf16
    rounding of the hidden states; compared on each row's tokens up to where the two token streams first differ
    (a near-tie may flip a greedy token in bf16), which must cover most of the tokens."""
    model, prompts = _setup(tokenizer, dtype=torch.bfloat16)
    config = greedy_config(tokenizer, max_new_tokens=24)
    eager = decode(model, prompts, config, "eager")
    graphs = decode(model, prompts, config, "graphs")
    same = (graphs.completion_ids == eager.completion_ids).long().cumprod(1).bool()  # common prefix per row
    _, mask, _ = end_at_first_eos(eager.completion_ids.clone(), config)
    compared = same & mask.bool()
    assert compared.sum() >= 0.8 * mask.sum()
    torch.testing.assert_close(graphs.logps[compared], eager.logps[compared], atol=0.1, rtol=0.02)
    assert (graphs.logps[compared] - eager.logps[compared]).abs().mean() < 0.03


def test_the_cache_is_never_reallocated_and_graphs_share_one_pool(tokenizer):
    model, prompts = _setup(tokenizer)
    config = early_eos_config(tokenizer, model, prompts)
    steps, runs = [], []
    decode(model, prompts, config, "graphs", steps=steps, runs=runs)
    assert len(steps) >= 1 and len({tuple(pointers) for *_, pointers in steps}) == 1
    assert runs[0].pool is not None and set(runs[0].graphs) <= {16, 8, 4, 2, 1}
