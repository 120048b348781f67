"""RLOO instead of GRPO: the same trainer with `advantage_estimator="rloo"`.

RLOO (Kool et al. 2019; Ahmadian et al. 2024) baselines each completion with the mean reward of the *other*
completions of its prompt, A_i = r_i - mean_{j != i} r_j, and does not divide by the group's std. Everything
else (sampling, loss, logging) is unchanged, so switching is one field. Here the task is generated in code:
two-number additions with an exact-answer reward, so no dataset is downloaded.

    python examples/rloo.py                                        # Qwen/Qwen2.5-0.5B-Instruct
    python examples/rloo.py --smoke --output_dir /tmp/rloo         # offline: tiny model, 2 steps
    grpo-train --demo --advantage_estimator rloo                   # the demo, with RLOO
"""

from __future__ import annotations

import argparse
import random
import re

from datasets import Dataset

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.reporting.run_log import RunLogCallback


def addition_dataset(num_prompts: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(num_prompts)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
                   for a, b in pairs],
        "target": [a + b for a, b in pairs],
    })


def exact_sum_reward(completions: list, target: list[int], **kwargs) -> list[float]:
    """1.0 when the completion's last integer is the sum, else 0.0 (binary, so pass@k is logged in eval)."""
    rewards = []
    for completion, expected in zip(completions, target):
        numbers = re.findall(r"-?\d+", completion[-1]["content"])
        rewards.append(1.0 if numbers and int(numbers[-1]) == expected else 0.0)
    return rewards


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="outputs/rloo")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny random model, 2 steps.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    if args.smoke:
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        tokenizer = make_tokenizer()
        model, dataset = make_tiny_model(tokenizer), addition_dataset(16)
        sizes = {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 6,
                 "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True}
    else:
        model, tokenizer, dataset = args.model, None, addition_dataset(4096)
        sizes = {"max_steps": args.max_steps, "per_device_train_batch_size": 16, "num_generations": 8,
                 "max_completion_length": 32, "learning_rate": 1e-6, "logging_steps": 5, "save_steps": 100}
    config = GRPOConfig(
        output_dir=args.output_dir, **sizes,
        advantage_estimator="rloo",  # the only line that differs from a GRPO run
        scale_rewards="none",        # RLOO as published: no division by the group std
        beta=0.0, log_completions=True, num_completions_to_print=2, report_to="none",
    )
    trainer = GRPOTrainer(model, reward_funcs=exact_sum_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[RunLogCallback()])
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
