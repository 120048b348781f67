"""One asynchronous-rollouts run (async_rollouts=1, the default `fast` backend) under `accelerate launch`; each
process writes what tests/distributed/test_async_ddp.py compares: its weights' digest, its rounds' token ids, the
logged staleness."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from teardown import leave_cleanly  # beside this script, on sys.path when it is launched

from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model, make_tokenizer
from grpo_trainer.trainer import round_builder
from tests.helpers import make_trainer
from tests.parameters import full_parameters, parameter_digest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    rounds = []
    sample = round_builder.RoundBuilder.sample

    def recording(self, batch, mode, policy, state):
        out = sample(self, batch, mode, policy, state)
        rounds.append(out.rollout.completion_ids.tolist())
        return out

    round_builder.RoundBuilder.sample = recording
    tokenizer = make_tokenizer()
    trainer = make_trainer(cli.out / "run", tokenizer, copy_digits_dataset(num_prompts=32),
                           model=make_tiny_model(tokenizer, seed=7), num_generations=4, learning_rate=0.05,
                           max_steps=3, async_rollouts=1)
    trainer.train()
    rank = trainer.accelerator.process_index
    digest = parameter_digest(full_parameters(trainer.accelerator.unwrap_model(trainer.model)))
    staleness = [row["async/staleness"] for row in trainer.state.log_history if "async/staleness" in row]
    result = {"processes": trainer.accelerator.num_processes, "digest": digest, "rounds": rounds,
              "staleness": staleness, "backend": trainer.rollout_backend.name}
    (cli.out / f"rank{rank}.json").write_text(json.dumps(result))
    leave_cleanly()


if __name__ == "__main__":
    main()
