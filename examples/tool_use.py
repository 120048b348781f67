"""Tool use: a model learns that calling a tool pays.

The task lives in an environment (`environment_factory`): each rollout gets a `Vault` whose `reset()` draws a secret
code and writes the prompt ("Open the vault."), so no dataset is needed (`max_steps` sets the run's length). The
vault's public method `read()` is the rollout's tool: the model may call it, the trainer runs it and appends the
code to the conversation, and the model answers. The reward (`correct_code`) reads each rollout's own vault
(`environments`) and pays 1 for the right code: a model that guesses gets 1 in 10, one that reads gets it every time.

With `--toy` a tiny random model (80k parameters) is first warmed up for a few seconds with plain supervised
learning on example conversations, half of which read the code and repeat it and half guess without reading: it
learns the tool-call format, and to repeat what it read less than half of the time. GRPO then teaches it what pays:
`tools/call_frequency` goes from 0.5 to 1 within 20 steps, and the reward from 0.27 to about 0.7 in 200 steps as it
also learns to repeat the code it read.

    python examples/tool_use.py                                  # Qwen/Qwen2.5-0.5B-Instruct (Hermes tool calls)
    python examples/tool_use.py --toy --output_dir /tmp/tools    # offline: tiny model, warm-up + 200 GRPO steps
    python examples/tool_use.py --smoke --output_dir /tmp/tools  # offline check: tiny model, 2 steps
"""

from __future__ import annotations

import argparse
import random

import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.reporting.run_log import RunLogCallback

PROMPT = "Open the vault."


class Vault:
    """One rollout's environment: a secret code, readable through the `read` tool."""

    rng = random.Random(0)  # shared by every vault, so a run is reproducible
    digits = 1

    def reset(self, **row) -> str:
        self.code = "".join(str(self.rng.randint(0, 9)) for _ in range(self.digits))
        return PROMPT  # appended to the (empty) prompt: the environment writes the task

    def read(self) -> str:
        """Read the vault's secret code.

        Returns:
            The code.
        """
        return self.code


def correct_code(completions: list, environments: list, **kwargs) -> list[float]:
    """1.0 when the model's last message is exactly its vault's code."""
    return [1.0 if messages[-1]["role"] == "assistant" and messages[-1]["content"].strip() == vault.code else 0.0
            for messages, vault in zip(completions, environments)]


def warm_up(model: torch.nn.Module, tokenizer, steps: int, seed: int = 0) -> float:
    """Supervised warm-up on the toy format: half the examples read the code and repeat it, half guess a digit
    without reading. The model learns the format and the copy, not which of the two pays. Returns the last loss."""
    rng = random.Random(seed)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tools=[Vault.read],
                                           add_generation_prompt=True, return_dict=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        texts = []
        for _ in range(32):
            code, guess = rng.randint(0, 9), rng.randint(0, 9)
            texts.append(f"<call>read</call><|end|><|tool|>{code}<|end|><|assistant|>{code}<|end|>"
                         if rng.random() < 0.5 else f"{guess}<|end|>")
        rows = [prompt + tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        width = max(map(len, rows))
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
        labels[:, :len(prompt)] = -100  # learn the completions only
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="outputs/tool_use")
    parser.add_argument("--max_steps", type=int, default=200, help="GRPO steps.")
    parser.add_argument("--toy", action="store_true", help="Offline: tiny random model, warm-up, then GRPO.")
    parser.add_argument("--smoke", action="store_true", help="Offline: tiny random model, 2 steps.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> GRPOTrainer:
    args = parse_args(argv)
    Vault.rng = random.Random(0)
    if args.toy or args.smoke:
        from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

        # The toy chat template writes a call as `<call>read</call>`, short enough for a tiny model.
        tokenizer = make_tokenizer(tool_calling=True)
        model = make_tiny_model(tokenizer)
        warm_up(model, tokenizer, steps=2 if args.smoke else 300)
        sizes = {"max_steps": 2 if args.smoke else args.max_steps, "per_device_train_batch_size": 64,
                 "num_generations": 8, "max_completion_length": 16, "learning_rate": 1e-3, "beta": 0.0,
                 "logging_steps": 1 if args.smoke else 5, "save_strategy": "no", "disable_tqdm": True,
                 "activation_checkpointing": False}
    else:
        Vault.digits = 6  # a code no model can guess
        model, tokenizer = args.model, None
        sizes = {"max_steps": args.max_steps, "per_device_train_batch_size": 16, "num_generations": 8,
                 "max_completion_length": 256, "learning_rate": 1e-6, "logging_steps": 5, "save_steps": 100}
    config = GRPOConfig(
        output_dir=args.output_dir, **sizes, lr_scheduler_type="constant",
        max_tool_calling_iterations=1,  # one round of calls per rollout: read, then answer
        log_completions=True, num_completions_to_print=2, report_to="none", seed=0,
    )
    trainer = GRPOTrainer(model, reward_funcs=correct_code, args=config, processing_class=tokenizer,
                          environment_factory=Vault, callbacks=[RunLogCallback()])
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
