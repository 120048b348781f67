"""GRPO on GSM8K grade-school math: a math-verify accuracy reward plus a think-format reward.

    python examples/gsm8k_grpo.py                                  # Qwen/Qwen2.5-0.5B-Instruct on openai/gsm8k
    accelerate launch examples/gsm8k_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct
    python examples/gsm8k_grpo.py --smoke --output_dir /tmp/gsm8k  # offline: tiny model, inline problems, 2 steps

The same run from the command line (after adding the `solution` column to the data):
    grpo-train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k.jsonl --prompt_column question \
        --system_prompt "..." --reward_funcs accuracy think_format --reward_weights 1.0 0.25
"""

from __future__ import annotations

import argparse

from datasets import Dataset, load_dataset

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.reporting.run_log import RunLogCallback
from grpo_trainer.rewards.library import accuracy_reward, think_format_reward

SYSTEM_PROMPT = ("Solve the problem. Reason step by step inside <think> </think>, then write the final answer "
                 "as \\boxed{number}.")

# A few GSM8K-style problems (written for this example) in the dataset's own format: the answer ends "#### N".
INLINE_PROBLEMS = [
    {"question": "Ana has 3 boxes of 12 pencils and gives away 9 pencils. How many pencils does she have left?",
     "answer": "3 * 12 = 36 pencils. 36 - 9 = 27.\n#### 27"},
    {"question": "A bus carries 45 people. 18 get off and 7 get on. How many people are on the bus now?",
     "answer": "45 - 18 + 7 = 34.\n#### 34"},
    {"question": "Tom reads 15 pages a day. How many pages does he read in 2 weeks?",
     "answer": "2 weeks = 14 days. 14 * 15 = 210.\n#### 210"},
    {"question": "A shirt costs $20 and is on sale for 25% off. What is the sale price in dollars?",
     "answer": "25% of 20 is 5. 20 - 5 = 15.\n#### 15"},
]


def to_grpo_rows(row: dict) -> dict:
    """GSM8K row -> chat prompt + `solution` (the number after '####'), which reaches accuracy_reward."""
    return {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
            "solution": row["answer"].split("####")[-1].strip().replace(",", "")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="outputs/gsm8k_grpo")
    parser.add_argument("--max_steps", type=int, default=500)
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny random model, inline problems, 2 steps.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    if args.smoke:
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        tokenizer = make_tokenizer()
        model, raw = make_tiny_model(tokenizer), Dataset.from_list(INLINE_PROBLEMS)
        sizes = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
                 "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True}
    else:
        model, tokenizer = args.model, None  # the trainer loads the model and its tokenizer
        raw = load_dataset("openai/gsm8k", "main", split="train")
        sizes = {"max_steps": args.max_steps, "per_device_train_batch_size": 16, "num_generations": 8,
                 "max_completion_length": 512, "learning_rate": 1e-6, "logging_steps": 5, "save_steps": 100,
                 "gradient_accumulation_steps": 4, "warmup_steps": 0.05}
    dataset = raw.map(to_grpo_rows, remove_columns=raw.column_names)
    config = GRPOConfig(
        output_dir=args.output_dir, **sizes,
        beta=0.0,                     # no reference model: DAPO / Dr. GRPO found the KL term unnecessary here
        temperature=1.0, epsilon_high=0.28,  # DAPO's clip-higher keeps exploration alive
        reward_weights=[1.0, 0.25],   # correctness dominates; the format only breaks ties
        log_completions=True, num_completions_to_print=2, report_to="none",
    )
    trainer = GRPOTrainer(model, reward_funcs=[accuracy_reward, think_format_reward], args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[RunLogCallback()])
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
