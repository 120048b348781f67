"""GRPO on a vision-language model: name the colour of a generated square, from the image alone.

Each prompt is a chat message with one image (the dataset's `image` column, as in TRL): a square of one of eight
colours on a white background, at a random size and place. The prompt text is the same for every row, so only the
image tells the answer. The reward reads the `colour` column: 1.0 for the right colour word first, partial credit
for each correct leading letter (so a small model has a signal to climb from the start). The processor
(`AutoProcessor`) is the processing class; the images reach the rollout, the loss forward and the reward function.

    python examples/vlm_colours.py                                    # Qwen/Qwen2.5-VL-3B-Instruct, LoRA
    python examples/vlm_colours.py --model HuggingFaceTB/SmolVLM-256M-Instruct --full_finetune
    PYTHONPATH=. python examples/vlm_colours.py --smoke --output_dir /tmp/c  # offline: tests/toy_vlm.py's Qwen2-VL
"""

from __future__ import annotations

import argparse
import random

from datasets import Dataset
from PIL import Image, ImageDraw

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.reporting.run_log import RunLogCallback

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220), "yellow": (240, 220, 30),
           "orange": (245, 140, 20), "purple": (130, 40, 170), "black": (0, 0, 0), "grey": (128, 128, 128)}
QUESTION = "What colour is the square? Answer with one word."


def square(colour: str, rng: random.Random, size: int) -> Image.Image:
    """A `size` x `size` white picture with a square of `colour` at a random place and size."""
    image = Image.new("RGB", (size, size), "white")
    side = rng.randint(size // 3, size * 3 // 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side, y + side], fill=COLOURS[colour])
    return image


def colour_dataset(num_prompts: int, size: int = 224, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    colours = [rng.choice(sorted(COLOURS)) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION}] for _ in colours],
                              "image": [square(c, rng, size) for c in colours], "colour": colours})


def colour_reward(completions: list, colour: list[str], **kwargs) -> list[float]:
    """1.0 for the right colour as the first word; else the fraction of its letters the answer starts with."""
    rewards = []
    for completion, expected in zip(completions, colour):
        words = completion[-1]["content"].strip().lower().split()
        answer = words[0].strip(".,!") if words else ""
        if answer == expected:
            rewards.append(1.0)
            continue
        matched = next((i for i, (a, b) in enumerate(zip(answer, expected)) if a != b), min(len(answer),
                                                                                           len(expected)))
        rewards.append(0.5 * matched / len(expected))
    return rewards


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    parser.add_argument("--output_dir", default="outputs/vlm_colours")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--full_finetune", action="store_true", help="Train every weight instead of LoRA.")
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny random Qwen2-VL, 2 steps.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    peft_config = None
    if args.smoke:
        from tests.toy_vlm import make_tiny_vlm

        model, processor = make_tiny_vlm("qwen2_vl")
        dataset = colour_dataset(8, size=48)
        sizes = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 6,
                 "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True}
    else:
        from peft import LoraConfig

        model, processor = args.model, None  # the trainer loads the model and its processor
        dataset = colour_dataset(2048)
        sizes = {"max_steps": args.max_steps, "per_device_train_batch_size": 8, "num_generations": 8,
                 "max_completion_length": 16, "learning_rate": 1e-5 if args.full_finetune else 1e-4,
                 "logging_steps": 5, "save_steps": 100, "bf16": True}
        if not args.full_finetune:  # adapters on the language model only; the vision tower stays frozen
            peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    config = GRPOConfig(output_dir=args.output_dir, **sizes, beta=0.0, log_completions=True,
                        num_completions_to_print=2, report_to="none")
    trainer = GRPOTrainer(model, reward_funcs=colour_reward, args=config, train_dataset=dataset,
                          processing_class=processor, peft_config=peft_config, callbacks=[RunLogCallback()])
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
