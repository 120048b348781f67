"""GRPO with a reward model instead of a rule, training only a LoRA adapter.

Prompts come from a JSONL file (one {"prompt": ...} per line; examples/data/prompts.jsonl holds 20 personal-finance
questions). A sequence-classification reward model scores each prompt + completion; its own tokenizer and chat
template are used, so it need not share the policy's vocabulary. With LoRA the reference model for the KL term
is the policy with its adapter switched off: no second copy of the weights.

    python examples/reward_model_lora.py                           # Qwen2.5-0.5B-Instruct + Skywork reward model
    python examples/reward_model_lora.py --prompts my_prompts.jsonl --reward_model path/to/rm
    python examples/reward_model_lora.py --smoke --output_dir /tmp/rm  # offline: tiny policy and reward model

The same run from the command line:
    grpo-train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name examples/data/prompts.jsonl \
        --conversational --reward_model_name_or_path Skywork/Skywork-Reward-V2-Qwen3-0.6B --use_peft --beta 0.04
"""

from __future__ import annotations

import argparse
import os

from datasets import load_dataset
from peft import LoraConfig

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.reporting.run_log import RunLogCallback

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prompts.jsonl")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--reward_model", default="Skywork/Skywork-Reward-V2-Qwen3-0.6B")
    parser.add_argument("--prompts", default=PROMPTS, help="JSONL file with a 'prompt' field per line.")
    parser.add_argument("--output_dir", default="outputs/reward_model_lora")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny policy and reward model, 2 steps.")
    return parser.parse_args(argv)


def tiny_reward_model(tokenizer):
    """A randomly initialised 1-label sequence classifier over the tiny tokenizer (smoke mode only)."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    return AutoModelForSequenceClassification.from_config(config)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    dataset = load_dataset("json", data_files=args.prompts, split="train")
    # Chat-formatted prompts: the policy's chat template applies, and the reward model sees a conversation.
    dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    if args.smoke:
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        tokenizer = make_tokenizer()
        model, reward_model, reward_tokenizer = make_tiny_model(tokenizer), tiny_reward_model(tokenizer), tokenizer
        targets = ["q_proj", "v_proj"]
        sizes = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
                 "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True}
    else:
        model, tokenizer = args.model, None
        reward_model, reward_tokenizer = args.reward_model, None  # loaded by the trainer (num_labels=1)
        targets = "all-linear"
        sizes = {"max_steps": args.max_steps, "per_device_train_batch_size": 8, "num_generations": 8,
                 "max_completion_length": 256, "learning_rate": 2e-5, "logging_steps": 5, "save_steps": 50}
    config = GRPOConfig(
        output_dir=args.output_dir, **sizes,
        beta=0.04,  # a reward model can be gamed: the KL term keeps the policy near the original model
        log_completions=True, num_completions_to_print=2, report_to="none",
    )
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets)
    trainer = GRPOTrainer(model, reward_funcs=reward_model, args=config, train_dataset=dataset,
                          processing_class=tokenizer, reward_processing_classes=reward_tokenizer, peft_config=lora,
                          callbacks=[RunLogCallback()])
    trainer.train()
    trainer.save_model(args.output_dir)  # saves the adapter only
    return trainer


if __name__ == "__main__":
    main()
