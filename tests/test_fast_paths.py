"""The fast paths give the plain paths' results (tokens, log-probs, losses, gradients); speed is measured by
benchmarks/bench_vs_trl.py, never here.

- `decoding.sample` (shared prefill, preallocated KV cache, own decode loop) against `model.generate`.
- `logprobs._HeadLogProbs` (hand-written backward) against autograd through `token_logprobs`.
"""

import contextlib
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen3Config
from transformers.generation import LogitsProcessorList

from grpo_trainer import GRPOConfig, GRPOTrainer, buffer, decoding, generation
from grpo_trainer.logprobs import _HeadLogProbs, token_logprobs
from grpo_trainer.tiny import copy_digits_reward, make_tiny_model

MAX_NEW = 12


def _model(kind: str, tokenizer):
    """A tiny randomly initialised model of each supported family (seeded)."""
    if kind == "qwen2":
        return make_tiny_model(tokenizer, seed=1)
    common = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = {"llama": lambda: LlamaConfig(**common, attention_bias=True),  # biased q/k/v/o
              "qwen3": lambda: Qwen3Config(**common, head_dim=24),  # q/k RMSNorm, head_dim != hidden / heads
              "mistral": lambda: MistralConfig(**common, sliding_window=4096),  # a window longer than any test
              # Llama 3.x: frequency-dependent rotary scaling, untied LM head, no biases.
              "llama3": lambda: LlamaConfig(**common, rope_scaling={
                  "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}),
              "gpt2": lambda: GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)}[kind]()
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _prompts(tokenizer, repeats: int = 2):
    """Three prompts of different lengths (left padding differs per row), each repeated as a GRPO group."""
    texts = [t for t in ["copy 123:", "copy 98765:", "c"] for _ in range(repeats)]
    return generation.tokenize_prompts(tokenizer, texts, None)


def _config(tokenizer, **overrides) -> GenerationConfig:
    settings = {"do_sample": False, "max_new_tokens": MAX_NEW, "eos_token_id": [tokenizer.eos_token_id],
                "pad_token_id": tokenizer.pad_token_id, "disable_compile": True}
    return GenerationConfig(**{**settings, **overrides})


def _assert_same_rollout(fast: generation.Rollout, reference: generation.Rollout) -> None:
    assert torch.equal(fast.completion_ids, reference.completion_ids)
    assert torch.equal(fast.completion_mask, reference.completion_mask)
    assert torch.equal(fast.is_truncated, reference.is_truncated)


# ------------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("layout", ["fused", "packed", "unfused"])
@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama3", "qwen3", "mistral"])
def test_greedy_tokens_equal_generate(tokenizer, kind, layout, monkeypatch):
    """`fused`: the tiny models' own layout (q|k|v and gate|up as one matmul each). `packed`: every projection
    and the LM head run as oneDNN linears on packed weights (large weights do; the tiny test models have none
    that large). `unfused`: the layout of models over FUSE_MAX_PARAMETERS (every real checkpoint from 0.5B up):
    each projection on its own weight, no copies, and a large CPU head streamed as `W @ h.T`."""
    if layout == "unfused":
        monkeypatch.setattr(decoding, "FUSE_MAX_PARAMETERS", 0)
        monkeypatch.setattr(decoding, "STREAMED_HEAD_MIN_ELEMENTS", 0)
    if layout == "packed":
        monkeypatch.setattr(decoding, "PACK_MIN_ELEMENTS", 0)
        if decoding._packed_linear(torch.ones(4, 4), None, 2) is None:
            pytest.skip("this torch build has no oneDNN packed linear (the decoder uses F.linear)")
    model = _model(kind, tokenizer)
    ids, mask = _prompts(tokenizer)
    config = _config(tokenizer)
    assert decoding.fast_path_blocker(model, config, ids.shape[1]) is None
    with torch.no_grad():
        reference = generation.sample(model, ids, mask, config)
    _assert_same_rollout(decoding.sample(model, ids, mask, config), reference)
    assert reference.completion_ids.shape[1] == MAX_NEW  # nothing ended early: every position compared


def test_packed_linear_equals_f_linear():
    """The oneDNN linear on a packed weight gives F.linear's values for any row count and leading shape; small
    weights, other dtypes and `rows=None` are left to F.linear."""
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 512) * 0.02, torch.randn(1024)
    linear = decoding._packed_linear(weight, bias, rows=8)
    if linear is None:
        pytest.skip("this torch build has no oneDNN packed linear (the decoder uses F.linear)")
    for shape in [(8, 512), (3, 512), (2, 14, 512)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert decoding._packed_linear(torch.randn(64, 64), None, rows=8) is None  # below PACK_MIN_ELEMENTS
    assert decoding._packed_linear(weight.double(), None, rows=8) is None
    assert decoding._packed_linear(weight, None, rows=None) is None


def test_decode_step_norm_and_linear_equal_torch_functional():
    """The decode step's own RMSNorm (mean square as one addmv) and linear (addmm on a transposed view made once)
    give `F.rms_norm`'s and `F.linear`'s values; a width that is not a power of two makes 1/E inexact, which may
    only cost rounding. Other dtypes, and a float32 weight over bfloat16 states, take `F.rms_norm` itself."""
    torch.manual_seed(0)
    for width in (128, 96):
        x, weight = torch.randn(8, width) * 3, torch.randn(width)
        expected = torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)
        norm = decoding._row_rms_norm(weight, 1e-6, torch.float32)
        torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
        # eps is inside the square root: for a row of zeros the result is 0, not nan; for tiny rows eps dominates
        tiny = torch.cat([torch.zeros(1, width), torch.full((1, width), 1e-4)])
        torch.testing.assert_close(norm(tiny),
                                   torch.nn.functional.rms_norm(tiny, (width,), weight, 1e-6), atol=1e-7, rtol=1e-6)
    x16, w16 = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(decoding._row_rms_norm(w16, 1e-5, torch.bfloat16)(x16),
                       torch.nn.functional.rms_norm(x16, (64,), w16, 1e-5))
    w32 = w16.float()  # a norm kept in float32 over bfloat16 hidden states (as some quantised models keep them)
    assert torch.equal(decoding._row_rms_norm(w32, 1e-5, torch.bfloat16)(x16),
                       torch.nn.functional.rms_norm(x16, (64,), w32, 1e-5))
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(8, 32)
    assert torch.equal(decoding._linear(weight, bias, rows=None)(x), torch.nn.functional.linear(x, weight, bias))
    assert torch.equal(decoding._linear(weight, None, rows=None)(x), torch.nn.functional.linear(x, weight))


def test_rows_stop_at_eos_and_the_loop_stops_when_every_row_has(tokenizer):
    model = _model("qwen2", tokenizer)
    ids, mask = _prompts(tokenizer)
    with torch.no_grad():
        free = generation.sample(model, ids, mask, _config(tokenizer))
    # Make the greedy token at step 3 of every row an EOS token: every row now ends by step 3 (some earlier, where
    # that token already occurs), so both paths must stop after at most 4 tokens, with the same masks.
    config = _config(tokenizer, eos_token_id=sorted(set(free.completion_ids[:, 3].tolist())))
    with torch.no_grad():
        reference = generation.sample(model, ids, mask, config)
    fast = decoding.sample(model, ids, mask, config)
    _assert_same_rollout(fast, reference)
    assert fast.completion_ids.shape[1] <= 4 and not fast.is_truncated.any()


@pytest.mark.parametrize("fused", [True, False])
def test_lora_adapter_is_merged_exactly_and_disabling_it_gives_the_base_model(tokenizer, fused, monkeypatch):
    """Fused (small models): adapters merged into the fused weights. Unfused: the LoRA layers' own forward."""
    from peft import LoraConfig, get_peft_model

    if not fused:
        monkeypatch.setattr(decoding, "FUSE_MAX_PARAMETERS", 0)

    model = get_peft_model(_model("qwen2", tokenizer), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,  # random B: the adapter changes outputs
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ids, mask = _prompts(tokenizer)
    config = _config(tokenizer)
    with torch.no_grad():
        adapted = generation.sample(model, ids, mask, config)
        with model.disable_adapter():
            base = generation.sample(model, ids, mask, config)
            _assert_same_rollout(decoding.sample(model, ids, mask, config), base)
    _assert_same_rollout(decoding.sample(model, ids, mask, config), adapted)
    assert not torch.equal(adapted.completion_ids, base.completion_ids)  # the test can tell the two apart


def test_decoder_logits_equal_a_full_forward_at_every_step(tokenizer):
    """Numerics independent of argmax ties: feed a fixed completion through the cache-based decoder one token at
    a time and compare every step's logits with one full forward of prompt + completion."""
    model = _model("qwen3", tokenizer)
    ids, mask = _prompts(tokenizer, repeats=1)  # [3, S]
    B, S = ids.shape
    completion = torch.randint(10, 90, (B, 5), generator=torch.Generator().manual_seed(0))
    full_mask = torch.cat([mask, torch.ones_like(completion)], 1)
    with torch.no_grad():
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)
        expected = model(input_ids=torch.cat([ids, completion], 1), attention_mask=full_mask,
                         position_ids=positions).logits[:, S - 1:-1]  # [B, 5, V]
    with torch.inference_mode():
        decoder = decoding._Decoder(model, B, S + 5)
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


def test_sampling_draws_the_softmax_distribution():
    # probabilities [.5, .3, .15, .05, 0]; with N = 40000 draws the standard error of a frequency is at most
    # sqrt(.25 / 40000) = .0025, so 5 standard errors is .0125. The -inf token must never be drawn.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(40000, 5).contiguous()  # log 0 = -inf: a filtered token
    torch.manual_seed(0)
    draws = decoding.sample_from_logits(logits, do_sample=True)
    frequencies = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert frequencies[4] == 0
    torch.testing.assert_close(frequencies, probs, atol=0.0125, rtol=0)
    assert torch.equal(decoding.sample_from_logits(logits[:2], do_sample=False), torch.tensor([0, 0]))


def test_two_level_draw_across_blocks_keeps_the_distribution():
    """V = 10 spans blocks of 4 (two full blocks and a tail of 2). Probabilities: block 0 = [.1, 0, .2, 0],
    block 1 all 0 (never chosen), tail = [.3, .4]. Block masses .3, 0, .7; inside block 0 the shares are
    1/3, 0, 2/3, 0, so token 0 comes out with .3 x 1/3 = .1 and token 2 with .3 x 2/3 = .2: the categorical
    distribution. N = 40000 draws: 5 standard errors <= .0125."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.4])
    torch.manual_seed(0)
    draws = decoding.sample_from_probs(probs.expand(40000, 10).contiguous(), block=4, one_level_max=0)
    frequencies = torch.bincount(draws, minlength=10).float() / draws.numel()
    assert frequencies[probs == 0].sum() == 0
    torch.testing.assert_close(frequencies, probs, atol=0.0125, rtol=0)
    # one block (V <= block) is a single inversion
    one = decoding.sample_from_probs(torch.tensor([[0.0, 1.0, 0.0]]), block=4, one_level_max=0)
    assert torch.equal(one, torch.tensor([1]))


@pytest.mark.parametrize(("top_k", "expected"), [
    # temperature 0.5 squares the probabilities [.5, .3, .15, .05]: [.25, .09, .0225, .0025] / .365
    (0, [0.684932, 0.246575, 0.061644, 0.006849]),
    # top-k 2 then keeps the first two: [.25, .09] / .34
    (2, [0.735294, 0.264706, 0.0, 0.0]),
])
def test_choose_draws_the_processed_distribution_and_scores_the_full_one(top_k, expected):
    """Only a temperature: one softmax serves both the draw and the scores; with top-k, the draw uses
    transformers' processors. Either way the log-prob and entropy are the full tempered softmax's."""
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper

    N = 40000  # a frequency's standard error is at most sqrt(.25 / N) = .0025; 5 of them is .0125
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(N, 4).contiguous()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)] + ([TopKLogitsWarper(top_k)] if top_k else []))
    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=top_k)
    torch.manual_seed(0)
    tokens, logps, entropy = decoding._choose(logits, torch.zeros(N, 1, dtype=torch.long), processors, config, 0.5)
    frequencies = torch.bincount(tokens, minlength=4).float() / N
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.0125, rtol=0)
    full = torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365  # tempered, unfiltered
    torch.testing.assert_close(logps, full.log()[tokens], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.full((N,), float(-(full * full.log()).sum())), atol=1e-5, rtol=0)


def test_every_logits_processor_generate_builds_is_applied(tokenizer):
    """Settings resolved and processors built by transformers, run on the same sequences as in generate: greedy
    tokens stay identical under an n-gram ban, a repetition penalty and a minimum length."""
    model = _model("llama", tokenizer)
    ids, mask = _prompts(tokenizer)
    config = _config(tokenizer, no_repeat_ngram_size=2, repetition_penalty=1.5, min_new_tokens=3)
    assert decoding.fast_path_blocker(model, config, ids.shape[1]) is None
    with torch.no_grad():
        reference = generation.sample(model, ids, mask, config)
        plain = generation.sample(model, ids, mask, _config(tokenizer))
    _assert_same_rollout(decoding.sample(model, ids, mask, config), reference)
    assert not torch.equal(reference.completion_ids, plain.completion_ids)  # the processors changed the tokens


def test_top_k_one_sampling_is_greedy(tokenizer):
    model = _model("llama", tokenizer)
    ids, mask = _prompts(tokenizer)
    greedy = decoding.sample(model, ids, mask, _config(tokenizer))
    _assert_same_rollout(decoding.sample(model, ids, mask, _config(tokenizer, do_sample=True, top_k=1)), greedy)


def test_sampling_matches_generate_in_distribution(tokenizer):
    """Sampled tokens differ from generate's for a seed (different random stream), but the first token's
    frequencies over many rows of one prompt agree. This random model's tempered distribution is nearly uniform;
    transformers' default top_k=50 (the config leaves top_k unset) keeps 50 tokens, ~40 draws each in 2000 rows,
    so two samples differ by ~sqrt(2 * 40) ~ 9 counts per token: a total-variation distance of ~0.09. Without the
    top-k filter (or with a wrong distribution) it would be ~0.44."""
    model = _model("qwen2", tokenizer)
    ids, mask = generation.tokenize_prompts(tokenizer, ["copy 12:"] * 2000, None)
    config = _config(tokenizer, do_sample=True, max_new_tokens=1, temperature=0.8, top_k=None)
    torch.manual_seed(0)
    with torch.no_grad():
        reference = generation.sample(model, ids, mask, config).completion_ids[:, 0]
    fast = decoding.sample(model, ids, mask, config).completion_ids[:, 0]
    V = len(tokenizer)
    distance = 0.5 * (torch.bincount(fast, minlength=V) - torch.bincount(reference, minlength=V)).abs().sum() / 2000
    assert distance < 0.15
    assert len(torch.unique(fast)) <= 50


def test_what_the_fast_path_does_not_reproduce_falls_back_to_generate(tokenizer, tiny_model, monkeypatch):
    ids, mask = _prompts(tokenizer)
    beams = _config(tokenizer, num_beams=2)
    assert "beam_search" in decoding.fast_path_blocker(tiny_model, beams, ids.shape[1])
    calls = []
    reference_sample = generation.sample
    monkeypatch.setattr(generation, "sample", lambda *a: calls.append(a[-1]) or reference_sample(*a))
    decoding.sample(tiny_model, ids, mask, beams)
    assert calls == [beams]
    monkeypatch.undo()
    assert "max_time" in decoding.fast_path_blocker(tiny_model, _config(tokenizer, max_time=10.0), ids.shape[1])
    gpt2 = _model("gpt2", tokenizer).eval()  # GPT-2 has dropout 0.1
    assert "gpt2" in decoding.fast_path_blocker(gpt2, _config(tokenizer), ids.shape[1])
    with torch.no_grad():
        _assert_same_rollout(decoding.sample(gpt2, ids, mask, _config(tokenizer)),
                             generation.sample(gpt2, ids, mask, _config(tokenizer)))
    tiny_model.config.attention_dropout = 0.1
    assert "dropout" in decoding.fast_path_blocker(tiny_model.train(), _config(tokenizer), ids.shape[1])
    assert decoding.fast_path_blocker(tiny_model.eval(), _config(tokenizer), ids.shape[1]) is None


def test_generation_backend_is_validated_and_dispatched(tmp_path, tiny_model, tokenizer, toy_dataset, monkeypatch):
    with pytest.raises(ValueError, match="generation_backend must be 'fast' or 'generate'"):
        GRPOConfig(output_dir=str(tmp_path), generation_backend="vllm")
    calls = []
    monkeypatch.setitem(decoding.GENERATION_BACKENDS, "generate",
                        lambda *a: calls.append(1) or generation.sample(*a))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to="none", save_strategy="no",
                      generation_backend="generate")
    GRPOTrainer(tiny_model, copy_digits_reward, args=args, train_dataset=toy_dataset,
                processing_class=tokenizer).train()
    assert calls == [1]


# ------------------------------------------------------------------------------------------------ log-probs


@pytest.mark.parametrize(("temperature", "chunk_size", "bias", "train_head"),
                         [(1.0, 4, False, True), (0.7, 3, True, True), (1.3, 100, True, False)])
def test_head_function_equals_autograd_through_token_logprobs(temperature, chunk_size, bias, train_head):
    generator = torch.Generator().manual_seed(0)
    N, E, V = 10, 8, 33
    hidden = torch.randn(N, E, generator=generator, requires_grad=True)
    weight = torch.randn(V, E, generator=generator).requires_grad_(train_head)  # frozen head = LoRA training
    b = torch.randn(V, generator=generator, requires_grad=True) if bias else None
    tokens = torch.randint(0, V, (N,), generator=generator)
    upstream = torch.randn(N, generator=generator)  # a generic downstream loss sum(upstream * logp)

    logps, entropy = _HeadLogProbs.apply(hidden, weight, b, tokens, temperature, chunk_size, True)
    grads = torch.autograd.grad((logps * upstream).sum(), [t for t in (hidden, weight, b) if t is not None
                                                            and t.requires_grad])
    logits = torch.nn.functional.linear(hidden, weight, b)
    expected, expected_entropy = token_logprobs(logits, tokens, temperature)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [t for t in (hidden, weight, b)
                                                                       if t is not None and t.requires_grad])
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=0)
    assert not entropy.requires_grad
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Known values (the rollout's, on-policy), with and without the softmax itself: same values and gradients.
    probs = torch.softmax(logits.detach() / temperature, dim=-1)
    for known_probs in (None, probs):
        known = (expected.detach(), expected_entropy.detach(), known_probs)
        logps, entropy = _HeadLogProbs.apply(hidden, weight, b, tokens, temperature, chunk_size, True, known)
        grads = torch.autograd.grad((logps * upstream).sum(), [t for t in (hidden, weight, b) if t is not None
                                                                and t.requires_grad])
        torch.testing.assert_close(logps, expected, atol=0, rtol=0)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # hand check of one row's entropy: uniform logits over V tokens have entropy ln V.
    flat, _ = _HeadLogProbs.apply(torch.zeros(1, E), weight.detach(), None, tokens[:1], 1.0, 4, False)
    torch.testing.assert_close(flat, torch.tensor([-math.log(V)]))


# --------------------------------------------------------------------------- rollout log-probs in the loss


def test_sampling_logps_are_the_training_forwards_values(tokenizer):
    """The sampler keeps log softmax(logits / T)[token] of the full distribution (not the top-k-filtered one
    it drew from), which is what the training forward computes for the same tokens."""
    from grpo_trainer.logprobs import completion_logprobs

    model = _model("qwen2", tokenizer)
    ids, mask = _prompts(tokenizer)
    torch.manual_seed(0)
    rollout = decoding.sample(model, ids, mask, _config(tokenizer, do_sample=True, temperature=0.7, top_k=5))
    with torch.no_grad():
        logps, entropy = completion_logprobs(
            model, torch.cat([ids, rollout.completion_ids], 1), torch.cat([mask, rollout.completion_mask], 1),
            rollout.completion_ids.shape[1], temperature=0.7, with_entropy=True)
    active = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logps[active], logps[active], atol=1e-5, rtol=0)
    torch.testing.assert_close(rollout.sampling_entropy[active], entropy[active], atol=1e-5, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradients_with_rollout_logps_equal_a_full_forward(tmp_path, tokenizer, toy_dataset, beta):
    """On-policy, compute_loss with the sampler's log-probs (the forward skips the LM head) gives the loss, the
    metrics and the gradients of the plain forward."""
    model = make_tiny_model(tokenizer, seed=2)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, beta=beta, report_to="none", save_strategy="no", temperature=0.9)
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer)
    batch = [toy_dataset[i // 4] for i in range(8)]
    round_ = trainer._generate_and_score(batch, "train")
    assert round_.get("sampling_logps") is not None

    def loss_and_grads(inputs):
        model.zero_grad()
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}, \
            [p.grad.clone() for p in model.parameters()]

    if beta:  # the reference log-probs are the reference model's, whatever the round carries
        with torch.no_grad():
            reference = trainer._batched_logps(trainer.ref_model, {k: v for k, v in round_.items()
                                                                    if not k.startswith("sampling_")})
        torch.testing.assert_close(round_["ref_logps"], reference, atol=0, rtol=0)
    fast = loss_and_grads(round_)
    plain = loss_and_grads({k: v for k, v in round_.items() if not k.startswith("sampling_")})
    torch.testing.assert_close(fast[0], plain[0], atol=1e-6, rtol=0)
    assert fast[1].keys() == plain[1].keys()
    for key in fast[1]:
        assert fast[1][key] == pytest.approx(plain[1][key], abs=1e-5), key
    for got, want in zip(fast[2], plain[2]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_off_policy_rounds_take_the_rollout_logps_as_old_logps(tmp_path, tokenizer, toy_dataset):
    model = make_tiny_model(tokenizer, seed=2)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, num_iterations=2, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    # The losses after the first optimizer step must recompute the current log-probs: no sampling values left.
    assert "sampling_logps" not in round_ and round_["old_logps"] is not None
    with torch.no_grad():
        recomputed = trainer._batched_logps(model, round_)
    active = round_["completion_mask"].bool()
    torch.testing.assert_close(round_["old_logps"][active], recomputed[active], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- zero-advantage rows


@pytest.mark.parametrize(("loss_type", "num_iterations"), [("dapo", 1), ("grpo", 1), ("bnpo", 2), ("dr_grpo", 2)])
def test_zero_advantage_rows_skip_the_forward_with_the_same_loss_and_gradients(tmp_path, tokenizer, toy_dataset,
                                                                               monkeypatch, loss_type,
                                                                               num_iterations):
    """beta = 0: a completion with advantage exactly 0 adds nothing to the loss or its gradient, so only the
    other rows run forward; they still count in every normaliser (grpo's 1/B, bnpo's tokens, dr_grpo's B * T,
    dapo's window). With num_iterations = 2 the round carries old log-probs, used as the skipped rows' values."""
    model = make_tiny_model(tokenizer, seed=3)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, loss_type=loss_type, num_iterations=num_iterations,
                      report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    round_["advantages"] = torch.tensor([0.5, 0.0, 0.0, -1.0, 0.25, 0.0, 1.5, -0.75])
    rows_seen = []
    model.register_forward_pre_hook(lambda module, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)

    def loss_and_grads():
        model.zero_grad()
        loss = trainer.compute_loss(model, round_)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    skipped = loss_and_grads()
    assert rows_seen == [5]  # the three zero-advantage rows never ran
    monkeypatch.setattr(trainer, "_policy_logps", lambda m, inputs, mode: (
        *trainer._logps(m, inputs, with_entropy=True, policy=True)[:3],
        buffer.trim_padding(inputs)[3]))
    plain = loss_and_grads()
    assert rows_seen == [5, 8]
    torch.testing.assert_close(skipped[0], plain[0], atol=1e-7, rtol=1e-6)
    for got, want in zip(skipped[1], plain[1]):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in skipped[1])


def test_zero_advantage_rows_are_not_skipped_with_a_kl_term(tmp_path, tokenizer, toy_dataset):
    model = make_tiny_model(tokenizer, seed=3)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, beta=0.1, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=toy_dataset, processing_class=tokenizer)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    round_["advantages"] = torch.zeros(8)  # the KL term still has a gradient on every row
    rows_seen = []
    model.register_forward_pre_hook(lambda module, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)
    trainer.compute_loss(model, round_)
    assert rows_seen == [8]


def test_cpu_decode_of_a_small_model_runs_single_threaded_and_restores_the_thread_count(tokenizer, tiny_model,
                                                                                       monkeypatch):
    seen = []
    decode = decoding._decode
    monkeypatch.setattr(decoding, "_decode", lambda *a: seen.append(torch.get_num_threads()) or decode(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids, mask = _prompts(tokenizer)
        decoding.sample(tiny_model, ids, mask, _config(tokenizer))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------- replay


def _count_layer_runs(model, monkeypatch) -> list[int]:
    """Counts calls of every decoder layer's MLP: one per layer per forward or backward recompute."""
    runs = [0]
    for layer in model.get_decoder().layers:
        original = layer.mlp.forward

        def counted(*args, _original=original, **kwargs):
            runs[0] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(layer.mlp, "forward", counted)
    return runs


@pytest.mark.parametrize("kind", ["qwen2", "llama", "lora"])
def test_replayed_layer_outputs_give_the_checkpointed_forwards_gradients(tokenizer, kind, monkeypatch):
    """The rollout's layer outputs stand in for the checkpointed forward's first pass: the loss's gradients are
    those of the plain checkpointed forward (prompts of three lengths, so left padding differs per row; sampled
    completions that end at different lengths), and each layer runs once (the backward's recompute), not twice."""
    from grpo_trainer import replay
    from grpo_trainer.logprobs import completion_logprobs

    model = _model("llama" if kind == "llama" else "qwen2", tokenizer)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 init_lora_weights=False))
        model.enable_input_require_grads()
    lm = model.get_base_model() if kind == "lora" else model
    lm.activation_checkpointing_enable()
    model.train()
    checkpoints = [layer._gradient_checkpointing_func for layer in lm.get_decoder().layers]
    ids, mask = _prompts(tokenizer)
    torch.manual_seed(3)
    rollout = decoding.sample(model, ids, mask, _config(tokenizer, do_sample=True, max_new_tokens=10),
                              keep_layer_outputs=True)
    B, T = rollout.completion_ids.shape
    assert rollout.layer_outputs.shape == (B, len(lm.get_decoder().layers), ids.shape[1] + T, 64)
    assert 1 < int(rollout.completion_mask.sum(1).min()) < T  # rows end at different lengths
    weights = torch.randn(B, T) * rollout.completion_mask  # any loss that reads only completion tokens
    input_ids = torch.cat([ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([mask, rollout.completion_mask], 1)
    runs = _count_layer_runs(lm, monkeypatch)

    def grads(replayed: bool):
        model.zero_grad()
        runs[0] = 0
        context = replay.replayed_layers(lm.get_decoder().layers, rollout.layer_outputs) if replayed \
            else contextlib.nullcontext()
        with context:
            logps, _ = completion_logprobs(model, input_ids, attention_mask, T, known_logps=rollout.sampling_logps)
        (logps * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, runs[0]

    plain, plain_runs = grads(False)
    replayed, replayed_runs = grads(True)
    layers = len(lm.get_decoder().layers)
    assert (plain_runs, replayed_runs) == (2 * layers, layers)
    assert [layer._gradient_checkpointing_func for layer in lm.get_decoder().layers] == checkpoints  # restored
    assert plain.keys() == replayed.keys() and any("lora" in n for n in plain) == (kind == "lora")
    for name in plain:
        torch.testing.assert_close(replayed[name], plain[name], atol=2e-5, rtol=1e-4, msg=name)


def _checkpointing_trainer(tmp_path, tokenizer, toy_dataset, **overrides):
    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_generations": 4,
                "max_completion_length": 8, "report_to": "none", "save_strategy": "no", "temperature": 1.3}
    args = GRPOConfig(**{**settings, **overrides})
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward, args=args,
                          train_dataset=toy_dataset, processing_class=tokenizer)
    trainer.model.activation_checkpointing_enable()  # what Trainer.train does first
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trainer_micro_batches_replay_their_rows_and_columns_with_the_plain_gradients(tmp_path, tokenizer,
                                                                                      toy_dataset, beta,
                                                                                      monkeypatch):
    """A round cut into micro-batches of rows with different prompt and completion lengths: each micro-batch's
    slice of the layer outputs and of the sampling distributions (rows, then `trim_padding`'s columns) gives the
    loss and gradients of the plain forward."""
    trainer = _checkpointing_trainer(tmp_path, tokenizer, toy_dataset, beta=beta, gradient_accumulation_steps=2,
                                     per_device_train_batch_size=4)
    batch = [toy_dataset[i // 4] for i in range(8)]
    batch[4:] = [{**toy_dataset[0], "prompt": "c 1:"}] * 4  # a shorter prompt: its micro-batch trims left columns
    torch.manual_seed(0)
    round_ = trainer._generate_and_score(batch, "train")
    T = round_["completion_ids"].shape[1]
    assert round_["layer_outputs"].shape[:2] == (8, 2) and round_["sampling_probs"].shape == (8, T, len(tokenizer))
    model = trainer.model

    def loss_and_grads(inputs):
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    runs = _count_layer_runs(model, monkeypatch)
    for rows in (slice(0, 4), slice(4, 8), torch.tensor([1, 6, 2, 5])):
        inputs = buffer.select_rows(round_, rows)
        assert (buffer.kept_columns(inputs)[0] > 0) == (rows == slice(4, 8))
        runs[0] = 0
        replayed = loss_and_grads(inputs)
        assert runs[0] == 2  # 2 layers, each run once (the backward's recompute)
        plain = loss_and_grads({k: v for k, v in inputs.items() if k not in ("layer_outputs", "sampling_probs")})
        torch.testing.assert_close(replayed[0], plain[0], atol=1e-6, rtol=0)
        for got, want in zip(replayed[1], plain[1]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("overrides", "keeps"), [
    ({}, ("layer_outputs", "sampling_probs")),
    ({"num_iterations": 2}, ()),  # the second pass over the round runs after an optimizer step
    ({"generation_backend": "generate"}, ()),  # generate keeps none of them
    ({"gradient_checkpointing": False}, ("sampling_probs",)),  # no checkpointed forward to stand in for
    ({"temperature": 1.0, "generation_kwargs": {"temperature": 0.5}}, ("layer_outputs",)),  # not the loss's softmax
])
def test_the_rollout_keeps_what_can_be_replayed(tmp_path, tokenizer, toy_dataset, overrides, keeps):
    trainer = _checkpointing_trainer(tmp_path, tokenizer, toy_dataset, **overrides)
    if overrides.get("gradient_checkpointing") is False:
        trainer.model.activation_checkpointing_disable()
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    assert tuple(k for k in ("layer_outputs", "sampling_probs") if k in round_) == keeps
    evaluation = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "eval")
    assert "layer_outputs" not in evaluation and "sampling_probs" not in evaluation


@pytest.mark.parametrize(("cap", "keeps"), [
    # 8 rows x 2 layers x (prompt + 8 new tokens) x 64 floats is over 8 x 2 x 8 x 64 x 4 bytes; the sampling
    # distributions, 8 rows x 8 tokens x V floats, fit that alone.
    (8 * 2 * 8 * 64 * 4, ("sampling_probs",)),
    (8 * 8 * 4, ()),  # under 8 x 8 x V floats: neither
])
def test_replay_tensors_over_the_memory_cap_are_not_kept(tmp_path, tokenizer, toy_dataset, monkeypatch, cap, keeps):
    from grpo_trainer import replay

    trainer = _checkpointing_trainer(tmp_path, tokenizer, toy_dataset)
    monkeypatch.setattr(replay, "REPLAY_MAX_BYTES", cap)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    assert tuple(k for k in ("layer_outputs", "sampling_probs") if k in round_) == keeps


def test_training_replays_the_rollout_and_learns(tmp_path, tokenizer, toy_dataset, monkeypatch):
    """A real run with the defaults (activation checkpointing on, on-policy): every loss forward replays."""
    from grpo_trainer import replay

    calls = []
    original = replay.replayed_layers
    monkeypatch.setattr(replay, "replayed_layers", lambda *a: calls.append(a[1].shape) or original(*a))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, learning_rate=1e-2, max_steps=3, report_to="none",
                      save_strategy="no", logging_steps=1)
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=2), copy_digits_reward, args=args,
                          train_dataset=toy_dataset, processing_class=tokenizer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    # One per step; rows of zero advantage are skipped (beta 0), so up to 8 rows x 2 layers.
    assert len(calls) == 3 and all(shape[0] <= 8 and shape[1] == 2 for shape in calls)
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
