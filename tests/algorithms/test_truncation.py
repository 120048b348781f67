"""The kept support of top-k / top-p / min-p sampling: transformers' warpers exactly, the kept mass, the packed form."""

import math

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_trainer.algorithms.truncation import Truncation, kept_support, log_kept_mass, pack, unpack, with_tokens

# probabilities 0.4, 0.3, 0.2, 0.1 over a 4-token vocabulary
LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


@pytest.mark.parametrize(("truncation", "kept"), [
    (Truncation(top_k=2), [0, 1]),  # the two largest
    # top_p 0.65: ascending 0.1, 0.2, 0.3, 0.4 with cumulative sums 0.1, 0.3, 0.6, 1.0; drop those <= 0.35
    (Truncation(top_p=0.65), [0, 1]),
    (Truncation(top_p=0.75), [0, 1, 2]),  # drop cumulative sums <= 0.25: only 0.1
    (Truncation(min_p=0.6), [0, 1]),  # drop p < 0.6 x 0.4 = 0.24
    (Truncation(top_p=0.01), [0]),  # min_tokens_to_keep = 1: the most likely token stays
    (Truncation(top_p=0.01, min_tokens_to_keep=2), [0, 1]),
    # top_k 3 first (0.4, 0.3, 0.2 renormalised: 4/9, 3/9, 2/9), then top_p 0.7 on those: drop cumulative
    # sums <= 0.3: 2/9 = 0.22 -> kept 0, 1
    (Truncation(top_k=3, top_p=0.7), [0, 1]),
])
def test_kept_support_by_hand(truncation, kept):
    assert kept_support(LOGITS, truncation)[0].nonzero().squeeze(1).tolist() == kept


def test_ties_at_the_top_k_boundary_are_all_kept():
    # TopKLogitsWarper removes only scores below the k-th largest: three tied logits at k = 2 all stay
    assert kept_support(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), Truncation(top_k=2)).tolist() == [[True] * 3 + [False]]


def test_processed_minus_full_log_probs_is_minus_the_log_kept_mass():
    """top_k = 2 keeps 0.4 + 0.3 = 0.7: the processed log-prob of token 0 is log(0.4 / 0.7), the full one log 0.4,
    so processed - full = -log 0.7 = 0.356675, for every kept token."""
    kept = kept_support(LOGITS, Truncation(top_k=2))
    mass = log_kept_mass(LOGITS, kept)
    torch.testing.assert_close(mass, torch.tensor([math.log(0.7)]))
    processed = torch.log_softmax(TopKLogitsWarper(top_k=2)(None, LOGITS.clone()), -1)
    full = torch.log_softmax(LOGITS, -1)
    torch.testing.assert_close(processed[0, :2] - full[0, :2], -mass.expand(2))


@pytest.mark.parametrize("settings", [
    dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=20, top_p=0.8), dict(top_p=0.95, min_p=0.05),
    dict(top_k=7, top_p=0.5, min_p=0.2), dict(top_k=1), dict(top_p=0.3, temperature=0.7),
    dict(top_k=50, min_p=0.02, temperature=1.3),
])
def test_kept_support_is_generates_own_warpers_in_their_order(settings):
    """Against the processors `generate` builds for the same GenerationConfig (temperature first), on random logits
    with ties: the kept support is exactly the set of finite scores they leave."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=generator) * 3
    logits[:, 10:14] = logits[:, 10:11]  # ties
    temperature = settings.pop("temperature", 1.0)
    config = GenerationConfig(do_sample=True, temperature=temperature, **settings)
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    for cls, key, name in ((TopKLogitsWarper, "top_k", "top_k"), (TopPLogitsWarper, "top_p", "top_p"),
                           (MinPLogitsWarper, "min_p", "min_p")):
        if key in settings:
            processors.append(cls(**{name: settings[key]}))
    expected = torch.isfinite(processors(None, logits.clone()))
    truncation = Truncation.of(config)
    assert truncation.active
    assert torch.equal(kept_support(logits / temperature, truncation), expected)


def test_truncation_of_a_generation_config():
    assert Truncation.of(GenerationConfig(do_sample=True, top_k=0, top_p=1.0)).active is False
    assert Truncation.of(GenerationConfig(do_sample=False, top_k=50)) == Truncation()
    assert Truncation.of(GenerationConfig(do_sample=True, top_k=50, top_p=0.9, min_p=0.05)) == \
        Truncation(50, 0.9, 0.05)


def test_with_tokens_adds_the_sampled_token():
    kept = torch.tensor([[True, False, False], [False, True, False]])
    assert with_tokens(kept, torch.tensor([2, 1])).tolist() == [[True, False, True], [False, True, False]]


@pytest.mark.parametrize("vocab", [1, 8, 13, 100])
def test_pack_round_trips(vocab):
    kept = torch.rand(3, 5, vocab, generator=torch.Generator().manual_seed(vocab)) > 0.5
    packed = pack(kept)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, -(-vocab // 8))
    assert torch.equal(unpack(packed, vocab), kept)
    # bit v % 8 of byte v // 8 is token v: token 9 alone is byte 1, bit 1
    if vocab >= 10:
        one = torch.zeros(vocab, dtype=torch.bool)
        one[9] = True
        assert pack(one)[1] == 2 and pack(one).sum() == 2
