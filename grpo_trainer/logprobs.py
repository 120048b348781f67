"""Per-token log-probabilities (and entropies) of completion tokens under a causal LM, memory-lean.

A naive `log_softmax(model(x).logits)` holds float32 `[B, S+T, V]` logits, which for a 32k-152k vocabulary
dominates the step's memory. Here the model runs with `logits_to_keep=1` and returns its final hidden states;
only the `T` completion positions are projected through the LM head, `chunk_size` rows at a time, each chunk
upcast to float32 on its own. With gradients on, each chunk is recomputed in the backward pass
(activation checkpointing), so no `[B, T, V]` tensor is ever kept: peak extra memory is one chunk's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["completion_logprobs", "token_logprobs"]


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of `tokens` and entropy of each row's distribution, in float32.

    Args: logits `[N, V]` (any float dtype), tokens `[N]`. Returns two `[N]` tensors.
    """
    logits = logits.float() / temperature
    logsumexp = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logsumexp
    probs = torch.softmax(logits, dim=-1)
    entropy = logsumexp - (probs * logits).sum(-1)
    return chosen, entropy


def _head_logprobs(head: nn.Module, hidden: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    return token_logprobs(head(hidden), tokens, temperature)


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the last `completion_length` tokens of each row.

    Args:
        model: a causal LM (a wrapper such as DDP, DeepSpeed or PEFT is fine: it is called as is).
        input_ids: `[B, S+T]` prompt (left-padded) followed by the completion (right-padded), T = completion_length.
        attention_mask: `[B, S+T]`.
        temperature: the sampling temperature; logits are divided by it, as they were when sampling.
        chunk_size: completion positions (rows of the flattened `[B*T, H]` hidden states) projected at once.
        with_entropy: also return the per-token entropy of the (tempered) distribution.
    Returns:
        logps `[B, T]` float32 and entropies `[B, T]` float32 (or None).
    """
    # Positions count real tokens only, as in `generate`, so left padding does not shift them.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1,
                output_hidden_states=True, use_cache=False)
    # Position t predicts token t+1: the hidden states S-1 .. S+T-2 score completion tokens S .. S+T-1.
    hidden = out.hidden_states[-1][:, -completion_length - 1 : -1]  # [B, T, H]
    tokens = input_ids[:, -completion_length:]  # [B, T]
    head = _output_head(model)
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)  # [B*T, H], [B*T]
    logps, entropies = [], []
    for start in range(0, flat_tokens.numel(), chunk_size):
        args = (head, flat_hidden[start : start + chunk_size], flat_tokens[start : start + chunk_size], temperature)
        if torch.is_grad_enabled() and flat_hidden.requires_grad:
            chosen, entropy = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            chosen, entropy = _head_logprobs(*args)
        logps.append(chosen)
        entropies.append(entropy.detach())  # the entropy is a metric/mask, never differentiated
    shape = tokens.shape
    logps_t = torch.cat(logps).view(shape)
    return logps_t, (torch.cat(entropies).view(shape) if with_entropy else None)


def _output_head(model: nn.Module) -> nn.Module:
    """The LM head of a model behind any wrappers (DDP `.module`, DeepSpeed engine, PEFT)."""
    while not hasattr(model, "get_output_embeddings") and hasattr(model, "module"):
        model = model.module
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head); a causal LM is required.")
    return head
