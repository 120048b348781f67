"""A `transformers.Trainer` fine-tuning script moved to GRPO; examples/migrate_from_trainer.md shows the diff.

The task: answer a question with a word. Supervised fine-tuning copied the reference answer token by token;
GRPO samples answers and rewards the ones that match, so the same `answer` column now feeds a reward function.

    python examples/migrate_from_trainer.py                         # Qwen/Qwen2.5-0.5B-Instruct
    python examples/migrate_from_trainer.py --smoke --output_dir /tmp/migrate   # offline: tiny model, 2 steps
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_trainer import GRPOConfig, GRPOTrainer

QA = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
      ("What is the capital of Italy?", "Rome"), ("What is the capital of Egypt?", "Cairo"),
      ("What is the capital of Peru?", "Lima"), ("What is the capital of Kenya?", "Nairobi"),
      ("What is the capital of Canada?", "Ottawa"), ("What is the capital of Norway?", "Oslo")]


def answer_matches(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the answer is the first word of the completion, 0.5 anywhere else in it, 0.0 when missing."""
    rewards = []
    for completion, expected in zip(completions, answer):
        words = completion[-1]["content"].replace(".", " ").split()
        rewards.append(1.0 if words[:1] == [expected] else 0.5 if expected in words else 0.0)
    return rewards


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="outputs/migrate_from_trainer")
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny random model, 2 steps.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    if args.smoke:
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        tokenizer = make_tokenizer()
        model = make_tiny_model(tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(args.model)

    # Prompts stay text (here chat messages); no tokenising, no labels, no data collator.
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in QA],
                                 "answer": [a for _, a in QA]})

    training_args = GRPOConfig(  # a TrainingArguments subclass: every Trainer field still works
        output_dir=args.output_dir,
        per_device_train_batch_size=8,  # counts completions: 2 prompts x 4 generations
        num_generations=4,
        max_completion_length=8 if args.smoke else 16,
        learning_rate=1e-3 if args.smoke else 1e-6,
        max_steps=2 if args.smoke else 100,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=args.smoke,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=answer_matches,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
