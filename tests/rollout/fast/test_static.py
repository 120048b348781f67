"""`fast.static`: the decoder stepped with finished rows compacted out of its preallocated KV cache ("compact"),
and at static shapes per batch-size bucket ("graphs"; on CPU the same step runs eagerly, CUDA graphs are tested
in tests/gpu/test_static_decode.py, which runs the bodies of tests/gpu/bodies.py that the tests here run on CPU).
Compared with `model.generate` (greedy) and with the eager decoder (sampled: same seed, same tokens and log-probs,
because token selection and its random draws still see every row)."""

import pytest
import torch

from grpo_trainer.rollout.fast import backend as fast_backend
from grpo_trainer.rollout.fast import static
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.rollout.types import end_at_first_eos
from tests.gpu.bodies import (
    bf16_static_logps_within_rounding,
    compactions_in_place,
    graphs_against_the_eager_static_step,
    static_greedy_tokens_equal_generate,
)
from tests.helpers import assert_same_rollout, greedy_config, model_of_kind
from tests.static_helpers import decode, early_eos_config, varied_prompts

CPU = torch.device("cpu")


def test_bucket_is_the_smallest_power_of_two_holding_the_live_rows_capped_at_the_batch():
    # 5 live rows -> 8 (4 < 5 <= 8); 9 of 12 -> 12 (16 > 12); none live -> 1 (a step always has a row)
    assert [static.bucket(n, 16) for n in (0, 1, 2, 3, 5, 8, 9, 16)] == [1, 1, 2, 4, 8, 8, 16, 16]
    assert static.bucket(9, 12) == 12 and static.bucket(4, 12) == 4
    assert static.buckets(12) == [1, 2, 4, 8, 12]
    assert static.buckets(1) == [1]


def test_graphs_are_refused_by_name_off_cuda_and_with_layer_outputs():
    assert "CUDA device" in static.graphs_blocker(torch.device("cpu"), None)
    assert "layer's output" in static.graphs_blocker(torch.device("cuda"), torch.zeros(1))
    assert static.graphs_blocker(torch.device("cuda"), None) is None


def test_bad_modes_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="cpu='fast'"):
        FastBackend(cpu="fast")
    monkeypatch.setenv(fast_backend.CUDA_DECODE_ENV, "graph")
    with pytest.raises(ValueError, match="GRPO_TRAINER_FAST_CUDA_DECODE='graph'"):
        FastBackend()
    monkeypatch.setenv(fast_backend.CUDA_DECODE_ENV, "graphs")
    backend = FastBackend()  # the switch is read when the backend is built; CPU keeps its own default
    assert backend.decode_mode("cuda") == "graphs" and backend.decode_mode("cpu") == "eager"
    assert not backend.uses_generate_on("cuda")
    monkeypatch.delenv(fast_backend.CUDA_DECODE_ENV)
    assert FastBackend().uses_generate_on("cuda")  # decision 5 stays the default


@pytest.mark.parametrize("mode", ["compact", "graphs"])
@pytest.mark.parametrize("kind", ["qwen2.5-0.5b", "llama", "qwen3"])
def test_greedy_tokens_equal_generate_with_rows_compacted(tokenizer, kind, mode):
    static_greedy_tokens_equal_generate(tokenizer, kind, mode, CPU)


def test_off_cuda_the_graphs_mode_runs_its_static_step_eagerly_and_says_why(tokenizer, caplog):
    """"graphs" on CPU: the step is refused graphs by device (logged once, with the reason), captures
    nothing, and compacts onto the same buckets at the same steps as when the test refuses graphs itself; both
    runs' tokens and log-probs are equal (tests/gpu compares the replayed graphs with the same eager step)."""
    with caplog.at_level("INFO", logger="grpo_trainer.rollout.fast.static"):
        run, _ = graphs_against_the_eager_static_step(tokenizer, CPU)
    assert not run.use_graphs and not run.graphs and run.pool is None
    assert caplog.text.count("the static decode step runs eagerly: CUDA graphs need a CUDA device, not cpu") == 1


def test_graphs_mode_compacts_in_place_onto_buckets(tokenizer):
    """The static step's compactions (masked full-width attention): onto ever smaller buckets of the 16 rows, inside
    the caches allocated once; rows of 4 lengths, 12 of which end early, leave the last bucket at 4 rows."""
    run = compactions_in_place(tokenizer, CPU, mode="graphs")
    assert run.static and run.n == 4 == run.compactions[-1][1]


def test_bf16_static_logps_within_rounding_of_the_eager_decoder(tokenizer):
    bf16_static_logps_within_rounding(tokenizer, CPU)


@pytest.mark.parametrize("mode", ["compact", "graphs"])
def test_sampled_tokens_and_logps_equal_the_eager_decoder_for_the_same_seed(tokenizer, mode):
    """Sampling: the loop draws two uniforms for every row at every step whatever the decoder stepped, so a live
    row's draw at step t is the eager decoder's; its logits are the same computation on fewer rows (compact: equal;
    graphs: attention over all columns under a mask, within float rounding)."""
    model = model_of_kind("qwen2.5-0.5b", tokenizer)
    prompts = varied_prompts(tokenizer)
    # 16 of the 104 tokens end a row: at temperature 1.3 rows end after a few steps each, at different steps
    config = greedy_config(tokenizer, max_new_tokens=24, eos_token_id=list(range(20, 36)), do_sample=True,
                           temperature=1.3)
    eager = decode(model, prompts, config, "eager", seed=5)
    compactions = []
    other = decode(model, prompts, config, mode, seed=5, steps=compactions)
    _, mask, _ = end_at_first_eos(eager.completion_ids.clone(), config)
    assert compactions, "no row finished early: the test compares nothing compacted"
    assert torch.equal(other.completion_ids, eager.completion_ids)
    live = mask.bool()  # log-probs past a row's EOS are not read (the completion mask drops them)
    # compact: the same kernels on fewer rows; a matmul's blocking may depend on its row count, so the last bits
    # of float32 may move (measured here: at most 9.5e-7 = 2 ulps of |log p| in [4, 8)). graphs: attention also
    # sums over the masked columns (4.8e-7 measured). The tokens, drawn from those log-probs, are equal.
    torch.testing.assert_close(other.logps[live], eager.logps[live], rtol=0, atol=1e-5)
    torch.testing.assert_close(other.entropy[live], eager.entropy[live], rtol=0, atol=1e-5)
    other_seed = decode(model, prompts, config, mode, seed=6)
    assert not torch.equal(other_seed.completion_ids, eager.completion_ids)  # the seed matters: a real draw


def test_compaction_shrinks_to_buckets_in_place_and_keeps_layer_outputs(tokenizer):
    """Compaction happens as rows end, lands on buckets, and moves rows inside the caches allocated once (their
    storage never changes); every layer's output still lands at its original row (the replay's input)."""
    model = model_of_kind("qwen2.5-0.5b", tokenizer)
    prompts = varied_prompts(tokenizer)
    config = early_eos_config(tokenizer, model, prompts)
    B, S = prompts.ids.shape
    T = max_new_tokens(config, S)
    layers, E = model.config.num_hidden_layers, model.config.hidden_size
    buffers = {mode: torch.zeros(B, layers, S + T, E) for mode in ("eager", "compact")}
    eager = decode(model, prompts, config, "eager", outputs=buffers["eager"])
    steps = []
    compact = decode(model, prompts, config, "compact", outputs=buffers["compact"], steps=steps)
    assert torch.equal(compact.completion_ids, eager.completion_ids)
    sizes = [n for _, n, _ in steps]
    assert sizes and all(n in static.buckets(B) for n in sizes) and sizes == sorted(sizes, reverse=True)
    assert len({tuple(pointers) for *_, pointers in steps}) == 1  # the same cache storage at every compaction
    _, mask, _ = end_at_first_eos(eager.completion_ids.clone(), config)
    columns = torch.cat([prompts.mask.bool(), mask.bool()], 1)  # [B, S + T'] real tokens
    # Columns up to each row's EOS hold that row's layer outputs on both paths (the last one: the EOS itself
    # is not fed back, so its column is never written by either path).
    T_ = eager.completion_ids.shape[1]
    written = columns.clone()
    written[torch.arange(B), S + mask.sum(1).clamp(max=T_) - 1] = False
    written[:, S + T_ - 1:] = False
    lhs = buffers["compact"][:, :, :S + T_].transpose(1, 2)[written[:, :S + T_]]
    rhs = buffers["eager"][:, :, :S + T_].transpose(1, 2)[written[:, :S + T_]]
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-5)  # as above: row-count blocking, last bits


def test_graphs_mode_reads_no_unwritten_cache_column(tokenizer, monkeypatch):
    """The static step attends over every cache column, later ones masked; the cache is allocated uninitialised.
    Filled with NaN here (what uninitialised device memory may hold), the tokens must still equal generate's."""
    from grpo_trainer.rollout.fast import decoder as decoder_module

    init = decoder_module.Decoder.__init__

    def poisoned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for cache in (*self.keys, *self.values):
            cache.fill_(float("nan"))

    model = model_of_kind("qwen2.5-0.5b", tokenizer)
    prompts = varied_prompts(tokenizer)
    config = early_eos_config(tokenizer, model, prompts)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    monkeypatch.setattr(decoder_module.Decoder, "__init__", poisoned)
    assert_same_rollout(FastBackend(cpu="graphs").generate(model, prompts, config), reference)
