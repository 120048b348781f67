"""The harness's run (harness.py: 3 optimizer steps, each a round of 3 prompts x G=4 over all processes, 2
accumulation micro-steps, beta > 0) on the default rollout backend, `fast`, with the trainer's own sampling, as
`test_fast_backend.py` launches it over 2 processes. Each process records its rounds' prompts, how many rollouts
each tier of the backend served (the hand-written decoder, the model's own forward, `model.generate`), and a
digest of its weights before and after training; `result.json` under `--out` holds every process's record and
the log history.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness  # beside this script: the run's shape, the recording reward and the environment it sets
from teardown import leave_cleanly

TIERS = ("_fast_rollout", "forward_rollout", "generate_rollout")  # decoder, model forward, model.generate


def _counting(original, name: str, counts: dict[str, int]):
    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    return counted


def count_tiers() -> dict[str, int]:
    """Counts, from now on, the rollouts each tier of the fast backend serves in this process."""
    from grpo_trainer.rollout.fast import backend, forward

    counts = dict.fromkeys(TIERS, 0)
    for module, name in ((backend, "_fast_rollout"), (forward, "forward_rollout"), (backend, "generate_rollout")):
        setattr(module, name, _counting(getattr(module, name), name, counts))
    return counts


# `--truncated`: top-k / top-p sampling (exact log-probs over the kept supports) with the mismatch report on
TRUNCATED = dict(top_k=12, top_p=0.95, sampling_mismatch_report=True)


def run(out_dir: Path, model_dir: Path, truncated: bool = False) -> None:
    from accelerate import PartialState

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward
    from grpo_trainer.runtime.distributed import launched_world_size
    from tests.helpers import make_trainer
    from tests.parameters import full_parameters, parameter_digest

    recorder = harness.Recorder()
    trainer = make_trainer(
        out_dir / "run", None, copy_digits_dataset(num_prompts=16), [copy_digits_reward, recorder],
        str(model_dir / "policy"),
        per_device_train_batch_size=harness.ROUND_ROWS // (launched_world_size() * harness.ACCUMULATION),
        gradient_accumulation_steps=harness.ACCUMULATION, num_generations=harness.G,
        max_completion_length=harness.MAX_COMPLETION, max_steps=harness.STEPS, learning_rate=1e-3, beta=0.04,
        reward_weights=[1.0, 0.0], **(TRUNCATED if truncated else {}))
    initial = parameter_digest(full_parameters(trainer.model))
    counts = count_tiers()
    trainer.train()
    state = PartialState()
    mine = {"rank": state.process_index, "backend": trainer.args.generation_backend, "rounds": recorder.rounds,
            "served": counts, "initial_digest": initial, "digest": parameter_digest(full_parameters(trainer.model)),
            "mismatch_files": sorted(p.name for p in (out_dir / "run" / "sampling_mismatch").glob("*.json"))}
    harness.write_result(trainer, mine, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--truncated", action="store_true")
    cli = parser.parse_args()
    run(cli.out, cli.model_dir, cli.truncated)
    leave_cleanly()


if __name__ == "__main__":
    main()  # leaves through leave_cleanly
