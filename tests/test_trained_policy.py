"""The trained-policy fixture (`tests/trained_policy.py`) stays useful: served by the fast decoder, siblings that
share spans, learnt heavy-tailed lengths, a high reward. Each test samples from the built model (built once, then
loaded from the cache) with `model.generate`, seeded, so the numbers are the same on every run of one machine."""

import math
import statistics
import threading

import pytest
import torch
from transformers import GenerationConfig

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests import trained_policy as fixture
from tests.helpers import fast_path_blocker, fast_rollout
from tests.trained_policy import (
    TEMPLATES,
    Recipe,
    completion_text,
    countdown_dataset,
    countdown_reward,
    prompt_text,
    sample,
    sibling_hit_rate,
    trained_policy,
)


@pytest.fixture(scope="session")
def policy():
    return trained_policy()


def test_the_fast_decoder_serves_it_and_reproduces_generate(policy):
    prompts = [prompt_text(n) for n in (3, 17, 42)]
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=512,
                              pad_token_id=policy.tokenizer.pad_token_id,
                              eos_token_id=policy.model.generation_config.eos_token_id)
    batch = tokenize_prompts(policy.tokenizer, prompts, None)
    assert fast_path_blocker(policy.model, config, batch.ids.shape[1]) is None
    greedy = GenerationConfig(**{**config.to_diff_dict(), "do_sample": False, "max_new_tokens": 160})
    rollout = fast_rollout(policy.model, batch, greedy)
    fast = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    reference = sample(policy, prompts, None, max_new_tokens=160)
    eos = policy.tokenizer.eos_token_id
    assert [row[:-1] if row and row[-1] == eos else row for row in fast] == reference


def test_siblings_share_spans(policy):
    """G=8 completions of one prompt at temperature 1.0: earlier siblings draft most of each one's tokens (measured
    0.81 over these prompts; a random-weight model's siblings share almost nothing)."""
    rates = [sibling_hit_rate(sample(policy, [prompt_text(n)] * 8, 1.0, seed=n)) for n in (6, 13, 24, 37)]
    assert statistics.mean(rates) >= 0.6, rates
    assert min(rates) >= 0.4, rates


def test_lengths_are_heavy_tailed_and_set_by_the_prompt(policy):
    """One completion at temperature 1.0 for each of 256 prompts, 512 new tokens at most (measured: median 31,
    p95 142, max 466 tokens; log-log correlation with the start 0.89; 99% of the lengths a template's exact one)."""
    dataset = countdown_dataset(256, seed=1)
    lengths = [len(c) for c in sample(policy, dataset["prompt"], 1.0, seed=0)]
    ordered = sorted(lengths)
    median, p95 = statistics.median(ordered), ordered[int(0.95 * len(ordered))]
    assert p95 / median >= 3, (median, p95)
    assert max(lengths) >= 300, max(lengths)
    # The length is the prompt's: its start's, through the template the completion picked.
    logs = [math.log(n + 1) for n in dataset["start"]], [math.log(max(1, n)) for n in lengths]
    assert statistics.correlation(*logs) >= 0.8
    exact = [any(length == len(completion_text(n, t)) for t in TEMPLATES)  # one token a character
             for n, length in zip(dataset["start"], lengths)]
    assert statistics.mean(exact) >= 0.9


def test_greedy_completions_earn_the_reward_random_weights_do_not(policy):
    dataset = countdown_dataset(64, seed=2)
    texts = policy.tokenizer.batch_decode(sample(policy, dataset["prompt"], None))
    rewards = countdown_reward(dataset["prompt"], texts, start=dataset["start"])
    assert statistics.mean(rewards) >= 0.9, rewards
    random_model = make_tiny_model(policy.tokenizer, hidden_size=policy.recipe.hidden_size,
                                   num_layers=policy.recipe.num_layers, num_heads=policy.recipe.num_heads)
    random_policy = fixture.TrainedPolicy(random_model, policy.tokenizer, policy.recipe, policy.path, 0.0)
    texts = policy.tokenizer.batch_decode(sample(random_policy, dataset["prompt"][:16], None, max_new_tokens=64))
    assert statistics.mean(countdown_reward(dataset["prompt"][:16], texts)) < 0.1


def test_the_reward_reads_every_template_and_gives_partial_credit():
    prompts = [prompt_text(12)] * (len(TEMPLATES) + 2)
    completions = [completion_text(12, t) for t in TEMPLATES] + [completion_text(12, "spaces")[:10], " 12 11 9"]
    rewards = countdown_reward(prompts, completions)
    assert rewards[:len(TEMPLATES)] == [1.0] * len(TEMPLATES)
    assert 0 < rewards[-1] < rewards[-2] < 0.5
    conversational = countdown_reward([[{"role": "user", "content": prompts[0]}]],
                                      [[{"role": "assistant", "content": completions[0]}]], start=[12])
    assert conversational == [1.0]


def test_the_cache_builds_once_under_concurrent_callers(tmp_path, monkeypatch):
    """Two callers at once (threads here, pytest-xdist workers in a run: the lock is the file's either way): one
    trains, the other waits and loads the same weights."""
    builds = []
    train = fixture._train

    def counted(recipe, tokenizer):
        builds.append(recipe)
        return train(recipe, tokenizer)

    monkeypatch.setattr(fixture, "_train", counted)
    recipe = Recipe(steps=2, hidden_size=32, num_layers=1, num_heads=2)
    results = [None, None]

    def call(i):
        results[i] = trained_policy(recipe, root=tmp_path)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    first, second = (dict(r.model.state_dict()) for r in results)
    assert results[0].path == results[1].path and (results[0].path / "recipe.json").is_file()
    assert all(torch.equal(first[k], second[k]) for k in first)
    rebuilt = fixture._train(recipe, results[0].tokenizer).state_dict()  # the same recipe, the same weights
    assert all(torch.equal(first[k], rebuilt[k]) for k in first)
    assert Recipe(seed=1).key() != Recipe().key()
