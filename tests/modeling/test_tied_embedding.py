"""A tied input embedding's gradient added in place into the LM head's (`modeling.tied_embedding`): the same dense
`.grad` as the dense lookup's within float32 rounding (padded and packed, checkpointed, accumulated over two
backwards), without the `[V, E]` buffer of its own at the backward's end; left dense where the sum could not be
dense; the module as loaded once the forward is done. Under CPU bf16 autocast the gradients are the dense lookup's
within bf16 rounding, by the body that tests/gpu/test_tied_lookup_cuda.py runs on CUDA (tests/gpu/bodies.py)."""

import contextlib

import pytest
import torch

from grpo_trainer.modeling import forwards, tied_embedding
from tests.gpu.bodies import lookup_gradients, tied_gradients_equal_dense
from tests.helpers import model_of_kind

VOCAB = 16_384


def _batch(tokenizer, T: int = 16):
    """3 rows: prompts of 5, 3, 6 tokens (S = 6), completions of T, T - 11, T - 3."""
    prompts, completions = torch.tensor([5, 3, 6]), torch.tensor([T, T - 11, T - 3])
    columns = torch.arange(6 + T)
    mask = ((columns >= 6 - prompts[:, None]) & (columns < 6 + completions[:, None])).long()
    ids = torch.randint(10, 90, (3, 6 + T), generator=torch.Generator().manual_seed(0))
    return ids.masked_fill(mask == 0, tokenizer.pad_token_id), mask, T


def _tied_model(tokenizer):
    """Qwen2.5-0.5B's layout (tied embeddings) at test size with a vocabulary of 16,384 (so that the matrix, not the
    activations of a few tokens, sets the backward's peak, as at real shapes), checkpointing on (the default)."""
    from grpo_trainer.runtime import compat

    model = model_of_kind("qwen2.5-0.5b", tokenizer, vocab_size=VOCAB)
    compat.enable_checkpointing(model)
    return model.train()


def _backward_peak(loss: torch.Tensor) -> int:
    """The allocator's highest live bytes during `loss.backward()`, above its live bytes when it started."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler:
        loss.backward()
    totals = []

    def walk(node):
        total = getattr(node.extra_fields, "total_allocated", None)
        if total is not None and hasattr(node.extra_fields, "alloc_size"):
            totals.append((node.start_time_ns, total - node.extra_fields.alloc_size, total))
        for child in node.children:
            walk(child)

    for root in profiler.profiler.kineto_results.experimental_event_tree():
        walk(root)
    totals.sort()
    return max(t for _, _, t in totals) - totals[0][1]


def _grads_and_peak(model, ids, mask, T, settings, dense: bool, backwards: int = 1):
    model.zero_grad(set_to_none=True)
    peaks = []
    for _ in range(backwards):  # a second backward accumulates into the first's `.grad`
        forwards._VERDICTS.clear()
        with pytest.MonkeyPatch.context() as patch:
            if dense:  # the reference: the lookup's own dense backward
                patch.setattr(forwards, "tied_lookup", lambda lm: contextlib.nullcontext())
            out = forwards.score(model, ids, mask, T, settings, with_entropy=True)
        weights = torch.randn((2, *out.logps.shape), generator=torch.Generator().manual_seed(5)) * mask[:, -T:]
        peaks.append(_backward_peak((out.logps * weights[0]).sum() + (out.entropy * weights[1]).sum()))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, max(peaks)


@pytest.mark.parametrize("backwards", [1, 2], ids=["one", "accumulated"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_tied_gradient_equals_dense_without_its_buffer(tokenizer, padding_free, backwards):
    """The head's own transients kept small beside the matrix, as at a real vocabulary (152k rows): log-prob chunks
    of 16 rows (its weight product accumulates into the gradient in place)."""
    model = _tied_model(tokenizer)
    embedding = model.get_input_embeddings()
    assert tied_embedding.lookup_applies(model)
    ids, mask, T = _batch(tokenizer)
    settings = forwards.ForwardSettings(padding_free=padding_free, chunk_size=16)
    dense, dense_peak = _grads_and_peak(model, ids, mask, T, settings, dense=True, backwards=backwards)
    grads, peak = _grads_and_peak(model, ids, mask, T, settings, dense=False, backwards=backwards)
    assert "forward" not in embedding.__dict__  # the module as loaded after the forward
    assert grads.keys() == dense.keys() and "model.embed_tokens.weight" in grads
    assert not grads["model.embed_tokens.weight"].is_sparse  # what the optimizer and clipping always saw
    for name in grads:
        torch.testing.assert_close(grads[name], dense[name], atol=1e-6, rtol=1e-5, msg=name)
    # The dense lookup's backward builds one more V x E float32 matrix at the backward's end (its peak here: the
    # activations of 3 x 22 tokens are far smaller); the lookup's rows' gradient is 3 x 22 x E floats.
    matrix = embedding.weight.numel() * 4  # V x E x 4 B = 16,384 x 224 x 4 = 14.7 MB
    assert dense_peak - peak > 0.9 * matrix, (dense_peak, peak, matrix)


def test_tied_gradient_equals_dense_under_cpu_bf16_autocast(tokenizer):
    """bf16 autocast over float32 weights on CPU (the trainer's mixed precision): the tied lookup's gradients are
    the dense lookup's within bf16 rounding of the products. The autocast is real: without it the embedding's
    gradient moves by far more than that tolerance."""
    run = tied_gradients_equal_dense(tokenizer, torch.device("cpu"), vocab_size=4096)
    fp32, _ = lookup_gradients(run.model, *run.batch, dense=False, autocast=False)
    name = "model.embed_tokens.weight"
    assert (fp32[name] - run.grads[name]).abs().max() > 100 * 1e-4, "the bf16 autocast changed nothing"


def test_left_dense_where_the_sum_could_not_be(tokenizer):
    """Untied (no head gradient of the same matrix to add into), frozen (a LoRA run's embedding), or the head
    replaced by a float32 copy (`cast_lm_head_to_fp32`): the lookup as loaded; a tied model's flag is restored."""
    from grpo_trainer.modeling.logprobs import Float32Head

    untied = model_of_kind("llama3", tokenizer, tie_word_embeddings=False)
    assert not tied_embedding.lookup_applies(untied)
    tied = _tied_model(tokenizer)
    assert tied_embedding.lookup_applies(tied)
    with tied_embedding.tied_lookup(tied):
        assert "forward" in tied.get_input_embeddings().__dict__
    assert "forward" not in tied.get_input_embeddings().__dict__
    with torch.no_grad(), tied_embedding.tied_lookup(tied):  # a gradient-free forward has nothing to add
        assert "forward" not in tied.get_input_embeddings().__dict__
    tied.get_input_embeddings().weight.requires_grad_(False)
    assert not tied_embedding.lookup_applies(tied)
    tied.get_input_embeddings().weight.requires_grad_(True)
    E, V = tied.config.hidden_size, tied.config.vocab_size
    tied.set_output_embeddings(Float32Head(E, V, bias=False))
    assert not tied_embedding.lookup_applies(tied)


def test_untied_model_trains_dense(tokenizer):
    """An untied model's embedding gradient is the lookup's own dense one through `forwards.score`, and trains."""
    model = model_of_kind("llama3", tokenizer, tie_word_embeddings=False).train()
    ids, mask, T = _batch(tokenizer)
    out = forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=True))
    (out.logps * mask[:, -T:]).sum().backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and not grad.is_sparse
    torch.optim.AdamW(model.parameters()).step()
