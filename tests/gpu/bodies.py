"""The bodies of the tests in tests/gpu, each a function of the device (and dtype) it runs on: the CUDA test calls it
on cuda:0, its counterpart in the normal suite on CPU, so an import, fixture or signature break in a GPU test's code
fails on CPU too. What only a GPU has stays in the tests/gpu modules: graph capture, `torch.cuda`'s memory
statistics, TRL's side stream and pinned memory.

Which test runs which body, on CUDA (tests/gpu/) and on CPU:

- test_cuda_bf16.py, tests/trainer/test_bf16.py: `bf16_greedy_tokens_equal_generate`,
  `bf16_logprobs_within_rounding`, `short_bf16_run_moves_the_weights`;
- test_static_decode.py, tests/rollout/fast/test_static.py: `static_greedy_tokens_equal_generate`,
  `graphs_against_the_eager_static_step`, `compactions_in_place`, `bf16_static_logps_within_rounding`;
- test_tied_lookup_cuda.py, tests/modeling/test_tied_embedding.py: `tied_gradients_equal_dense`;
- test_offloading_cuda.py, tests/modeling/test_offloaded_backward.py: `offloaded_backward`;
- test_speculative_cuda.py, tests/rollout/speculative/test_speculative_loop.py: `speculative_greedy_equals_plain`,
  `speculative_logps_equal_a_forward`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from grpo_trainer.algorithms.losses import LossNorm, policy_loss
from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.modeling import forwards
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rollout.fast import static
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.types import end_at_first_eos
from grpo_trainer.runtime import compat
from tests.helpers import (
    MAX_NEW,
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    make_trainer,
    model_of_kind,
)
from tests.static_helpers import decode, early_eos_config, varied_prompts

# ----------------------------------------------------------------------------------------------- bfloat16 (bf16)


def bf16_greedy_tokens_equal_generate(tokenizer, kind: str, device: torch.device) -> None:
    """Greedy decoding is deterministic given the logits: the fast decoder's bf16 kernels must pick the tokens
    `generate` picks, at every position (no row ends early, so all MAX_NEW positions are compared)."""
    model = model_of_kind(kind, tokenizer).to(device=device, dtype=torch.bfloat16).eval()
    prompts, config = grouped_prompts(tokenizer).to(device), greedy_config(tokenizer)
    assert fast_path_blocker(model, config, prompts.ids.shape[1]) is None
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
        fast = fast_rollout(model, prompts, config)
    assert reference.completion_ids.shape[1] == MAX_NEW
    assert_same_rollout(fast, reference)


def bf16_logprobs_within_rounding(tokenizer, device: torch.device, T: int = 8) -> None:
    """The same weights in float32 and in bfloat16 (8 significant bits: a relative rounding of 2**-8 per value, so
    log-probs of magnitude log V ~ 5 move by a few hundredths). The LM head's log-sum-exp runs in float32 in both, so
    the bf16 error comes from the hidden states only. The loss is scored against the float32 log-probs as the
    sampler's (`old_logps`): on-policy its value would be -mean(A) whatever the log-probs, a comparison of nothing."""
    fp32 = model_of_kind("qwen2", tokenizer).to(device).eval()
    bf16 = copy.deepcopy(fp32).to(dtype=torch.bfloat16)
    prompts = grouped_prompts(tokenizer)
    completion = torch.randint(10, len(tokenizer) - 1, (prompts.ids.shape[0], T),
                               generator=torch.Generator().manual_seed(3))
    ids = torch.cat([prompts.ids, completion], 1).to(device)                              # (B, S + T)
    mask = torch.cat([prompts.mask, torch.ones_like(completion)], 1).to(device)
    completion_mask = mask[:, -T:].float()                                                 # (B, T)
    advantages = torch.linspace(-0.5, 1.5, ids.shape[0], device=device)                    # (B,), mean 0.5
    norm = LossNorm(window_tokens=float(completion_mask.sum()))
    out32 = completion_logprobs(fp32, ids, mask, T, with_entropy=True)  # with gradients, as the loss forward runs
    out16 = completion_logprobs(bf16, ids, mask, T, with_entropy=True)
    logps32, entropy32 = out32.logps, out32.entropy.float()                                # (B, T)
    logps16, entropy16 = out16.logps.float(), out16.entropy.float()
    assert logps32.dtype == torch.float32 and not torch.equal(logps16, logps32)  # bf16 really ran
    torch.testing.assert_close(logps16, logps32, atol=0.1, rtol=0.02)
    assert (logps16 - logps32).abs().mean() < 0.03
    torch.testing.assert_close(entropy16, entropy32, atol=0.1, rtol=0.02)
    # ratio exp(logps - old_logps): 1 in float32 (loss -mean(A) = -0.5), exp of the bf16 error in bf16
    losses = [policy_loss(logps, advantages, completion_mask, norm, loss_type="dapo", old_logps=logps32).loss
              for logps in (logps32, logps16)]
    torch.testing.assert_close(losses[0], torch.tensor(-0.5, device=device))
    torch.testing.assert_close(losses[1], losses[0], atol=0.02, rtol=0.02)


def short_bf16_run_moves_the_weights(tmp_path, tokenizer, dataset, device: torch.device) -> None:
    """Two optimizer steps in bf16 mixed precision on `device`: every trained matrix moved, the loss is finite and
    the rewards were logged."""
    on_cpu = {"use_cpu": True} if device.type == "cpu" else {}  # transformers refuses bf16=True on CPU without it
    trainer = make_trainer(tmp_path, tokenizer, dataset, model=make_tiny_model(tokenizer, seed=7), bf16=True,
                           max_completion_length=8, learning_rate=0.05, **on_cpu)
    assert next(trainer.model.parameters()).device.type == device.type
    assert trainer.accelerator.mixed_precision == "bf16"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if p.ndim == 2 and not torch.equal(before[n], p)]
    matrices = [n for n, p in trainer.model.named_parameters() if p.ndim == 2]
    assert moved == matrices
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert logged and all(torch.isfinite(torch.tensor(row["loss"])) for row in logged)
    assert all("reward" in row for row in logged)


# ------------------------------------------------------------------------------------ static decode (fast.static)


def _static_setup(tokenizer, device: torch.device, kind: str = "qwen2.5-0.5b", dtype=torch.float32):
    model = model_of_kind(kind, tokenizer).to(device=device, dtype=dtype).eval()
    return model, varied_prompts(tokenizer).to(device)


def static_greedy_tokens_equal_generate(tokenizer, kind: str, mode: str, device: torch.device) -> None:
    """The fast backend stepping in `mode` ("compact" or "graphs") on `device`: greedy tokens equal
    `model.generate`'s over rows of mixed lengths (12 of 16 end early, so rows were compacted)."""
    model, prompts = _static_setup(tokenizer, device, kind)
    config = early_eos_config(tokenizer, model, prompts)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    lengths = reference.completion_mask.sum(1)
    assert lengths.min() < lengths.max() == reference.completion_ids.shape[1]  # mixed lengths
    fast = FastBackend(**{device.type: mode}).generate(model, prompts, config)
    assert_same_rollout(fast, reference)


def graphs_against_the_eager_static_step(tokenizer, device: torch.device):
    """"graphs" as it runs on `device`, then with graphs refused by the test (the eager static step: the same
    module, masked full-width attention and tensor column, on the same device): rows were compacted, the refused
    run captured nothing, and tokens and log-probs are equal. Returns both runs' `StaticSteps`."""
    model, prompts = _static_setup(tokenizer, device)
    config = early_eos_config(tokenizer, model, prompts)
    runs, eager_runs = [], []
    graphs = decode(model, prompts, config, "graphs", runs=runs)
    assert runs[0].compactions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static, "graphs_blocker", lambda device, outputs: "switched off by the test")
        eager = decode(model, prompts, config, "graphs", runs=eager_runs)
    assert not eager_runs[0].use_graphs and not eager_runs[0].graphs and eager_runs[0].pool is None
    assert eager_runs[0].compactions == runs[0].compactions  # the same buckets at the same steps
    assert torch.equal(graphs.completion_ids, eager.completion_ids)
    # The same kernels replayed: equal bits are expected; the float32 tolerance of one ulp at |log p| ~ 10 leaves
    # room only for cuBLAS picking another algorithm under capture, not for a wrong column, row or mask.
    torch.testing.assert_close(graphs.logps, eager.logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(graphs.entropy, eager.entropy, rtol=0, atol=1e-6)
    return runs[0], eager_runs[0]


def compactions_in_place(tokenizer, device: torch.device, mode: str = "graphs"):
    """A round in `mode` whose rows end at different steps: it compacts onto ever smaller buckets, and every
    compaction moves rows inside the caches allocated once (their storage never changes). Returns its
    `StaticSteps`."""
    model, prompts = _static_setup(tokenizer, device)
    config = early_eos_config(tokenizer, model, prompts)
    steps, runs = [], []
    decode(model, prompts, config, mode, steps=steps, runs=runs)
    sizes = [n for _, n, _ in steps]
    assert sizes and all(n in static.buckets(prompts.ids.shape[0]) for n in sizes)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert len({tuple(pointers) for *_, pointers in steps}) == 1
    return runs[0]


def bf16_static_logps_within_rounding(tokenizer, device: torch.device) -> None:
    """bf16 (8 significant bits): the static step's attention sums over masked columns too, so log-probs move by
    bf16 rounding of the hidden states; compared on each row's tokens up to where the two token streams first
    differ (a near-tie may flip a greedy token in bf16), which must cover most of the tokens."""
    model, prompts = _static_setup(tokenizer, device, dtype=torch.bfloat16)
    config = greedy_config(tokenizer, max_new_tokens=24)
    eager = decode(model, prompts, config, "eager")
    graphs = decode(model, prompts, config, "graphs")
    same = (graphs.completion_ids == eager.completion_ids).long().cumprod(1).bool()  # common prefix per row
    _, mask, _ = end_at_first_eos(eager.completion_ids.clone(), config)
    compared = same & mask.bool()
    assert compared.sum() >= 0.8 * mask.sum()
    torch.testing.assert_close(graphs.logps[compared], eager.logps[compared], atol=0.1, rtol=0.02)
    assert (graphs.logps[compared] - eager.logps[compared]).abs().mean() < 0.03


# -------------------------------------------------------------------------------- tied lookup (tied_embedding)


def lookup_gradients(model, ids, mask, T, dense: bool, backward: Callable[[Tensor], object] = Tensor.backward,
                     autocast: bool = True):
    """The gradients (float32, on CPU) of the masked log-probs' sum through `forwards.score`, under bf16 autocast on
    the batch's device (or none), through the tied lookup or (`dense`) the embedding's own backward; and what
    `backward(loss)` returned (a peak)."""
    model.zero_grad(set_to_none=True)
    forwards._VERDICTS.clear()
    precision = torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with pytest.MonkeyPatch.context() as patch:
        if dense:  # the reference: the lookup's own dense backward
            patch.setattr(forwards, "tied_lookup", lambda lm: contextlib.nullcontext())
        with precision:
            out = forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=True, chunk_size=16))
    measured = backward((out.logps * mask[:, -T:]).sum())
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}, measured


class TiedRun(NamedTuple):
    model: torch.nn.Module
    batch: tuple[Tensor, Tensor, int]  # ids [B, S + T], mask [B, S + T], T
    grads: dict[str, Tensor]  # the tied lookup's
    dense_measured: object  # what `backward` returned for the dense lookup's run
    measured: object  # ... for the tied lookup's


def tied_gradients_equal_dense(tokenizer, device: torch.device, vocab_size: int,
                               backward: Callable[[Tensor], object] = Tensor.backward) -> TiedRun:
    """A tied embedding (Qwen2.5-0.5B's layout, checkpointed) under bf16 autocast over float32 weights (the
    trainer's mixed precision): the lookup adding its rows into the head's gradient gives the dense lookup's
    gradients."""
    model = model_of_kind("qwen2.5-0.5b", tokenizer, vocab_size=vocab_size).to(device)
    compat.enable_checkpointing(model)
    model.train()
    T = 24
    ids = torch.randint(10, 90, (3, 6 + T), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    dense, dense_measured = lookup_gradients(model, ids, mask, T, dense=True, backward=backward)
    grads, measured = lookup_gradients(model, ids, mask, T, dense=False, backward=backward)
    assert grads.keys() == dense.keys() and "model.embed_tokens.weight" in grads
    for name in grads:  # bf16 products: the same sums in another order, within bf16 rounding of the products
        torch.testing.assert_close(grads[name], dense[name], atol=1e-4, rtol=1e-3, msg=name)
    return TiedRun(model, (ids, mask, T), grads, dense_measured, measured)


# ------------------------------------------------------------------------- activation offloading (TRL's manager)


AtBackward = Callable[[contextlib.AbstractContextManager], object]


def offloaded_backward(model, ids, mask, T, context, at_backward: AtBackward = lambda context: None):
    """One padded `forwards.score` forward and its backward (of the log-probs' sum) inside `context`, the whole
    step as the trainer runs it (`trainer.parts.activation_offloading`): the parameters' gradients, and what
    `at_backward(context)` returned between the two (what the device holds, what the manager took)."""
    model.zero_grad(set_to_none=True)
    forwards._VERDICTS.clear()
    with context:
        loss = forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=False)).logps.sum()
        measured = at_backward(context)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, measured


# ---------------------------------------------------------------------------------------- speculative rollouts


def speculative_greedy_equals_plain(tokenizer, kind: str, device: torch.device) -> None:
    """float32: greedy completions with drafts equal the plain decoder's, and drafts were accepted (fewer
    forwards than tokens)."""
    from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

    model = model_of_kind(kind, tokenizer).to(device).eval()
    prompts = grouped_prompts(tokenizer, repeats=4).to(device)
    config = greedy_config(tokenizer, max_new_tokens=40)
    with torch.no_grad():
        plain = FastBackend(cuda="decoder").generate(model, prompts, config)
        spec = FastBackend(cuda="decoder", speculative=SpeculativeSettings(policy="fixed")).generate(
            model, prompts, config)
    assert_same_rollout(spec, plain)
    assert spec.decode.accepted > 0 and spec.decode.forwards < plain.completion_ids.shape[1] - 1


def speculative_logps_equal_a_forward(tokenizer, dtype: torch.dtype, device: torch.device) -> None:
    """Sampled with drafts (the "measured" policy, the one whose widths vary most): each committed token's log-prob
    equals the model's own forward over prompt + completion, within `dtype`'s rounding."""
    from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

    model = model_of_kind("qwen2.5-0.5b", tokenizer).to(device=device, dtype=dtype).eval()
    prompts = grouped_prompts(tokenizer, repeats=4).to(device)
    config = greedy_config(tokenizer, max_new_tokens=30, do_sample=True, temperature=0.7)
    torch.manual_seed(0)
    with torch.no_grad():
        spec = FastBackend(speculative=SpeculativeSettings(policy="measured")).generate(model, prompts, config)
        ids = torch.cat([spec.prompt_ids, spec.completion_ids], 1)
        mask = torch.cat([spec.prompt_mask, spec.completion_mask], 1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    S, T = spec.prompt_ids.shape[1], spec.completion_ids.shape[1]
    expected = torch.log_softmax(logits[:, S - 1:S + T - 1] / 0.7, -1).gather(2, spec.completion_ids[..., None])
    valid = spec.completion_mask.bool()
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(spec.sampler.logps[valid], expected[..., 0][valid], atol=tolerance, rtol=0)
    assert spec.decode is not None and spec.decode.drafted > 0
