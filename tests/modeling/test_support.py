"""Log-probs over the sampler's kept support (top-k / top-p / min-p): values, entropies and gradients equal a dense
truncated-softmax reference on every path of `completion_logprobs` (the hand-written head, the checkpointed
per-chunk head, the model's own logits), with the support recomputed or given packed; the log kept mass is measured
either way."""

import pytest
import torch
from torch import nn

from grpo_trainer.algorithms.truncation import Truncation, kept_support, pack, with_tokens
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.modeling.support import KeptSupport
from tests.modeling.test_logprobs import T, _assert_same_grads, _grads, batch

TEMPERATURE = 0.8


def dense(model, ids, mask, truncation, renormalise=True, packed=None):
    """Full `[B, T, V]` logits, each position's support (given, or the rules on these logits, plus the token),
    then log_softmax over it: log-probs, entropies, log kept masses."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -T - 1:-1]
    z = logits.float() / TEMPERATURE  # [B, T, V]
    tokens = ids[:, -T:]
    flat = z.reshape(-1, z.shape[-1])
    if packed is None:
        kept = kept_support(flat.detach(), truncation)
    else:
        from grpo_trainer.algorithms.truncation import unpack

        kept = unpack(packed, flat.shape[-1])
    kept = with_tokens(kept, tokens.reshape(-1)).view_as(z)
    masked = z.masked_fill(~kept, -torch.inf)
    log_p = torch.log_softmax(masked if renormalise else z, -1)
    chosen = log_p.gather(-1, tokens[..., None])[..., 0]
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
    mass = torch.logsumexp(masked.detach(), -1) - torch.logsumexp(z.detach(), -1)
    return chosen, entropy, mass


class _Hooked(nn.Linear):
    """A head the hand-written path does not take (not a plain nn.Linear): scored through the checkpointed chunks."""


@pytest.mark.parametrize("head", ["plain", "checkpointed"])
@pytest.mark.parametrize(("truncation", "chunk_size"), [(Truncation(top_k=5), 4), (Truncation(top_p=0.3), 7),
                                                        (Truncation(top_k=20, min_p=0.3), 1000)])
@pytest.mark.parametrize("renormalise", [True, False])
def test_values_and_gradients_equal_a_dense_truncated_softmax(tiny_model, tokenizer, head, truncation, chunk_size,
                                                              renormalise):
    ids, mask = batch(tokenizer)
    if head == "checkpointed":
        original = tiny_model.lm_head
        tiny_model.lm_head = _Hooked(original.in_features, original.out_features, bias=False)
        tiny_model.lm_head.weight = original.weight
    generator = torch.Generator().manual_seed(5)
    w_logp, w_entropy = torch.randn(3, T, generator=generator), torch.randn(3, T, generator=generator)
    support = KeptSupport(truncation, renormalise=renormalise)
    out = completion_logprobs(tiny_model, ids, mask, T, TEMPERATURE, chunk_size, with_entropy=True, support=support)
    ours = _grads(tiny_model, (out.logps * w_logp).sum() + (out.entropy * w_entropy).sum())
    logps, entropy, mass = dense(tiny_model, ids, mask, truncation, renormalise)
    active = mask[:, -T:].bool()
    torch.testing.assert_close(out.logps[active], logps[active].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[active], entropy[active].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.log_kept_mass[active], mass[active], atol=1e-5, rtol=0)
    assert (out.log_kept_mass[active] < 0).any()  # the truncation did cut
    _assert_same_grads(ours, _grads(tiny_model, (logps * w_logp).sum() + (entropy * w_entropy).sum()))


def test_a_given_packed_support_is_used_as_is(tiny_model, tokenizer):
    """The sampler's support wins over the rules: here a support the rules would never give (the 3 tokens after
    each sampled one), packed; the collected support of a forward is what it used."""
    ids, mask = batch(tokenizer)
    V = tiny_model.config.vocab_size
    tokens = ids[:, -T:].reshape(-1)
    kept = torch.zeros(tokens.numel(), V, dtype=torch.bool)
    for offset in range(1, 4):
        kept[torch.arange(tokens.numel()), (tokens + offset) % V] = True
    packed = pack(kept)
    support = KeptSupport(Truncation(top_k=2), packed=packed, collect=True)
    out = completion_logprobs(tiny_model, ids, mask, T, TEMPERATURE, 5, with_entropy=True, support=support)
    logps, entropy, mass = dense(tiny_model, ids, mask, Truncation(top_k=2), packed=packed)
    torch.testing.assert_close(out.logps, logps.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, entropy.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.log_kept_mass, mass, atol=1e-5, rtol=0)
    # 4 tokens per position: the 3 given and the sampled one
    from grpo_trainer.algorithms.truncation import unpack

    assert out.sampling_mask.shape == (3, T, -(-V // 8))
    assert (unpack(out.sampling_mask, V).sum(-1) == 4).all()


def test_without_truncation_nothing_changes(tiny_model, tokenizer):
    ids, mask = batch(tokenizer)
    plain = completion_logprobs(tiny_model, ids, mask, T, TEMPERATURE, 5, with_entropy=True)
    off = completion_logprobs(tiny_model, ids, mask, T, TEMPERATURE, 5, with_entropy=True,
                              support=KeptSupport(Truncation(top_k=10_000)))  # keeps the whole vocabulary
    torch.testing.assert_close(off.logps, plain.logps, atol=1e-6, rtol=0)
    torch.testing.assert_close(off.log_kept_mass, torch.zeros(3, T), atol=1e-6, rtol=0)
