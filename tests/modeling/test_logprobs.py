"""Chunked completion log-probs equal the naive full-logits computation, in value and gradient, without keeping
a `[B, T, V]` tensor for backward."""

import math

import pytest
import torch
from torch import nn

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer
from grpo_trainer.modeling import logprobs as logprobs_module
from grpo_trainer.modeling.logprobs import Float32Head, completion_logprobs, token_logprobs

T = 6  # completion tokens
ATOL = 1e-5


def batch(tokenizer, generator_seed: int = 0):
    """3 rows: prompts of 5, 3 and 1 real tokens left-padded to S = 5; completions of 6, 4 and 1 tokens
    right-padded to T = 6 (the completion mask is the attention mask there, as in the trainer)."""
    generator = torch.Generator().manual_seed(generator_seed)
    pad = tokenizer.pad_token_id
    prompt_lengths, completion_lengths, S = [5, 3, 1], [6, 4, 1], 5
    ids = torch.randint(10, 90, (3, S + T), generator=generator)
    mask = torch.zeros(3, S + T, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[row, S - p : S + c] = 1
    return ids.masked_fill(mask == 0, pad), mask


def naive(model, ids, mask, temperature):
    """log_softmax over the full `[B, S+T, V]` logits, with the same position ids as completion_logprobs."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    logits = logits[:, -T - 1 : -1].float() / temperature  # position t predicts token t+1
    logp_all = torch.log_softmax(logits, -1)
    chosen = logp_all.gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return chosen, entropy


def test_token_logprobs_by_hand():
    # logits [0, ln 3] -> probs [1/4, 3/4]: log p(1) = ln .75 = -0.287682;
    # entropy -(.25 ln .25 + .75 ln .75) = .25 * 1.386294 + .75 * 0.287682 = 0.562335
    # temperature 2: logits [0, ln 3 / 2] -> probs [1/(1+sqrt 3), sqrt 3/(1+sqrt 3)] = [0.366025, 0.633975]
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    chosen, entropy = token_logprobs(logits, torch.tensor([1, 0]))
    torch.testing.assert_close(chosen, torch.tensor([math.log(0.75), math.log(0.25)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.full((2,), 0.562335), atol=1e-6, rtol=0)
    chosen, _ = token_logprobs(logits.to(torch.bfloat16), torch.tensor([1, 0]), temperature=2.0)
    assert chosen.dtype == torch.float32  # upcast before the softmax
    q = 1 / (1 + math.sqrt(3))
    torch.testing.assert_close(chosen, torch.tensor([math.log(1 - q), math.log(q)]), atol=2e-3, rtol=0)  # bf16 ln 3


def test_in_place_logsumexp_by_hand():
    from grpo_trainer.modeling.logprobs import _logsumexp_

    # [0, ln 3] -> ln(1 + 3) = ln 4 = 1.386294; [1000, 1000] -> 1000 + ln 2 (the max is taken out first, so
    # exp never overflows); [-5] -> -5.
    logits = torch.tensor([[0.0, math.log(3.0)], [1000.0, 1000.0]])
    torch.testing.assert_close(_logsumexp_(logits), torch.tensor([math.log(4.0), 1000.0 + math.log(2.0)]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(_logsumexp_(torch.tensor([[-5.0]])), torch.tensor([-5.0]), atol=0, rtol=0)


@pytest.mark.parametrize(("chunk_size", "temperature"), [(1, 0.7), (7, 1.0), (3 * T + 5, 0.7)])
def test_matches_naive_values_entropy_and_gradients(tiny_model, tokenizer, chunk_size, temperature):
    ids, mask = batch(tokenizer)
    weights = torch.randn(3, T, generator=torch.Generator().manual_seed(1))  # a generic downstream loss

    out = completion_logprobs(tiny_model, ids, mask, T, temperature=temperature, chunk_size=chunk_size,
                              with_entropy=True)
    logps, entropy = out.logps, out.entropy
    assert logps.shape == entropy.shape == (3, T) and logps.dtype == torch.float32
    (logps * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()

    expected, expected_entropy = naive(tiny_model, ids, mask, temperature)
    (expected * weights).sum().backward()
    torch.testing.assert_close(logps, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=ATOL, rtol=0)
    for name, param in tiny_model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=ATOL, rtol=0, msg=name)


def test_chunk_rows_by_hand():
    # 2**27 bytes / (4 bytes x 151,936) = 220.8 rows of Qwen2.5's vocabulary; 2**27 / (4 x 32,000) = 1048.6 > 1024
    assert logprobs_module.chunk_rows(1024, 151936) == 220
    assert logprobs_module.chunk_rows(1024, 32000) == 1024
    assert logprobs_module.chunk_rows(7, 10) == 7
    assert logprobs_module.chunk_rows(1024, 2**26) == 1  # a row over the budget still makes a chunk


def test_chunks_are_capped_by_bytes_with_the_same_values_and_gradients(tiny_model, tokenizer, monkeypatch):
    """A budget of two rows' float32 logits makes 2-row chunks whatever chunk_size says; nothing else changes."""
    ids, mask = batch(tokenizer)
    weights = torch.randn(3, T, generator=torch.Generator().manual_seed(5))
    expected_out = completion_logprobs(tiny_model, ids, mask, T, chunk_size=1024, with_entropy=True)
    expected = _grads(tiny_model, (expected_out.logps * weights).sum())
    V = tiny_model.config.vocab_size
    monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", 2 * 4 * V)
    sizes = []
    apply = logprobs_module._HeadLogProbs.apply
    monkeypatch.setattr(logprobs_module._HeadLogProbs, "apply", lambda *a: sizes.append(a[5]) or apply(*a))
    out = completion_logprobs(tiny_model, ids, mask, T, chunk_size=1024, with_entropy=True)
    assert sizes == [2]
    torch.testing.assert_close(out.logps, expected_out.logps, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, expected_out.entropy, atol=ATOL, rtol=0)
    _assert_same_grads(_grads(tiny_model, (out.logps * weights).sum()), expected)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(actual, expected):
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize(("chunk_size", "temperature", "logps_too"), [(1, 0.7, True), (7, 1.0, False),
                                                                       (3 * T + 5, 0.7, True)])
def test_entropy_gradient_matches_autograd(tiny_model, tokenizer, chunk_size, temperature, logps_too):
    """The entropy bonus differentiates H: the head's hand-written backward (dH/dz = -p (log p + H)) gives the
    parameter gradients autograd gives through `token_logprobs` on the full logits, alone or with log p's."""
    ids, mask = batch(tokenizer)
    generator = torch.Generator().manual_seed(2)
    w_logp, w_entropy = torch.randn(3, T, generator=generator), torch.randn(3, T, generator=generator)

    def loss_of(logps, entropy):
        return (entropy * w_entropy).sum() + ((logps * w_logp).sum() if logps_too else 0.0)

    out = completion_logprobs(tiny_model, ids, mask, T, temperature=temperature, chunk_size=chunk_size,
                              with_entropy=True)
    logps, entropy = out.logps, out.entropy
    assert entropy.requires_grad
    chunked = _grads(tiny_model, loss_of(logps, entropy))
    expected = _grads(tiny_model, loss_of(*naive(tiny_model, ids, mask, temperature)))
    _assert_same_grads(chunked, expected)


@pytest.mark.parametrize("with_probs", [False, True])
def test_known_values_keep_the_entropy_gradient(tiny_model, tokenizer, with_probs):
    """On-policy the rollout's log-probs, entropies (and softmax) stand in for the forward's values; the gradients
    of log p and of H are still those of the full computation, not those of constants."""
    ids, mask = batch(tokenizer)
    generator = torch.Generator().manual_seed(3)
    w_logp, w_entropy = torch.randn(3, T, generator=generator), torch.randn(3, T, generator=generator)
    temperature = 0.8
    with torch.no_grad():
        known_logps, known_entropy = naive(tiny_model, ids, mask, temperature)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = tiny_model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        known_probs = torch.softmax(logits[:, -T - 1 : -1].float() / temperature, -1) if with_probs else None
    out = completion_logprobs(tiny_model, ids, mask, T, temperature=temperature, chunk_size=5, with_entropy=True,
                              known_logps=known_logps, known_entropy=known_entropy, known_probs=known_probs)
    logps, entropy = out.logps, out.entropy
    assert torch.equal(logps, known_logps) and torch.equal(entropy, known_entropy)  # the forward returned them
    fast = _grads(tiny_model, (logps * w_logp).sum() + (entropy * w_entropy).sum())
    logps, entropy = naive(tiny_model, ids, mask, temperature)
    _assert_same_grads(fast, _grads(tiny_model, (logps * w_logp).sum() + (entropy * w_entropy).sum()))


def test_entropy_gradient_through_a_wrapped_head(tokenizer):
    """A head with a forward hook (as accelerate's offloading adds) goes through checkpointed `token_logprobs`:
    its entropy is differentiable there too."""
    model = make_tiny_model(tokenizer)
    ids, mask = batch(tokenizer)
    weights = torch.randn(3, T, generator=torch.Generator().manual_seed(4))
    expected = _grads(model, (naive(model, ids, mask, 1.0)[1] * weights).sum())
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: out)
    entropy = completion_logprobs(model, ids, mask, T, chunk_size=4, with_entropy=True).entropy
    _assert_same_grads(_grads(model, (entropy * weights).sum()), expected)


def test_without_grad_and_without_entropy(tiny_model, tokenizer):
    ids, mask = batch(tokenizer)
    with torch.no_grad():
        out = completion_logprobs(tiny_model, ids, mask, T, chunk_size=4)
        expected, _ = naive(tiny_model, ids, mask, 1.0)
    logps = out.logps
    assert out.entropy is None and out.aux_loss is None and not logps.requires_grad
    torch.testing.assert_close(logps, expected, atol=ATOL, rtol=0)


def test_invariant_to_extra_left_padding(tiny_model, tokenizer):
    ids, mask = batch(tokenizer)
    pad = torch.full((3, 4), tokenizer.pad_token_id)
    padded_ids, padded_mask = torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1)
    with torch.no_grad():
        plain = completion_logprobs(tiny_model, ids, mask, T, with_entropy=True)
        padded_out = completion_logprobs(tiny_model, padded_ids, padded_mask, T, with_entropy=True)
    logps, entropy, padded, padded_entropy = plain.logps, plain.entropy, padded_out.logps, padded_out.entropy
    active = mask[:, -T:].bool()
    torch.testing.assert_close(padded[active], logps[active], atol=ATOL, rtol=0)
    torch.testing.assert_close(padded_entropy[active], entropy[active], atol=ATOL, rtol=0)


def test_unwraps_a_ddp_style_wrapper(tiny_model, tokenizer):
    class Wrapper(nn.Module):  # like DDP / a DeepSpeed engine: the model sits in `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    ids, mask = batch(tokenizer)
    with torch.no_grad():
        wrapped = completion_logprobs(Wrapper(tiny_model), ids, mask, T).logps
        direct = completion_logprobs(tiny_model, ids, mask, T).logps
    torch.testing.assert_close(wrapped, direct, atol=0, rtol=0)


def test_model_without_lm_head_is_rejected(tokenizer):
    class Headless(nn.Module):
        def get_output_embeddings(self):
            return None

        def forward(self, **kwargs):
            return type("Out", (), {"hidden_states": (torch.zeros(1, 3, 4),)})()

    with pytest.raises(ValueError, match="Headless has no output embeddings"):
        completion_logprobs(Headless(), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), 1)


def test_no_full_vocab_tensor_is_saved_for_backward():
    """With chunk_size < B*T, backward keeps no float32 tensor with a V-wide last dim beyond one chunk (the
    chunks are recomputed in backward); the naive path keeps several [B, T, V]."""
    tokenizer = make_tokenizer(extra_vocab=4000)
    model = make_tiny_model(tokenizer)
    vocab = model.config.vocab_size  # 4104, far from every other dim here (H = 64, B*T = 2*24 = 48)
    B, S, completion, chunk = 2, 4, 24, 8
    ids = torch.randint(10, 90, (B, S + completion), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def vocab_wide_saved(run) -> list[tuple[int, ...]]:
        saved = []

        def pack(tensor):
            is_parameter = tensor.untyped_storage().data_ptr() in parameter_storages  # the LM head weight itself
            if tensor.dtype == torch.float32 and tensor.dim() and tensor.shape[-1] == vocab and not is_parameter:
                saved.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = run()
        out.sum().backward()  # the recomputation in backward must work under the same graph
        return saved

    naive_saved = vocab_wide_saved(lambda: torch.log_softmax(
        model(input_ids=ids, attention_mask=mask).logits[:, -completion - 1 : -1].float(), -1)[..., 0])
    assert (B, completion, vocab) in naive_saved  # the detector sees the naive [B, T, V] log-softmax output

    chunked_saved = vocab_wide_saved(lambda: completion_logprobs(model, ids, mask, completion, chunk_size=chunk).logps)
    assert all(math.prod(shape) <= chunk * vocab for shape in chunked_saved), chunked_saved
    assert sum(math.prod(shape) for shape in chunked_saved) < B * completion * vocab


def _bf16_llama_with_float32_head(tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head = model.lm_head
    fp32 = Float32Head(head.in_features, head.out_features, bias=False)
    fp32.weight = nn.Parameter(head.weight.detach().float())
    model.lm_head = fp32
    return model


def test_float32_head_computes_in_float32_whatever_its_input_and_autocast():
    head = Float32Head(4, 3, bias=True)
    hidden = torch.randn(2, 4).to(torch.bfloat16)
    expected = hidden.float() @ head.weight.T + head.bias  # the bf16 values, multiplied in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)


def test_float32_head_log_probs_are_float32_products_of_the_bf16_hidden_states(tokenizer):
    """A bf16 model with a `Float32Head`: the chunked path takes the final hidden states (bf16), casts them to
    float32 and multiplies them by the float32 weight, as the head's own forward does: the same values and
    gradients as the naive full-logits computation through the model's forward."""
    model = _bf16_llama_with_float32_head(tokenizer)
    ids, mask = batch(tokenizer)
    out = completion_logprobs(model, ids, mask, T, chunk_size=4, with_entropy=True)
    out.logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected, expected_entropy = naive(model, ids, mask, 1.0)  # model.logits: Float32Head.forward, float32
    expected.sum().backward()
    torch.testing.assert_close(out.logps, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, expected_entropy.detach(), atol=ATOL, rtol=0)
    assert model.lm_head.weight.grad.dtype == torch.float32
    for name, param in model.named_parameters():  # bf16 gradients below the head: bf16 rounding of equal sums
        torch.testing.assert_close(grads[name], param.grad, atol=ATOL if param.dtype == torch.float32 else 1e-2,
                                   rtol=0 if param.dtype == torch.float32 else 1e-2, msg=name)


def _tiny_moe(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_the_router_aux_loss_comes_from_the_same_forward(tokenizer):
    """with_aux_loss asks the model for its router logits: the result carries the model's own load-balancing loss
    (differentiable), and the log-probs are those of a forward without it."""
    model = _tiny_moe(tokenizer)
    ids, mask = batch(tokenizer)
    out = completion_logprobs(model, ids, mask, T, with_aux_loss=True)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, output_router_logits=True).aux_loss
    assert out.aux_loss.dim() == 0 and out.aux_loss.requires_grad
    torch.testing.assert_close(out.aux_loss, expected, atol=0, rtol=0)
    torch.testing.assert_close(out.logps, completion_logprobs(model, ids, mask, T).logps, atol=0, rtol=0)
    assert completion_logprobs(model, ids, mask, T).aux_loss is None


def test_aux_loss_from_a_dense_model_is_refused(tiny_model, tokenizer):
    ids, mask = batch(tokenizer)
    with pytest.raises(ValueError, match="returned no aux_loss"):
        completion_logprobs(tiny_model, ids, mask, T, with_aux_loss=True)


@pytest.mark.parametrize("kind", ["gemma2_softcap", "cohere_scale", "granite_scaling", "unknown_postprocessing"])
def test_logprobs_score_the_models_own_logits_whatever_it_does_after_the_head(tokenizer, kind, caplog):
    """Gemma 2 soft-caps its logits (cap * tanh(z / cap)), Cohere multiplies them by logit_scale, Granite divides
    them by logits_scaling: the log-probs (and their gradients) are those of the model's returned logits, not of
    its head's raw output. A post-processing no config attribute names is detected once and scored from the
    model's own logits, with a warning."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

    common = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0}
    config = {"gemma2_softcap": lambda: Gemma2Config(**common, final_logit_softcapping=0.5),
              "cohere_scale": lambda: CohereConfig(**common, logit_scale=0.0625),
              "granite_scaling": lambda: GraniteConfig(**common, logits_scaling=8.0),
              "unknown_postprocessing": lambda: GraniteConfig(**common)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "unknown_postprocessing":  # a shift of every logit by a per-token amount the head does not make
        shift = torch.linspace(-2.0, 2.0, len(tokenizer))
        model.register_forward_hook(lambda module, args, out: out.__class__(**{**out, "logits": out.logits + shift}))
    ids, mask = batch(tokenizer)
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -T - 1:-1].float()
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, -T:, None]).squeeze(-1)
    with caplog.at_level("WARNING", logger="grpo_trainer.modeling.logprobs"):
        out = completion_logprobs(model, ids, mask, T, temperature=0.7, chunk_size=5, with_entropy=True)
    torch.testing.assert_close(out.logps, expected, atol=1e-5, rtol=0)
    assert ("not its LM head's output" in caplog.text) == (kind == "unknown_postprocessing")
    # the gradient is the model logits' too
    weights = torch.randn(3, T, generator=torch.Generator().manual_seed(5))
    chunked = _grads(model, (out.logps * weights).sum())
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -T - 1:-1].float()
    full = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, -T:, None]).squeeze(-1)
    _assert_same_grads(chunked, _grads(model, (full * weights).sum()))


def test_a_forward_under_autocast_is_not_mistaken_for_post_processing(tokenizer, caplog, monkeypatch):
    """bf16=True: accelerate runs the model's forward in bfloat16 autocast and returns float32 outputs, while the
    chunked head runs outside autocast. Its bf16-rounded logits differ from the float32 head's by more than the
    check's tolerance, which once sent every mixed-precision run down the model-logits path ([B, T, V] float32
    logits and a second forward: +5 GB at 16 x 256 tokens of Qwen2.5-0.5B on a GPU). The head path is kept, and
    its log-probs are the float32 head's."""
    from accelerate.utils import convert_outputs_to_fp32

    model = make_tiny_model(tokenizer, seed=3)
    reference = make_tiny_model(tokenizer, seed=3)
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    monkeypatch.setattr(logprobs_module, "_logprobs_from_model_logits",
                        lambda *args, **kwargs: pytest.fail("took the model-logits path"))
    ids, mask = batch(tokenizer)
    with caplog.at_level("WARNING", logger="grpo_trainer.modeling.logprobs"):
        out = completion_logprobs(model, ids, mask, T, temperature=0.7, chunk_size=5, with_entropy=True)
    assert "not its LM head's output" not in caplog.text
    expected, _ = naive(reference, ids, mask, 0.7)
    # the hidden states went through bfloat16 layers; the head and softmax ran in float32
    torch.testing.assert_close(out.logps, expected, atol=0.1, rtol=0)


def _peak_new_bytes(run) -> int:
    """The CPU allocator's peak of bytes allocated while `run()` runs, over what was allocated before (torch.profiler's
    memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = []  # (start, bytes allocated after the event, its size): the totals count the whole process

    def walk(node):
        total = getattr(node.extra_fields, "total_allocated", None)
        if total is not None and hasattr(node.extra_fields, "alloc_size"):
            events.append((node.start_time_ns, total, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    _, first_total, first_size = min(events)
    return max(total for _, total, _ in events) - (first_total - first_size)  # over what was allocated before


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_chunked_head_holds_at_most_two_chunks_of_logits(with_entropy):
    """N = 64 rows in chunks of 16 over V = 8192: one chunk's float32 logits are 16 x 8192 x 4 = 512 KiB. The
    forward keeps at most two such buffers at a time (logits, then log p and p for the entropy); the outputs are
    [N] vectors (256 B each). Before each chunk's buffers were freed at its end, the previous chunk's p and log p
    were still alive beside the next chunk's logits and log p: four buffers, 2 MiB (three once they were freed, while
    the entropy's product p log p took a buffer of its own)."""
    generator = torch.Generator().manual_seed(0)
    N, E, V, chunk = 64, 16, 8192, 16
    hidden, weight = torch.randn(N, E, generator=generator), torch.randn(V, E, generator=generator)
    tokens = torch.randint(0, V, (N,), generator=generator)
    buffer = chunk * V * 4
    with torch.no_grad():
        peak = _peak_new_bytes(lambda: logprobs_module._HeadLogProbs.apply(
            hidden, weight, None, tokens, 1.0, chunk, with_entropy, None, None))
    assert buffer <= peak <= 2 * buffer + 16 * 1024, (peak, buffer)
