"""`partial_rollouts` over the launched processes, as `test_partial_multiprocess.py` launches it (DDP, ZeRO-2): the
trained policy (lengths it learnt) trains 3 optimizer steps, each process 2 prompts x G=4 per round with alpha 0.5;
each process records, per round, how many groups it trained, parked and resumed, and a digest of its weights before
and after; `result.json` under `--out` holds every process's record and the log history.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import harness  # beside this script: the run's shape, the recording reward and the environment it sets
from teardown import leave_cleanly


def run(out_dir: Path) -> None:
    from accelerate import PartialState
    from datasets import Dataset

    from tests.helpers import make_trainer
    from tests.parameters import full_parameters, parameter_digest
    from tests.trained_policy import countdown_reward, prompt_text, trained_policy

    policy = trained_policy()
    starts = [2, 3, 40, 5, 1, 30, 4, 2, 6, 3, 45, 2, 1, 4, 3, 2]
    dataset = Dataset.from_dict({"prompt": [prompt_text(n) for n in starts], "start": starts})
    trainer = make_trainer(out_dir / "run", policy.tokenizer, dataset, countdown_reward, copy.deepcopy(policy.model),
                           per_device_train_batch_size=8, num_generations=4, max_completion_length=160,
                           max_steps=3, optim="sgd", learning_rate=0.05, max_grad_norm=0.0, partial_rollouts=0.5)
    part, rounds = trainer.rounds.partial, []
    real = part.round

    def recorded(batch, version, *args):
        out = real(batch, version, *args)
        rounds.append({"trained_groups": len(out.rows) // 4, "parked": len(part.parked),
                       "resumed_rows": out.metrics["partial/resumed_rows"]})
        return out

    part.round = recorded
    initial = parameter_digest(full_parameters(trainer.model))
    trainer.train()
    mine = {"rank": PartialState().process_index, "rounds": rounds, "initial_digest": initial,
            "digest": parameter_digest(full_parameters(trainer.model))}
    harness.write_result(trainer, mine, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    run(cli.out)
    leave_cleanly()


if __name__ == "__main__":
    main()  # leaves through leave_cleanly
