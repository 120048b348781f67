"""Speculative rollouts on a policy that has learnt something: decoder forwards, accepted lengths and CPU seconds,
against speculation off, on the same prompts; and whole GRPO steps against speculation off and TRL 1.16.

The policy is `tests/trained_policy.py`'s (a 0.31M-parameter Qwen2 trained here by SFT on "count down from N:",
three solution templates, log-normal lengths up to 466 tokens): siblings share spans the way a trained policy's do.
Random weights (the same shape, untrained) are measured too, where every draft misses.

Part "rollouts" (`--part rollouts`): per G in `--groups`, per temperature, `--prompts` prompts x G rows, at most
`--max-new` tokens, the fast backend alone (one thread), two rounds of the same prompts from one backend: round 1
drafts from the siblings and the prompt only; round 2 also from round 1's completions ("history": epochs > 1,
repeated prompts). Modes: "off" (the plain loop), "measured" (the default policy: widths by timed forwards) and
"fixed" (widths by the per-row lengths and `max_verify_tokens` only). Each (mode, seed) is run in turn in one
process, modes alternating; reported per round: decode steps (sequential decoder forwards after the prefill: a GPU
decode step's time), forwards per generated token (rows fed per token committed: 1 without drafts), mean
accepted length (tokens committed per row per forward), acceptance, rollout CPU seconds and CPU seconds per 1,000
generated tokens (the seeds sample other completions with drafts than without, from the same distribution: per
token is the comparable figure).

Part "steps" (`--part steps`): `GRPOTrainer` with and without `speculative_rollouts` and TRL's `GRPOTrainer` on
the fixture's prompts and reward, each in its own subprocess, alternating: `--step-prompts` prompts x G = 8 per
step (each step an epoch, so from step 2 the history drafts), CPU seconds per step after a warm-up step.

    PYTHONPATH=. python benchmarks/speculative_rollouts.py --out benchmarks/results/speculative_rollouts.json
    PYTHONPATH=. python benchmarks/speculative_rollouts.py --part rollouts --groups 8 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "measured", "fixed")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip()


def _policy(trained: bool):
    from tests.trained_policy import trained_policy

    policy = trained_policy()
    if trained:
        return policy.model, policy.tokenizer
    import copy

    import torch

    model = copy.deepcopy(policy.model)
    torch.manual_seed(0)
    model.apply(model._init_weights)  # the same shape, untrained
    return model, policy.tokenizer


def rollouts(args) -> list[dict]:
    import torch
    from transformers import GenerationConfig

    from grpo_trainer.rollout.fast.backend import FastBackend
    from grpo_trainer.rollout.prompts import tokenize_prompts
    from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
    from tests.trained_policy import countdown_dataset

    torch.set_num_threads(1)
    settings = {"off": None, "measured": SpeculativeSettings(), "fixed": SpeculativeSettings(policy="fixed")}
    rows = []
    for trained in (True, False) if args.random else (True,):
        model, tokenizer = _policy(trained)
        texts = list(countdown_dataset(num_prompts=args.prompts, seed=args.prompt_seed)["prompt"])
        for G in [int(g) for g in args.groups.split(",")]:
            prompts = tokenize_prompts(tokenizer, [t for t in texts for _ in range(G)], None)
            for temperature in [float(t) for t in args.temperatures.split(",")]:
                config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                          max_new_tokens=args.max_new, eos_token_id=[tokenizer.eos_token_id],
                                          pad_token_id=tokenizer.pad_token_id, disable_compile=True)
                for seed in [int(s) for s in args.seeds.split(",")]:
                    for mode in MODES:
                        backend = FastBackend(speculative=settings[mode])
                        for round_ in (1, 2):
                            torch.manual_seed(1000 * seed + round_)
                            start = time.process_time()
                            out = backend.generate(model, prompts, config)
                            seconds = time.process_time() - start
                            generated = int(out.completion_mask.sum())
                            counts = out.decode
                            row = {"policy": "trained" if trained else "random", "G": G, "rows": len(prompts.ids),
                                   "temperature": temperature, "seed": seed, "mode": mode, "round": round_,
                                   "generated": generated, "longest": int(out.completion_mask.sum(1).max()),
                                   "cpu_s": round(seconds, 4),
                                   "cpu_s_per_1k_tokens": round(1000 * seconds / generated, 4)}
                            if counts is None:  # the plain loop: one forward per token after the first
                                row.update(decode_steps=out.completion_ids.shape[1] - 1, forwards_per_token=1.0,
                                           mean_accepted_length=1.0, acceptance=None)
                            else:
                                m = counts.metrics()
                                row.update(decode_steps=counts.forwards,
                                           forwards_per_token=round(m["speculative/forwards_per_token"], 4),
                                           mean_accepted_length=round(m["speculative/mean_accepted_length"], 4),
                                           acceptance=round(m["speculative/acceptance_rate"], 4),
                                           drafted=counts.drafted, accepted=counts.accepted,
                                           positions=counts.positions)
                            print(json.dumps(row), flush=True)
                            rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (policy, G, temperature, round, mode): medians over seeds, and ratios against "off"."""
    keys = sorted({(r["policy"], r["G"], r["temperature"], r["round"]) for r in rows})
    out = []
    for policy, G, temperature, round_ in keys:
        group = [r for r in rows if (r["policy"], r["G"], r["temperature"], r["round"]) == (policy, G, temperature,
                                                                                          round_)]
        off = [r for r in group if r["mode"] == "off"]
        for mode in MODES:
            mine = [r for r in group if r["mode"] == mode]
            entry = {"policy": policy, "G": G, "temperature": temperature, "round": round_, "mode": mode}
            for name in ("decode_steps", "forwards_per_token", "mean_accepted_length", "cpu_s", "cpu_s_per_1k_tokens",
                         "generated"):
                entry[name] = statistics.median(r[name] for r in mine)
            entry["cpu_per_token_vs_off"] = round(entry["cpu_s_per_1k_tokens"] / statistics.median(
                r["cpu_s_per_1k_tokens"] for r in off), 3)
            entry["decode_steps_vs_off"] = round(entry["decode_steps"] / statistics.median(
                r["decode_steps"] for r in off), 3)
            out.append(entry)
    return out


def _step_child(impl: str, steps: int, prompts: int, max_new: int, seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import TrainerCallback

    from tests.trained_policy import countdown_dataset, countdown_reward, trained_policy

    policy = trained_policy()
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo_trainer import GRPOConfig, GRPOTrainer
    extra = {"speculative_rollouts": True} if impl == "ours_speculative" else {}
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * 8, num_generations=8,
                          max_completion_length=max_new, learning_rate=1e-6, max_steps=steps, logging_steps=1,
                          save_strategy="no", report_to="none", disable_tqdm=True, seed=seed, bf16=False,
                          beta=0.0, temperature=1.0, **extra)
        times: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.start = time.process_time()

            def on_step_end(self, *a, **k):
                times.append(time.process_time() - self.start)

        trainer = GRPOTrainer(policy.model, countdown_reward, args=args,
                              train_dataset=countdown_dataset(num_prompts=prompts, seed=3),
                              processing_class=policy.tokenizer, callbacks=[Clock()])
        trainer.train()
        history = trainer.state.log_history
    lengths = [e["completions/mean_length"] for e in history if "completions/mean_length" in e]
    steps_logged = [e.get("speculative/decode_steps") for e in history if "completions/mean_length" in e]
    return {"impl": impl, "seed": seed, "step_cpu_s": times, "mean_length": lengths, "decode_steps": steps_logged,
            "reward": [e.get("reward") for e in history if "reward" in e]}


def steps(args) -> list[dict]:
    results = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for impl in ("ours", "ours_speculative", "trl"):
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.speculative_rollouts "
                    f"import _step_child; print('RESULT ' + json.dumps(_step_child({impl!r}, {args.steps}, "
                    f"{args.step_prompts}, {args.max_new}, {seed})))")
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{impl} failed:\n{done.stderr[-3000:]}")
            result = json.loads(line[7:])
            result["median_step_cpu_s"] = statistics.median(result["step_cpu_s"][1:])  # after a warm-up step
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="both", choices=("both", "rollouts", "steps"))
    parser.add_argument("--groups", default="4,8,16")
    parser.add_argument("--temperatures", default="1.0")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-seed", type=int, default=1)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--random", action="store_true", help="also the untrained model of the same shape")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-prompts", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = {"benchmark": "speculative_rollouts", "cpu": _cpu(), "commit": _commit(),
              "date": time.strftime("%Y-%m-%d"), "threads": 1,
              "command": "PYTHONPATH=. python benchmarks/speculative_rollouts.py " + " ".join(sys.argv[1:])}
    if args.part in ("both", "rollouts"):
        record["rollouts"] = rollouts(args)
        record["rollouts_summary"] = summary(record["rollouts"])
        for entry in record["rollouts_summary"]:
            print(json.dumps(entry))
    if args.part in ("both", "steps"):
        record["steps"] = steps(args)
    print(json.dumps({k: v for k, v in record.items() if k not in ("rollouts",)}))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
