"""The fast backend: each distinct prompt prefilled once, a preallocated KV cache, a tight decode loop.

`model.generate` spends most of a small model's rollout in per-token machinery rather than in arithmetic: mask
builders, cache objects, output dataclasses and stopping criteria.

Decisions:

1. Three tiers, each reproducing `generate`'s tokens: the hand-written decoder (`decoder`) for the models
   `guard.decoder_blocker` clears and `selfcheck` confirms; the model's own forward over a shared-prefix cache
   (`forward`) for the other architectures it serves; `model.generate` for everything else, and for the settings
   `guard.settings_blocker` refuses. Every fall-back is logged with its reason.
2. Distinct prompts are found once (consecutive identical rows); each is prefilled once and its keys/values are
   copied into the rows of its G completions. Positions count real tokens only, as `generate`'s do.
3. The token loop (`loop.run`) stops as soon as every row has emitted an EOS token. Each token's log-prob and
   entropy under the full tempered softmax are kept (`SamplerRecord.logps`, `exact`). On request (`capture.Capture`)
   the decoder also keeps every layer's output and every step's softmax, for `replay`.
4. The loop runs in inference mode (no autograd bookkeeping per operation); its outputs are cloned out of it, and
   replay buffers are allocated outside it and filled inside, so the training forward can use them uncopied.
5. On CUDA the fast backend samples with `model.generate`, by measurement: on an H100 (Qwen2.5-0.5B shape, bf16,
   16 x 256 tokens; benchmarks/RESULTS.md, GPU section) `generate` sampled 660 tokens/s and the decoder 614, after
   tests/gpu passed there. What the decoder would add on a GPU, its sampling log-probs (the loss forward then skips
   the LM-head projection), was 0.14 s of a 6.8 s step. `FastBackend(cuda="decoder")` runs the decoder on CUDA
   anyway (tests/gpu does, to keep it correct there).
6. `fast.static` steps the decoder with finished rows compacted out of its KV cache ("compact"), and at static
   shapes per batch-size bucket replayed as CUDA graphs ("graphs"). Both are opt-in, `FastBackend(cuda=...)` or
   the environment variable `GRPO_TRAINER_FAST_CUDA_DECODE=compact|graphs` (read when the backend is built): no GPU has
   measured them yet, so decision 5 stands until one does (benchmarks/gpu/decode_bench.py). On CPU the default
   stays the eager decoder (`FastBackend(cpu=...)` selects the others, for tests and measurement).
7. `FastBackend(speculative=...)` (`GRPOConfig.speculative_rollouts`) decodes with drafts (`rollout.speculative`):
   the eager decoder only (its static steps feed one position per row), under the processors that read the scores
   alone; a round that cannot is decoded without drafts, with the reason logged. The backend keeps the prompts'
   earlier completions (`PromptHistory`) across rounds, for the "history" drafts. Off (None), the decoder runs the
   plain loop as before. On CUDA, asking for drafts asks for the eager decoder (decision 5's `generate` cannot
   verify them): opt-in there, with no GPU measurement yet (`planning.levers`).
8. `FastBackend(partial=True)` (`GRPOConfig.partial_rollouts`): a round may end early (`PromptBatch.end`), which only
   the eager decoder's plain loop honours; on CUDA asking for it asks for the eager decoder, as decision 7 does, and
   a round another tier would serve is refused with its reason (`_refuse_partial`).

Shapes: `B` rows, `P` distinct prompts, `S` prompt tokens, `T` new tokens, `L = S + T` cache columns, `E` hidden
size, `V` vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout import capture as capture_
from grpo_trainer.rollout.backend import BACKENDS, Capabilities, MemoryProfile, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.fast import forward, loop, selfcheck, static
from grpo_trainer.rollout.fast.decoder import Decoder
from grpo_trainer.rollout.fast.guard import ARCHITECTURES, decoder_blocker, processors, resolved, settings_blocker
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.settings import BackendChoice, max_new_tokens
from grpo_trainer.rollout.speculative import loop as speculative_loop
from grpo_trainer.rollout.speculative.drafts import INDEX_BYTES_PER_TOKEN, INDEX_CACHE_TOKENS, Drafter, PromptHistory
from grpo_trainer.rollout.speculative.policy import ForwardCost
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
from grpo_trainer.rollout.types import DecodeCounts, PromptBatch, Rollout, special_tokens

__all__ = ["CUDA_CHOICES", "CUDA_DECODE_ENV", "FastBackend"]

logger = logging.getLogger(__name__)

# The decoder's way on CUDA where `FastBackend(cuda=...)` is not given (decision 6): "generate" (decision 5),
# "decoder" (the eager decoder), "compact" or "graphs" (`fast.static`).
CUDA_DECODE_ENV = "GRPO_TRAINER_FAST_CUDA_DECODE"
CUDA_CHOICES = ("generate", "decoder", "compact", "graphs")


@register_backend("fast")
class FastBackend(RolloutBackend):
    """Llama-family models through `fast.decoder`, other architectures through their own forward
    (`fast.forward`), and what neither reproduces through `model.generate`. The capabilities are the decoder's;
    the other tiers leave what they cannot keep as None (`forward.ForwardBackend.capabilities`)."""

    capabilities = Capabilities(sampling_logps=True, layer_outputs=True, sampling_probs=True)

    def __init__(self, cuda: str | None = None, cpu: str = "eager",
                 speculative: SpeculativeSettings | None = None, partial: bool = False) -> None:
        source = f"FastBackend(cuda={cuda!r})"
        if cuda is None:  # decision 6: the static path is opt-in until a GPU measures it
            # decisions 7 and 8: drafts and partial rounds are the decoder's, so asking for them asks for it on CUDA
            cuda = os.environ.get(CUDA_DECODE_ENV, "generate" if speculative is None and not partial else "decoder")
            source = f"{CUDA_DECODE_ENV}={cuda!r}"
        if speculative is not None and cuda == "generate":
            raise ValueError(f"speculative_rollouts=True drafts and verifies inside the fast decoder, but {source} "
                             "samples with model.generate on CUDA; unset it (the eager decoder then serves the "
                             "drafts on CUDA), or set speculative_rollouts=False.")
        if partial and cuda in ("generate", "compact", "graphs"):
            how = "samples with model.generate" if cuda == "generate" else "runs the decoder's static steps"
            raise ValueError(f"partial_rollouts ends a round inside the fast decoder's plain loop, but {source} {how} "
                             "on CUDA; unset it (the eager decoder then serves partial rounds on CUDA), or set "
                             "partial_rollouts=0.")
        if cuda not in CUDA_CHOICES:
            raise ValueError(f"{source}: choose 'generate' or 'decoder', or the decoder's static steps 'compact' "
                             "or 'graphs' (fast.static; opt-in, not yet measured on a GPU).")
        if cpu not in static.MODES:
            raise ValueError(f"FastBackend(cpu={cpu!r}): choose one of {', '.join(map(repr, static.MODES))}.")
        self.cuda, self.cpu = cuda, cpu  # decisions 5 and 6
        # decision 7: drafts, the prompts' earlier completions they read and the forwards' timings, across rounds
        self.speculation = None if speculative is None else (
            speculative, PromptHistory(speculative), ForwardCost() if speculative.policy == "measured" else None)

    @classmethod
    def from_settings(cls, choice: BackendChoice) -> FastBackend:
        return cls(speculative=choice.speculative, partial=choice.partial)

    def state_dict(self) -> dict | None:
        """Decision 7: the history drafts read (a resumed run then drafts, so computes at the widths, as the
        straight run)."""
        return None if self.speculation is None else {"speculative_history": self.speculation[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.speculation is not None and "speculative_history" in state:
            self.speculation[1].load_state_dict(state["speculative_history"])

    def decode_mode(self, device_type: str) -> str:
        """How the decoder steps on this device type (`static.MODES`), where it runs at all."""
        if device_type != "cuda":
            return self.cpu
        return "eager" if self.cuda == "decoder" else self.cuda

    @classmethod
    def memory_profile(cls, choice: BackendChoice, device_type: str) -> MemoryProfile:
        """`model.generate`'s where every rollout goes through it (decision 5), else the decoder's for its
        architectures, with its static steps' mode."""
        backend = cls.from_settings(choice)
        if backend.uses_generate_on(device_type):
            return BACKENDS["generate"].memory_profile(choice, device_type)
        spec = choice.speculative
        return dataclasses.replace(super().memory_profile(choice, device_type),
                                   decoder_architectures=frozenset(ARCHITECTURES),
                                   decode_mode=backend.decode_mode(device_type),
                                   verify_positions=0 if spec is None else spec.max_verify_tokens,
                                   draft_columns=0 if spec is None else spec.max_draft_tokens,
                                   draft_index_bytes_per_token=0 if spec is None else INDEX_BYTES_PER_TOKEN,
                                   draft_history_bytes=0 if spec is None else
                                   4 * spec.history_tokens + INDEX_BYTES_PER_TOKEN * INDEX_CACHE_TOKENS)

    def uses_generate_on(self, device_type: str) -> bool:
        """Whether every rollout on this device type goes through `model.generate` (decision 5): the memory
        planner sizes that path, not the decoder's."""
        return device_type == "cuda" and self.cuda == "generate"

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        S = prompts.ids.shape[1]
        reason = settings_blocker(model, config, S)
        if reason is None and self.uses_generate_on(prompts.ids.device.type):
            reason = "on CUDA model.generate was measured faster than the decoder (decision 5)"
        if reason is not None:
            _refuse_partial(prompts, reason)
            logger.info("generation_backend='fast' falls back to model.generate: %s.", reason)
            return generate_rollout(model, prompts, config)
        lm = causal_lm(model)
        settings = resolved(lm, config)
        reason = decoder_blocker(lm, S + max_new_tokens(settings, S)) or selfcheck.decoder_mismatch(
            lm, prompts, _decode)
        if reason is None:
            mode = self.decode_mode(prompts.ids.device.type)
            if prompts.end is not None and mode != "eager":
                _refuse_partial(prompts, f"the decoder's {mode!r} steps have no early end")
            return _fast_rollout(lm, prompts, settings, capture, mode, self.speculation)
        _refuse_partial(prompts, reason)
        unserved = forward.forward_blocker(lm)
        if unserved is None:
            logger.info("generation_backend='fast' runs the model's own forward: the decoder does not reproduce "
                        "it (%s).", reason)
            return forward.forward_rollout(lm, prompts, settings, capture)
        logger.info("generation_backend='fast' falls back to model.generate: %s; %s.", reason, unserved)
        return generate_rollout(model, prompts, config)


def _fast_rollout(lm: nn.Module, prompts: PromptBatch, config: GenerationConfig, capture: Capture,
                  mode: str = "eager",
                  speculation: tuple[SpeculativeSettings, PromptHistory, ForwardCost | None] | None = None) -> Rollout:
    B, S = prompts.ids.shape
    if speculation is not None:
        _refuse_partial(prompts, "speculative rollouts' verifying loop has no early end")
    decoder_stack = lm.get_decoder()
    embed = decoder_stack.embed_tokens.weight
    vocab = lm.get_output_embeddings().weight.shape[0]
    max_new = max_new_tokens(config, S)
    outputs, probs = capture_.replay_buffers(
        capture, rows=B, prompt_length=S, max_new_tokens=max_new, layers=len(decoder_stack.layers),
        hidden_size=embed.shape[1], vocab_size=vocab, dtype=embed.dtype, device=prompts.ids.device)
    masks = capture_.support_buffer(capture, rows=B, max_new_tokens=max_new, vocab_size=vocab,
                                    device=prompts.ids.device)
    threads = torch.get_num_threads()
    decode_threads = _decode_threads(lm, B) if prompts.ids.device.type == "cpu" else threads
    try:
        torch.set_num_threads(min(threads, decode_threads))
        with torch.inference_mode():
            if speculation is not None and (reason := _speculation_blocker(lm, config, prompts, mode)) is not None:
                logger.info("speculative_rollouts: this round decodes without drafts: %s.", reason)
                speculation = None
            if speculation is None:
                decoded, counts = _decode(lm, config, prompts, outputs, probs, masks, capture.kept_support, mode), None
            else:
                decoded, counts = _speculative_decode(lm, config, prompts, *speculation, outputs, probs, masks,
                                                      capture.kept_support)
    finally:
        torch.set_num_threads(threads)
    return dataclasses.replace(loop.to_rollout(prompts, config, decoded, probs, masks, outputs), decode=counts)


def _refuse_partial(prompts: PromptBatch, reason: str) -> None:
    """Partial rollouts' early end (`PromptBatch.end`) is the plain decoder loop's: a round the decoder cannot serve
    is refused with the reason, never decoded to its longest row unannounced."""
    if prompts.end is not None:
        raise ValueError(f"partial_rollouts ends a round inside the fast decoder's plain loop, which cannot decode "
                         f"this one: {reason}. Set partial_rollouts=0, or use a model and sampling settings the "
                         "decoder serves (docs/PARTIAL.md).")


def _decode_threads(lm: nn.Module, rows: int) -> int:
    """CPU threads worth using for decode steps: one per ~GFLOP of a step (2 x rows x parameters). A small
    model's step is a chain of tiny kernels where intra-op threads only add synchronisation."""
    flops = 2 * rows * sum(p.numel() for p in lm.parameters())
    return max(1, flops // 10**9)


def _decode(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, outputs: Tensor | None = None,
            probs: Tensor | None = None, masks: Tensor | None = None, renormalise: bool = False,
            mode: str = "eager") -> loop.Decoded:
    """`loop.run` over the decoder: completion tokens, log-probs and entropies `[B, T']` (and what the loop keeps
    of a truncated sampler). Fills the given buffers: every layer's output `outputs[:, :, :S + T']`, the tempered
    softmax `probs[:, :T']`, the packed kept supports `masks[:, :T']`. `mode`: how decode steps run
    (`static.MODES`: every row every step, or finished rows compacted out, or that at static shapes with CUDA
    graphs)."""
    prompt_ids, prompt_mask = prompts.ids, prompts.mask
    B, S = prompt_ids.shape
    max_new = max_new_tokens(config, S)
    decoder = Decoder(lm, B, S + max_new, outputs)
    device = prompt_ids.device
    real = prompt_mask.long().cumsum(1)  # [B, S]
    scores = _prefill(decoder, prompts)  # [B, V]

    cos, sin = decoder.rotation_tables(real[:, -1:] + torch.arange(max_new, device=device))  # [B, T, 1, D]
    # Additive key mask [B, 1, 1, L] (0 or -inf): SDPA takes it as is, where a bool mask is converted every call.
    key_mask = torch.zeros(B, 1, 1, S + max_new, dtype=decoder.embed.dtype, device=device)
    key_mask[:, 0, 0, :S].masked_fill_(prompt_mask == 0, float("-inf"))

    def next_scores(tokens: Tensor, t: int) -> Tensor:
        return decoder.logits(decoder.step(tokens, S + t, cos[:, t], sin[:, t], key_mask[..., :S + t + 1]))

    if mode != "eager":
        eos_ids = torch.tensor(special_tokens(config)[0], device=device, dtype=torch.long)
        next_scores = static.StaticSteps(decoder, S, cos, sin, key_mask, eos_ids, mode == "graphs").next_scores

    sequences = torch.cat([prompt_ids, prompt_ids.new_full((B, max_new), special_tokens(config)[1])], 1)
    return loop.run(lm, config, prompts, scores, next_scores, sequences, max_new, probs, masks, renormalise)


def _prefill(decoder: Decoder, prompts: PromptBatch) -> Tensor:
    """The P distinct prompts prefilled once, each row given its prompt's keys and values (decision 2); the logits
    after each row's prompt `[B, V]`. A padding query attends to itself only, so no softmax row is empty."""
    B, S = prompts.ids.shape
    first, group = prompts.distinct_rows()
    ids, mask = prompts.ids[first], prompts.mask[first].bool()  # [P, S]
    positions = (prompts.mask[first].long().cumsum(1) - 1).masked_fill(~mask, 0)  # as generate's position ids
    eye = torch.eye(S, dtype=torch.bool, device=ids.device)
    allowed = (torch.ones_like(eye).tril() & mask[:, None, None, :]) | eye  # [P, 1, S, S]
    last_hidden = decoder.forward(ids, 0, *decoder.rotation_tables(positions), allowed)  # [P, E]
    if first.numel() < B:  # each row takes its prompt's keys and values (the gather copies before writing)
        for cache in (*decoder.keys, *decoder.values):
            cache[:, :, :S] = cache[group, :, :S]
        if decoder.outputs is not None:
            decoder.outputs[:, :, :S] = decoder.outputs[group, :, :S]
    return decoder.logits(last_hidden)[group]


def _speculation_blocker(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, mode: str) -> str | None:
    """Why this round cannot decode with drafts (decision 7), or None."""
    if mode != "eager":
        return f"the decoder's {mode!r} steps run one position per row (the verifying forward compacts by itself)"
    return speculative_loop.blocker(processors(lm, config, prompts.ids, prompts.mask))


def _speculative_decode(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, settings: SpeculativeSettings,
                        history: PromptHistory, cost: ForwardCost | None, outputs: Tensor | None = None,
                        probs: Tensor | None = None, masks: Tensor | None = None,
                        renormalise: bool = False) -> tuple[loop.Decoded, DecodeCounts]:
    """`speculative.loop.run` over the decoder (decision 7): its cache `max_draft_tokens` columns longer, for the
    draft positions of a row's last forward."""
    B, S = prompts.ids.shape
    max_new = max_new_tokens(config, S)
    decoder = Decoder(lm, B, S + max_new + settings.max_draft_tokens, outputs)
    # A verifying forward reads columns past a shorter row's own (masked): zeros, never uninitialised memory, which
    # may hold a NaN, and a NaN value times a zero attention weight is NaN.
    for cache in (*decoder.keys, *decoder.values):
        cache[:, :, S:].zero_()
    scores = _prefill(decoder, prompts)
    first, group = prompts.distinct_rows()
    prompt_tokens = [tuple(prompts.ids[r][prompts.mask[r].bool()].tolist()) for r in first.tolist()]
    drafter = Drafter(settings, group.tolist(), prompt_tokens, history)
    return speculative_loop.run(lm, decoder, config, prompts, scores, processors(lm, config, prompts.ids, prompts.mask),
                                max_new, settings, drafter, cost, probs, masks, renormalise)
