"""The fast backend's decoder gives `model.generate`'s tokens (greedy), for every supported family and weight layout,
falls back to `generate` for what it does not reproduce, and its parts equal the torch functions they replace.
Speed is measured by benchmarks/, never here."""

import pytest
import torch

from grpo_trainer.rollout.fast import backend as fast_backend
from grpo_trainer.rollout.fast import decoder as decoder_module
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import (
    MAX_NEW,
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    model_of_kind,
)


@pytest.mark.parametrize("layout", ["fused", "unfused"])
@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama3", "qwen3", "mistral", "qwen2.5-0.5b"])
def test_greedy_tokens_equal_generate(tokenizer, kind, layout, monkeypatch):
    """`fused`: the tiny models' own layout (q|k|v and gate|up as one matmul each). `unfused`: the layout of models
    over FUSE_MAX_PARAMETERS (every real checkpoint from 0.5B up): each projection on its own weight, no copies, and
    a large CPU head streamed as `W @ h.T`."""
    if layout == "unfused":
        monkeypatch.setattr(decoder_module, "FUSE_MAX_PARAMETERS", 0)
        monkeypatch.setattr(decoder_module, "STREAMED_HEAD_MIN_ELEMENTS", 0)
    model = model_of_kind(kind, tokenizer)
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer)
    assert fast_path_blocker(model, config, prompts.ids.shape[1]) is None
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    decoded = []
    rollout = fast_backend._fast_rollout
    monkeypatch.setattr(fast_backend, "_fast_rollout", lambda *args: decoded.append(1) or rollout(*args))
    assert_same_rollout(fast_rollout(model, prompts, config), reference)
    assert decoded == [1]  # the hand-written decoder served it, not the model-forward tier
    assert reference.completion_ids.shape[1] == MAX_NEW  # nothing ended early: every position compared


def test_decode_step_norm_and_linear_equal_torch_functional():
    """The decode step's own RMSNorm (mean square as one addmv) and linear (addmm on a transposed view made once)
    give `F.rms_norm`'s and `F.linear`'s values; a width that is not a power of two makes 1/E inexact, which may
    only cost rounding. Other dtypes, and a float32 weight over bfloat16 states, take `F.rms_norm` itself."""
    torch.manual_seed(0)
    for width in (128, 96):
        x, weight = torch.randn(8, width) * 3, torch.randn(width)
        expected = torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)
        norm = decoder_module._row_rms_norm(weight, 1e-6, torch.float32)
        torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
        # eps is inside the square root: for a row of zeros the result is 0, not nan; for tiny rows eps dominates
        tiny = torch.cat([torch.zeros(1, width), torch.full((1, width), 1e-4)])
        torch.testing.assert_close(norm(tiny),
                                   torch.nn.functional.rms_norm(tiny, (width,), weight, 1e-6), atol=1e-7, rtol=1e-6)
    x16, w16 = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(decoder_module._row_rms_norm(w16, 1e-5, torch.bfloat16)(x16),
                       torch.nn.functional.rms_norm(x16, (64,), w16, 1e-5))
    w32 = w16.float()  # a norm kept in float32 over bfloat16 hidden states (as some quantised models keep them)
    assert torch.equal(decoder_module._row_rms_norm(w32, 1e-5, torch.bfloat16)(x16),
                       torch.nn.functional.rms_norm(x16, (64,), w32, 1e-5))
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(8, 32)
    assert torch.equal(decoder_module._linear(weight, bias)(x), torch.nn.functional.linear(x, weight, bias))
    assert torch.equal(decoder_module._linear(weight, None)(x), torch.nn.functional.linear(x, weight))



def test_rows_stop_at_eos_and_the_loop_stops_when_every_row_has(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer)
    with torch.no_grad():
        free = generate_rollout(model, prompts, greedy_config(tokenizer))
    # Make the greedy token at step 3 of every row an EOS token: every row now ends by step 3 (some earlier, where
    # that token already occurs), so both paths must stop after at most 4 tokens, with the same masks.
    config = greedy_config(tokenizer, eos_token_id=sorted(set(free.completion_ids[:, 3].tolist())))
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    fast = fast_rollout(model, prompts, config)
    assert_same_rollout(fast, reference)
    assert fast.completion_ids.shape[1] <= 4 and not fast.is_truncated.any()


@pytest.mark.parametrize("fused", [True, False])
def test_lora_adapter_is_merged_exactly_and_disabling_it_gives_the_base_model(tokenizer, fused, monkeypatch):
    """Fused (small models): adapters merged into the fused weights. Unfused: the LoRA layers' own forward."""
    from peft import LoraConfig, get_peft_model

    if not fused:
        monkeypatch.setattr(decoder_module, "FUSE_MAX_PARAMETERS", 0)

    model = get_peft_model(model_of_kind("qwen2", tokenizer), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,  # random B: the adapter changes outputs
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer)
    with torch.no_grad():
        adapted = generate_rollout(model, prompts, config)
        with model.disable_adapter():
            base = generate_rollout(model, prompts, config)
            assert_same_rollout(fast_rollout(model, prompts, config), base)
    assert_same_rollout(fast_rollout(model, prompts, config), adapted)
    assert not torch.equal(adapted.completion_ids, base.completion_ids)  # the test can tell the two apart


def test_decoder_logits_equal_a_full_forward_at_every_step(tokenizer):
    """Numerics independent of argmax ties: feed a fixed completion through the cache-based decoder one token at
    a time and compare every step's logits with one full forward of prompt + completion."""
    model = model_of_kind("qwen3", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=1)
    ids, mask = prompts.ids, prompts.mask  # [3, S]
    B, S = ids.shape
    completion = torch.randint(10, 90, (B, 5), generator=torch.Generator().manual_seed(0))
    full_mask = torch.cat([mask, torch.ones_like(completion)], 1)
    with torch.no_grad():
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)
        expected = model(input_ids=torch.cat([ids, completion], 1), attention_mask=full_mask,
                         position_ids=positions).logits[:, S - 1:-1]  # [B, 5, V]
    with torch.inference_mode():
        decoder = decoder_module.Decoder(model, B, S + 5)
        allowed = (torch.ones(S, S, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]) | torch.eye(S).bool()
        cos, sin = decoder.rotation_tables(positions[:, :S + 5])
        steps = [decoder.logits(decoder.forward(ids, 0, cos[:, :S], sin[:, :S], allowed))]
        key_mask = full_mask.bool()[:, None, None, :]
        for t in range(4):
            column = S + t
            hidden = decoder.forward(completion[:, t:t + 1], column, cos[:, column:column + 1],
                                     sin[:, column:column + 1], key_mask[..., :column + 1])
            steps.append(decoder.logits(hidden))
    torch.testing.assert_close(torch.stack(steps, 1), expected, atol=1e-5, rtol=0)


def test_cpu_decode_of_a_small_model_runs_single_threaded_and_restores_the_thread_count(tokenizer, tiny_model,
                                                                                       monkeypatch):
    seen = []
    decode = fast_backend._decode
    monkeypatch.setattr(fast_backend, "_decode", lambda *a: seen.append(torch.get_num_threads()) or decode(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = grouped_prompts(tokenizer)
        fast_rollout(tiny_model, prompts, greedy_config(tokenizer))
        assert seen[-1] == 1 and torch.get_num_threads() == 2  # the rollout's (after the first use's self-check)
    finally:
        torch.set_num_threads(before)



def test_what_the_fast_path_does_not_reproduce_falls_back_to_generate(tokenizer, tiny_model, monkeypatch):
    prompts = grouped_prompts(tokenizer)
    beams = greedy_config(tokenizer, num_beams=2)
    assert "beam_search" in fast_path_blocker(tiny_model, beams, prompts.ids.shape[1])
    calls = []
    reference = generate_rollout
    monkeypatch.setattr(fast_backend, "generate_rollout", lambda *a: calls.append(a[-1]) or reference(*a))
    fast_rollout(tiny_model, prompts, beams)
    assert calls == [beams]
    monkeypatch.undo()
    timed = greedy_config(tokenizer, max_time=10.0)
    assert "max_time" in fast_path_blocker(tiny_model, timed, prompts.ids.shape[1])
    gpt2 = model_of_kind("gpt2", tokenizer).eval()  # GPT-2 has dropout 0.1
    assert "gpt2" in fast_path_blocker(gpt2, greedy_config(tokenizer), prompts.ids.shape[1])
    with torch.no_grad():
        assert_same_rollout(fast_rollout(gpt2, prompts, greedy_config(tokenizer)),
                             generate_rollout(gpt2, prompts, greedy_config(tokenizer)))
    tiny_model.config.attention_dropout = 0.1
    assert "dropout" in fast_path_blocker(tiny_model.train(), greedy_config(tokenizer), prompts.ids.shape[1])
    assert fast_path_blocker(tiny_model.eval(), greedy_config(tokenizer), prompts.ids.shape[1]) is None


def test_one_token_prompts_shared_by_their_groups_equal_generate(tokenizer):
    """A one-token prompt is prefilled through the single-column path. With P distinct prompts for B > P rows, that
    path must fill only the P prefill rows of the cache; it used to take every cache row and fail reshaping B rows
    into P ("shape '[2, 64]' is invalid for input of size 384")."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = tokenize_prompts(tokenizer, ["c"] * 3 + ["d"] * 3, None)
    assert prompts.ids.shape == (6, 1)
    config = greedy_config(tokenizer)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    assert_same_rollout(fast_rollout(model, prompts, config), reference)
