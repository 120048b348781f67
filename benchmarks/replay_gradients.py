"""Does replaying the rollout's softmax change the gradients the trainer applies, step after step?

Trains on the demo task (`grpo_trainer.cli.command.DEMO` settings, no gradient checkpointing, so only the LM head's
softmax is replayed) and, at every step, also computes the same micro-batch's gradient without the rollout's
softmax (the logits recomputed, as with replay off), under the same weights. Prints the relative difference
||g_replay - g_plain|| / ||g_plain|| over the run: float rounding is ~1e-7; a bias would show as a difference that
grows or sits well above it.

    PYTHONPATH=. python benchmarks/replay_gradients.py --seed 1 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.command import DEMO
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model, make_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    shared = {k: DEMO[k] for k in ("learning_rate", "lr_scheduler_type", "per_device_train_batch_size",
                                   "num_generations", "max_completion_length", "beta")}
    differences: list[float] = []
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, max_steps=opts.steps, report_to="none", save_strategy="no",
                          disable_tqdm=True, seed=opts.seed, gradient_checkpointing=False, bf16=False, **shared)
        trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=opts.seed), copy_digits_reward, args=args,
                              processing_class=tokenizer, train_dataset=copy_digits_dataset(512, seed=opts.seed))
        compute_loss = trainer.compute_loss

        def compared(model, inputs, *rest, **kwargs):
            if inputs.get("sampling_probs") is not None:
                params = [p for p in model.parameters() if p.requires_grad]
                plain_inputs = {k: v for k, v in inputs.items() if k != "sampling_probs"}
                loss = compute_loss(model, inputs, *rest, **kwargs)  # the one the trainer then steps on
                replayed = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
                plain = torch.cat([g.flatten() for g in torch.autograd.grad(compute_loss(model, plain_inputs),
                                                                            params)])
                differences.append(float((replayed - plain).norm() / plain.norm()))
                return loss
            return compute_loss(model, inputs, *rest, **kwargs)

        trainer.compute_loss = compared
        trainer.train()
    summary = {"seed": opts.seed, "steps_compared": len(differences),
               "median_relative_difference": statistics.median(differences),
               "max_relative_difference": max(differences)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
