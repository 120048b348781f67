"""What the trained-policy fixture (`tests/trained_policy.py`) samples: sibling hit rates, length quantiles, reward.

Builds the fixture (`--fresh`: into a temporary cache, so the build time is measured now; else the cache's, which
reports the build time recorded when it was built) and prints JSON: the recipe and sizes, the build seconds, the
sibling n-gram hit rate (`sibling_hit_rate`: context 3, mean over each group's completions after the first) at
G = 4 / 8 / 16 and temperatures 0.7 / 1.0 / 1.2 over `--groups` prompts, the completion-length quantiles at
temperature 1.0 over `--prompts` prompts with 512 new tokens at most, and the greedy and temperature-1.0 rewards
(a random-weight model of the same shape for comparison). `model.generate` samples, seeded; one thread.

    PYTHONPATH=. python benchmarks/trained_policy_stats.py --fresh \
        --out benchmarks/results/trained_policy_stats_<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo_trainer.cli.toy import make_tiny_model  # noqa: E402
from tests.trained_policy import (  # noqa: E402
    TrainedPolicy,
    countdown_dataset,
    countdown_reward,
    prompt_text,
    sample,
    sibling_hit_rate,
    trained_policy,
)

MAX_NEW = 512


def quantile(ordered: list[int], q: float) -> int:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mean_reward(policy: TrainedPolicy, dataset, temperature: float | None, max_new_tokens: int = MAX_NEW) -> float:
    texts = policy.tokenizer.batch_decode(sample(policy, dataset["prompt"], temperature, max_new_tokens, seed=1))
    return round(statistics.mean(countdown_reward(dataset["prompt"], texts, start=dataset["start"])), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fresh", action="store_true", help="build into a temporary cache (measures the build)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per hit-rate cell")
    parser.add_argument("--prompts", type=int, default=512, help="prompts for the length quantiles")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        policy = trained_policy(root=scratch if args.fresh else None)
        seconds = time.perf_counter() - start
    model = policy.model
    report: dict = {
        "recipe": asdict(policy.recipe), "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size, "intermediate_size": model.config.intermediate_size,
        "num_key_value_heads": model.config.num_key_value_heads, "torch_threads": torch.get_num_threads(),
        "build_seconds": round(policy.build_seconds, 1), "built_now": args.fresh, "load_seconds": round(seconds, 1),
    }

    groups = list(countdown_dataset(args.groups, seed=3)["start"])
    report["hit_rate_prompt_starts"] = groups
    hits: dict[str, dict[str, float]] = {}
    for temperature in (0.7, 1.0, 1.2):
        for g in (4, 8, 16):
            prompts = [prompt_text(n) for n in groups for _ in range(g)]
            completions = sample(policy, prompts, temperature, MAX_NEW, seed=g)
            rates = [sibling_hit_rate(completions[i:i + g]) for i in range(0, len(completions), g)]
            hits.setdefault(f"T={temperature}", {})[f"G={g}"] = round(statistics.mean(rates), 4)
    report["sibling_hit_rate"] = hits

    dataset = countdown_dataset(args.prompts, seed=4)
    lengths = sorted(len(c) for c in sample(policy, dataset["prompt"], 1.0, MAX_NEW, seed=0))
    report["lengths_T1"] = {"prompts": args.prompts, "max_completion_length": MAX_NEW, "mean": round(
        statistics.mean(lengths), 1), "p50": quantile(lengths, 0.5), "p90": quantile(lengths, 0.9),
        "p95": quantile(lengths, 0.95), "p99": quantile(lengths, 0.99), "max": lengths[-1],
        "truncated": sum(n >= MAX_NEW for n in lengths), "p95_over_p50": round(
            quantile(lengths, 0.95) / quantile(lengths, 0.5), 2)}

    rewarded = countdown_dataset(128, seed=5)
    random_model = make_tiny_model(policy.tokenizer, hidden_size=policy.recipe.hidden_size,
                                   num_layers=policy.recipe.num_layers, num_heads=policy.recipe.num_heads)
    random_policy = TrainedPolicy(random_model, policy.tokenizer, policy.recipe, policy.path, 0.0)
    report["reward"] = {"prompts": len(rewarded), "greedy": mean_reward(policy, rewarded, None),
                        "T=1.0": mean_reward(policy, rewarded, 1.0),
                        "random_weights_greedy_64_tokens": mean_reward(random_policy, rewarded, None, 64)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
