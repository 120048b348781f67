"""The fast backend: each distinct prompt prefilled once, a preallocated KV cache, a tight decode loop.

`model.generate` spends most of a small model's rollout in per-token machinery rather than in arithmetic: mask
builders, cache objects, output dataclasses and stopping criteria.

Decisions:

1. `model.generate` stays the reference: any model or setting `guard.fast_path_blocker` does not clear falls back
   to it, and the reason is logged.
2. Distinct prompts are found once (consecutive identical rows); each is prefilled once and its keys/values are
   copied into the rows of its G completions. Positions count real tokens only, as `generate`'s do.
3. The loop stops as soon as every row has emitted an EOS token; rows that finished are padded. Each token's
   log-prob and entropy under the full tempered softmax are kept (`Rollout.sampling_logps`). On request
   (`capture.Capture`) the loop also keeps every layer's output and every step's softmax, for `replay`.
4. The loop runs in inference mode (no autograd bookkeeping per operation); its outputs are cloned out of it, and
   replay buffers are allocated outside it and filled inside, so the training forward can use them uncopied.

Shapes: `B` rows, `P` distinct prompts, `S` prompt tokens, `T` new tokens, `L = S + T` cache columns, `E` hidden
size, `V` vocabulary.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from grpo_trainer.rollout import capture as capture_
from grpo_trainer.rollout.backend import Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.fast.decoder import Decoder
from grpo_trainer.rollout.fast.guard import fast_path_blocker, processors, resolved
from grpo_trainer.rollout.fast.sampling import sample_from_logits, sample_from_probs
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.rollout.types import PromptBatch, Rollout, completion_mask
from grpo_trainer.runtime.models import causal_lm

__all__ = ["FastBackend"]

logger = logging.getLogger(__name__)


@register_backend("fast")
class FastBackend(RolloutBackend):
    """Llama-family models through `fast.decoder`; everything else through `model.generate`."""

    capabilities = Capabilities(sampling_logps=True, layer_outputs=True, sampling_probs=True)

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        reason = fast_path_blocker(model, config, prompts.ids.shape[1])
        if reason is not None:
            logger.info("generation_backend='fast' falls back to model.generate: %s.", reason)
            return generate_rollout(model, prompts, config)
        return _fast_rollout(causal_lm(model), prompts, resolved(causal_lm(model), config), capture)


def _fast_rollout(lm: nn.Module, prompts: PromptBatch, config: GenerationConfig, capture: Capture) -> Rollout:
    eos = config.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]  # generate's fallback
    B, S = prompts.ids.shape
    decoder_stack = lm.get_decoder()
    embed = decoder_stack.embed_tokens.weight
    outputs, probs = capture_.replay_buffers(
        capture, rows=B, prompt_length=S, max_new_tokens=max_new_tokens(config, S),
        layers=len(decoder_stack.layers), hidden_size=embed.shape[1],
        vocab_size=lm.get_output_embeddings().weight.shape[0], dtype=embed.dtype, device=prompts.ids.device)
    threads = torch.get_num_threads()
    decode_threads = _decode_threads(lm, B) if prompts.ids.device.type == "cpu" else threads
    try:
        torch.set_num_threads(min(threads, decode_threads))
        with torch.inference_mode():
            completion_ids, logps, entropy = _decode(lm, config, prompts, eos, pad, outputs, probs)
    finally:
        torch.set_num_threads(threads)
    completion_ids, logps, entropy = completion_ids.clone(), logps.clone(), entropy.clone()
    T = completion_ids.shape[1]  # the used part of the buffers (views made out here)
    outputs = None if outputs is None else outputs[:, :, :S + T]
    probs = None if probs is None else probs[:, :T]
    mask, truncated = completion_mask(completion_ids, eos)
    completion_ids = completion_ids.masked_fill(mask == 0, pad)
    return Rollout(prompts.ids, prompts.mask, completion_ids, mask, truncated, logps, entropy, probs, outputs)


def _distinct_rows(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the first row of each run of identical consecutive rows `[P]`, and each row's run `[B]`."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [B-1]
    starts = torch.cat([same.new_ones(1), ~same])  # [B]
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


def _decode_threads(lm: nn.Module, rows: int) -> int:
    """CPU threads worth using for decode steps: one per ~GFLOP of a step (2 x rows x parameters). A small
    model's step is a chain of tiny kernels where intra-op threads only add synchronisation."""
    flops = 2 * rows * sum(p.numel() for p in lm.parameters())
    return max(1, flops // 10**9)


def _choose(scores: Tensor, sequences: Tensor, processor_list: LogitsProcessorList,
            config: GenerationConfig, temperature: float, probs_out: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Next tokens `[B]`, and their log-probs and the entropies `[B]` under the full tempered softmax of the raw
    logits `scores` `[B, V]` (also written to `probs_out` when given). When the only processor is the temperature
    (the trainer's default settings), the distribution sampled from is that softmax, computed once."""
    log_p = torch.log_softmax(scores if temperature == 1.0 else scores / temperature, dim=-1)  # [B, V]
    probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
    if config.do_sample and all(type(p) is TemperatureLogitsWarper for p in processor_list):
        tokens = sample_from_probs(probs)
    else:
        tokens = sample_from_logits(processor_list(sequences, scores), config.do_sample)
    return tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, log_p)


def _decode(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, eos: list[int], pad: int,
            outputs: Tensor | None = None, probs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Completion tokens `[B, T']` (T' <= max new tokens: the loop stops once every row has ended), and their
    log-probs and entropies `[B, T']` under the full tempered softmax (`Rollout.sampling_logps`).
    Fills the given buffers: every layer's output `outputs[:, :, :S + T']`, that softmax `probs[:, :T']`."""
    prompt_ids, prompt_mask = prompts.ids, prompts.mask
    B, S = prompt_ids.shape
    max_new = max_new_tokens(config, S)
    decoder = Decoder(lm, B, S + max_new, outputs)
    device = prompt_ids.device
    eos_ids = torch.tensor(eos, device=device, dtype=torch.long)
    processor_list = processors(lm, config, prompt_ids, prompt_mask)
    real = prompt_mask.long().cumsum(1)  # [B, S]
    first, group = _distinct_rows(prompt_ids, prompt_mask)

    # Prefill the P distinct prompts. A padding query attends to itself only, so no softmax row is empty.
    ids, mask = prompt_ids[first], prompt_mask[first].bool()  # [P, S]
    positions = (real[first] - 1).masked_fill(~mask, 0)  # as generate's position ids
    eye = torch.eye(S, dtype=torch.bool, device=device)
    allowed = (torch.ones_like(eye).tril() & mask[:, None, None, :]) | eye  # [P, 1, S, S]
    last_hidden = decoder.forward(ids, 0, *decoder.rotation_tables(positions), allowed)  # [P, E]
    if first.numel() < B:  # each row takes its prompt's keys and values (the gather copies before writing)
        for cache in (*decoder.keys, *decoder.values):
            cache[:, :, :S] = cache[group, :, :S]
        if decoder.outputs is not None:
            decoder.outputs[:, :, :S] = decoder.outputs[group, :, :S]
    scores = decoder.logits(last_hidden)[group]  # [B, V]

    cos, sin = decoder.rotation_tables(real[:, -1:] + torch.arange(max_new, device=device))  # [B, T, 1, D]
    # Additive key mask [B, 1, 1, L] (0 or -inf): SDPA takes it as is, where a bool mask is converted every call.
    key_mask = torch.zeros(B, 1, 1, S + max_new, dtype=decoder.embed.dtype, device=device)
    key_mask[:, 0, 0, :S].masked_fill_(prompt_mask == 0, float("-inf"))
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((B, max_new), pad)], 1)  # [B, L]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    logps, entropy = torch.zeros(2, B, max_new, device=device)  # [B, T] each
    temperature = config.temperature if config.do_sample and config.temperature is not None else 1.0
    for t in range(max_new):
        tokens, logps[:, t], entropy[:, t] = _choose(scores, sequences[:, :S + t], processor_list, config,
                                                     temperature, None if probs is None else probs[:, t])
        tokens.masked_fill_(finished, pad)  # [B]
        sequences[:, S + t] = tokens
        finished |= torch.isin(tokens, eos_ids)
        if t == max_new - 1 or bool(finished.all()):
            break
        hidden = decoder.step(tokens, S + t, cos[:, t], sin[:, t], key_mask[..., :S + t + 1])
        scores = decoder.logits(hidden)
    return sequences[:, S:S + t + 1], logps[:, :t + 1], entropy[:, :t + 1]
