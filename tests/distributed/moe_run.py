"""The harness's run shape (harness.py: 3 optimizer steps of 3 prompts x G=4 over all processes, 2 accumulation
micro-steps, beta > 0) on a tiny Qwen3-MoE model with `routing_replay='on'`, as `test_routing_replay_ddp.py`
launches it over 2 processes: each process records how many rounds carried routes and how many forwards replayed
them (with and without grad), and a digest of its weights and of its routers' weights before and after training;
`result.json` under `--out` holds every process's record and the log history.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import harness  # beside this script: the run's shape, the recording reward and the environment it sets
from teardown import leave_cleanly


def run(out_dir: Path) -> None:
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tokenizer
    from grpo_trainer.modeling import routing
    from grpo_trainer.runtime.distributed import launched_world_size
    from tests.helpers import make_trainer
    from tests.parameters import full_parameters, parameter_digest

    tokenizer = make_tokenizer()
    torch.manual_seed(0)  # the same weights on every process
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, moe_intermediate_size=8, head_dim=8, num_experts=4, num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    recorder = harness.Recorder()
    trainer = make_trainer(
        out_dir / "run", tokenizer, copy_digits_dataset(num_prompts=16), [copy_digits_reward, recorder], model,
        per_device_train_batch_size=harness.ROUND_ROWS // (launched_world_size() * harness.ACCUMULATION),
        gradient_accumulation_steps=harness.ACCUMULATION, num_generations=harness.G,
        max_completion_length=harness.MAX_COMPLETION, max_steps=harness.STEPS, learning_rate=1e-2, beta=0.04,
        reward_weights=[1.0, 0.0], routing_replay="on")

    def routers() -> str:
        return parameter_digest({n: p for n, p in full_parameters(trainer.model).items() if "mlp.gate." in n})

    initial, initial_routers = parameter_digest(full_parameters(trainer.model)), routers()
    calls, real = {"grad": 0, "no_grad": 0}, routing.replaying

    @contextlib.contextmanager
    def counted(lm, routes, layout=None, stats=None):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        with real(lm, routes, layout, stats):
            yield

    routing.replaying = counted
    trainer.train()
    state = PartialState()
    mine = {"rank": state.process_index, "replay_on": trainer.rounds.settings.routing_replay, "calls": calls,
            "initial_digest": initial, "digest": parameter_digest(full_parameters(trainer.model)),
            "initial_routers": initial_routers, "routers": routers()}
    harness.write_result(trainer, mine, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    run(cli.out)
    leave_cleanly()


if __name__ == "__main__":
    main()  # leaves through leave_cleanly
