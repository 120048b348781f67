"""Learning with and without routing replay on a toy Mixture-of-Experts task where routing drift matters.

The demo's task (`grpo_trainer.cli.toy`: copy 3 digits, 128 completions per step, G=16, lr 1e-3 constant,
beta 0.001) on a random tiny Qwen3-MoE (hidden 64, 2 layers, 8 experts top 2, renormalised), with rounds sampled
one step ahead (`async_rollouts=1`, the in-process producer): every round is sampled by weights one optimizer
step older than those that train on it, so routes drift between the sampler and the trainer (the setting R3 is
for). `routing_replay` 'on' against 'off', same seeds; each run its own subprocess at one thread. Printed per run:
the mean reward over the first and last 10% of steps, the first step whose 10-step mean reward reaches 0.5 and
0.8, the mean importance ratio's distance from 1 (`async/importance_ratio_raw_*`), CPU seconds per step.

    PYTHONPATH=. python benchmarks/routing_replay_learning.py --steps 200 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(mode: str, steps: int, seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.command import DEMO
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    shared = {k: DEMO[k] for k in ("learning_rate", "lr_scheduler_type", "per_device_train_batch_size",
                                   "num_generations", "max_completion_length", "beta")}
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none",
                          save_strategy="no", disable_tqdm=True, seed=seed, activation_checkpointing=False,
                          bf16=False, async_rollouts=1, routing_replay=mode, **shared)
        trainer = GRPOTrainer(model, copy_digits_reward, args=args, processing_class=tokenizer,
                              train_dataset=copy_digits_dataset(num_prompts=512, seed=seed))
        start = time.process_time()
        trainer.train()
        cpu = time.process_time() - start
    history = trainer.state.log_history
    rewards = [row["reward"] for row in history if "reward" in row]
    ratio = [max(abs(row["async/importance_ratio_raw_max"] - 1), abs(1 - row["async/importance_ratio_raw_min"]))
             for row in history if "async/importance_ratio_raw_max" in row]
    return {"rewards": rewards, "ratio_worst_distance": ratio, "cpu_s_per_step": cpu / steps}


def _first_step_reaching(rewards: list[float], level: float, window: int = 10) -> int | None:
    for end in range(window, len(rewards) + 1):
        if statistics.mean(rewards[end - window:end]) >= level:
            return end
    return None


def summarise(run: dict) -> dict:
    rewards = run["rewards"]
    tenth = max(1, len(rewards) // 10)
    return {"reward_first_10pct": statistics.mean(rewards[:tenth]), "reward_last_10pct": statistics.mean(
        rewards[-tenth:]), "step_reaching_0.5": _first_step_reaching(rewards, 0.5),
        "step_reaching_0.8": _first_step_reaching(rewards, 0.8),
        "ratio_worst_distance_mean": statistics.mean(run["ratio_worst_distance"]) if run["ratio_worst_distance"]
        else None, "cpu_s_per_step": run["cpu_s_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--modes", default="on,off")
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.child:
        print("RESULT " + json.dumps(_child(cli.child, cli.steps, int(cli.seeds))), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    results = []
    for seed in cli.seeds.split(","):
        for mode in cli.modes.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(cli.steps), "--seeds",
                                   seed], env=env, capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
            run = json.loads(lines[-1][len("RESULT "):])
            result = {"mode": mode, "seed": int(seed), **summarise(run), "rewards": run["rewards"]}
            print(json.dumps({k: v for k, v in result.items() if k != "rewards"}), flush=True)
            results.append(result)
    if cli.out:
        with open(cli.out, "w") as f:
            json.dump({"steps": cli.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
