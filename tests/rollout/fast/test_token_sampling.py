"""Drawing tokens: the categorical distribution (one and two levels), transformers' logits processors, and the
log-probs and entropies the rollout keeps for the loss."""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList

from grpo_trainer.rollout.fast import loop, sampling
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import (
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    model_of_kind,
)


def test_sampling_draws_the_softmax_distribution():
    # probabilities [.5, .3, .15, .05, 0]; with N = 40000 draws the standard error of a frequency is at most
    # sqrt(.25 / 40000) = .0025, so 5 standard errors is .0125. The -inf token must never be drawn.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(40000, 5).contiguous()  # log 0 = -inf: a filtered token
    torch.manual_seed(0)
    draws = sampling.sample_from_logits(logits, do_sample=True)
    frequencies = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert frequencies[4] == 0
    torch.testing.assert_close(frequencies, probs, atol=0.0125, rtol=0)
    assert torch.equal(sampling.sample_from_logits(logits[:2], do_sample=False), torch.tensor([0, 0]))


def test_two_level_draw_across_blocks_keeps_the_distribution():
    """V = 10 spans blocks of 4 (two full blocks and a tail of 2). Probabilities: block 0 = [.1, 0, .2, 0],
    block 1 all 0 (never chosen), tail = [.3, .4]. Block masses .3, 0, .7; inside block 0 the shares are
    1/3, 0, 2/3, 0, so token 0 comes out with .3 x 1/3 = .1 and token 2 with .3 x 2/3 = .2: the categorical
    distribution. N = 40000 draws: 5 standard errors <= .0125."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.4])
    torch.manual_seed(0)
    draws = sampling.sample_from_probs(probs.expand(40000, 10).contiguous(), block=4, one_level_max=0)
    frequencies = torch.bincount(draws, minlength=10).float() / draws.numel()
    assert frequencies[probs == 0].sum() == 0
    torch.testing.assert_close(frequencies, probs, atol=0.0125, rtol=0)
    # one block (V <= block) is a single inversion
    one = sampling.sample_from_probs(torch.tensor([[0.0, 1.0, 0.0]]), block=4, one_level_max=0)
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
    tokens, logps, entropy = loop.choose(logits, torch.zeros(N, 1, dtype=torch.long), processors, config, 0.5)[:3]
    frequencies = torch.bincount(tokens, minlength=4).float() / N
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.0125, rtol=0)
    full = torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365  # tempered, unfiltered
    torch.testing.assert_close(logps, full.log()[tokens], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.full((N,), float(-(full * full.log()).sum())), atol=1e-5, rtol=0)


def test_every_logits_processor_generate_builds_is_applied(tokenizer):
    """Settings resolved and processors built by transformers, run on the same sequences as in generate: greedy
    tokens stay identical under an n-gram ban, a repetition penalty and a minimum length."""
    model = model_of_kind("llama", tokenizer)
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer, no_repeat_ngram_size=2, repetition_penalty=1.5, min_new_tokens=3)
    assert fast_path_blocker(model, config, prompts.ids.shape[1]) is None
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
        plain = generate_rollout(model, prompts, greedy_config(tokenizer))
    assert_same_rollout(fast_rollout(model, prompts, config), reference)
    assert not torch.equal(reference.completion_ids, plain.completion_ids)  # the processors changed the tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2.5-0.5b"])
def test_top_k_one_sampling_is_greedy(tokenizer, kind):
    model = model_of_kind(kind, tokenizer)
    prompts = grouped_prompts(tokenizer)
    greedy = fast_rollout(model, prompts, greedy_config(tokenizer))
    assert_same_rollout(fast_rollout(model, prompts, greedy_config(tokenizer, do_sample=True, top_k=1)), greedy)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5-0.5b"])
def test_sampling_matches_generate_in_distribution(tokenizer, kind):
    """Sampled tokens differ from generate's for a seed (different random stream), but the first token's
    frequencies over many rows of one prompt agree. A random model's tempered distribution is nearly uniform;
    transformers' default top_k=50 (the config leaves top_k unset) keeps 50 tokens, ~40 draws each in 2000 rows,
    so two samples differ by ~sqrt(2 * 40) ~ 9 counts per token: a total-variation distance of ~0.09. Without the
    top-k filter (or with a wrong distribution) it would be ~0.44."""
    model = model_of_kind(kind, tokenizer)
    prompts = tokenize_prompts(tokenizer, ["copy 12:"] * 2000, None)
    config = greedy_config(tokenizer, do_sample=True, max_new_tokens=1, temperature=0.8, top_k=None)
    torch.manual_seed(0)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config).completion_ids[:, 0]
    fast = fast_rollout(model, prompts, config).completion_ids[:, 0]
    V = len(tokenizer)
    distance = 0.5 * (torch.bincount(fast, minlength=V) - torch.bincount(reference, minlength=V)).abs().sum() / 2000
    assert distance < 0.15
    assert len(torch.unique(fast)) <= 50


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5-0.5b"])
def test_sampling_logps_are_the_training_forwards_values(tokenizer, kind):
    """The sampler keeps log softmax(logits / T)[token] of the full distribution (not the top-k-filtered one
    it drew from), which is what the training forward computes for the same tokens."""
    from grpo_trainer.modeling.logprobs import completion_logprobs

    model = model_of_kind(kind, tokenizer)
    prompts = grouped_prompts(tokenizer)
    torch.manual_seed(0)
    rollout = fast_rollout(model, prompts, greedy_config(tokenizer, do_sample=True, temperature=0.7, top_k=5))
    with torch.no_grad():
        out = completion_logprobs(
            model, torch.cat([prompts.ids, rollout.completion_ids], 1),
            torch.cat([prompts.mask, rollout.completion_mask], 1),
            rollout.completion_ids.shape[1], temperature=0.7, with_entropy=True)
    logps, entropy = out.logps, out.entropy
    active = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampler.logps[active], logps[active], atol=1e-5, rtol=0)
    torch.testing.assert_close(rollout.sampler.entropy[active], entropy[active], atol=1e-5, rtol=0)
