"""Partial rollouts on a policy whose completion lengths it learnt (heavy-tailed): decode steps per round, tokens
decoded per token trained, CPU seconds per step, and reward against steps and against CPU seconds, for alpha in
`--alphas` (0: off, today's path), seeds spread; and TRL 1.16's GRPOTrainer on the same run (`--trl`).

The policy is `tests/trained_policy.py`'s (a 0.31M-parameter Qwen2 trained here by SFT on "count down from N:", three
solution templates, N log-normal over prompts, so lengths are log-normal too: p95 / p50 = 6.4 at temperature 1).
Its own task is saturated (reward 1.0), so the learning task here asks for one template: `equations_reward` gives 1.0
for the `equations` countdown exactly (the longest template, 35% of the SFT policy's samples), 0.25 for another
template exactly, and 0.25 x the countdown's partial credit otherwise. Learning it moves the policy toward its longest
completions, where a length-biased scheme would learn slower; groups here are trained whole, so none is.

Each (alpha, seed) trains `--steps` GRPO steps (`--prompts` prompts x G = 8 per step, at most `--max-new` tokens,
AdamW lr `--lr`, beta 0, temperature 1, one torch thread) in its own subprocess, alphas alternating within a seed.
Per step: CPU seconds (process time of the step, rollout and training), decode steps (sequential decoder forwards of
the round's rollout: a GPU decode step's time; alpha 0: its longest completion), tokens decoded and trained, reward
(the mean over the round's trained completions), and the mean completion length.

    PYTHONPATH=. python benchmarks/partial_rollouts.py --out benchmarks/results/partial_rollouts.json \
        --plot benchmarks/results/partial_rollouts.png

Part "shape" (`--part shape`): the Qwen2.5-0.5B shape (random weights, `benchmarks/shapes.py`, the padded char-level
tokenizer of the real vocabulary size) with fed log-normal lengths (`tests/toy_lengths.KeyedLengths`, keyed on the
prompt and a row's first token, so a resumed row keeps its drawn length), `--shape-steps` SGD steps per alpha (the
first a warm-up), alphas alternating: CPU seconds and decode steps per step at the real checkpoint's width, where a
decode step reads every weight whatever its rows.

    PYTHONPATH=. python benchmarks/partial_rollouts.py --part shape --alphas 0,0.5,1 \
        --out benchmarks/results/partial_rollouts_shape.json
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
sys.path.insert(0, str(ROOT))

from benchmarks.speculative_rollouts import _commit, _cpu  # noqa: E402 - the same records as its sibling benchmark


def _step_clock(times: list[float]):
    """A callback appending each optimizer step's CPU seconds (process time) to `times`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.process_time() - self.start)

    return Clock()


def equations_reward(prompts: list, completions: list, start: list[int] | None = None, **kwargs) -> list[float]:
    """1.0 for the `equations` template exactly; 0.25 x the fixture's reward otherwise (0.25 for another template
    exactly)."""
    from tests.trained_policy import completion_text, countdown_reward

    base = countdown_reward(prompts, completions, start)
    return [1.0 if c.removesuffix("<eos>").rstrip() == completion_text(n, "equations") else 0.25 * b
            for c, n, b in zip(completions, start, base)]


def _child(impl: str, alpha: float, seed: int, steps: int, prompts: int, max_new: int, lr: float) -> dict:
    import torch

    torch.set_num_threads(1)
    from tests.trained_policy import countdown_dataset, trained_policy

    policy = trained_policy()
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo_trainer import GRPOConfig, GRPOTrainer
    extra = {"partial_rollouts": alpha} if alpha else {}
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * 8, num_generations=8,
                          max_completion_length=max_new, learning_rate=lr, max_steps=steps, logging_steps=1,
                          save_strategy="no", report_to="none", disable_tqdm=True, seed=seed, bf16=False, beta=0.0,
                          temperature=1.0, **extra)
        times: list[float] = []

        trainer = GRPOTrainer(policy.model, equations_reward, args=args,
                              train_dataset=countdown_dataset(num_prompts=512, seed=3),
                              processing_class=policy.tokenizer, callbacks=[_step_clock(times)])
        trainer.train()
        history = [e for e in trainer.state.log_history if "reward" in e]
    rows = prompts * 8
    return {
        "impl": impl, "alpha": alpha, "seed": seed, "step_cpu_s": times,
        "reward": [e["reward"] for e in history], "mean_length": [e["completions/mean_length"] for e in history],
        # alpha 0: the loop ends with its longest row; TRL's generate too (its steps, not the decoder's)
        "decode_steps": [e.get("partial/decode_steps", e["completions/max_length"]) for e in history],
        "decoded_tokens": [e.get("partial/decoded_tokens", e["completions/mean_length"] * rows) for e in history],
        "trained_tokens": [e.get("partial/trained_tokens", e["completions/mean_length"] * rows) for e in history],
        "stale_token_share": [e.get("partial/stale_token_share", 0.0) for e in history],
        "parked_groups": [e.get("partial/parked_groups", 0.0) for e in history],
        "reprefilled_tokens": [e.get("partial/reprefilled_tokens", 0.0) for e in history],
    }


def _shape_child(alpha: float, steps: int, prompts: int, max_new: int, median: float, sigma: float) -> dict:
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset

    from benchmarks.shapes import build_real_model, load_tokenizer
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from tests.toy_lengths import LogNormalLengths, install_lengths

    tokenizer, described = load_tokenizer("char")
    model = build_real_model("qwen2.5-0.5b", tokenizer)
    texts = [f"prompt {i:05d}:" for i in range(256)]  # one length: the lengths are keyed on it
    prompt_tokens = len(tokenizer(texts[0])["input_ids"])
    schedule = LogNormalLengths(maximum=max_new, median=median, sigma=sigma, minimum=4)
    install_lengths(model, schedule, tokenizer.pad_token_id, prompt_tokens=prompt_tokens)
    extra = {"partial_rollouts": alpha} if alpha else {}
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * 8, num_generations=8,
                          max_completion_length=max_new, learning_rate=1e-6, optim="sgd", max_steps=steps,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, bf16=False,
                          beta=0.0, temperature=1.0, **extra)
        times: list[float] = []

        trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tokenizer,
                              callbacks=[_step_clock(times)])
        trainer.train()
        history = [e for e in trainer.state.log_history if "reward" in e]
    rows = prompts * 8
    return {"alpha": alpha, "tokenizer": described, "step_cpu_s": times,
            "decode_steps": [e.get("partial/decode_steps", e["completions/max_length"]) for e in history],
            "decoded_tokens": [e.get("partial/decoded_tokens", e["completions/mean_length"] * rows) for e in history],
            "trained_tokens": [e.get("partial/trained_tokens", e["completions/mean_length"] * rows) for e in history],
            "mean_length": [e["completions/mean_length"] for e in history]}


def shape(args) -> list[dict]:
    results = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for alpha in [float(a) for a in args.alphas.split(",")]:
        code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.partial_rollouts "
                f"import _shape_child; print('RESULT ' + json.dumps(_shape_child({alpha}, {args.shape_steps}, "
                f"{args.shape_prompts}, {args.shape_max_new}, {args.shape_median}, {args.shape_sigma})))")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"shape alpha={alpha} failed:\n{done.stderr[-3000:]}")
        result = json.loads(line[7:])
        after = result["step_cpu_s"][1:]  # after the warm-up step
        result["summary"] = {"alpha": alpha, "mean_step_cpu_s": statistics.mean(after),
                             "decode_steps_per_round": statistics.mean(result["decode_steps"][1:]),
                             "decoded_per_trained_token": sum(result["decoded_tokens"]) / sum(result["trained_tokens"])}
        print(json.dumps(result["summary"]), flush=True)
        results.append(result)
    base = results[0]["summary"]
    for r in results:
        r["summary"]["step_vs_alpha0"] = r["summary"]["mean_step_cpu_s"] / base["mean_step_cpu_s"]
        r["summary"]["decode_steps_vs_alpha0"] = r["summary"]["decode_steps_per_round"] / base["decode_steps_per_round"]
    return results


def run(args) -> list[dict]:
    results = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    runs = [("ours", float(a)) for a in args.alphas.split(",")] + ([("trl", 0.0)] if args.trl else [])
    for seed in [int(s) for s in args.seeds.split(",")]:
        for impl, alpha in runs:
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.partial_rollouts "
                    f"import _child; print('RESULT ' + json.dumps(_child({impl!r}, {alpha}, {seed}, {args.steps}, "
                    f"{args.prompts}, {args.max_new}, {args.lr})))")
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{impl} alpha={alpha} seed={seed} failed:\n{done.stderr[-3000:]}")
            result = json.loads(line[7:])
            print(json.dumps({k: result[k] for k in ("impl", "alpha", "seed")}
                             | {"median_step_cpu_s": statistics.median(result["step_cpu_s"][1:]),
                                "final_reward": statistics.mean(result["reward"][-5:])}), flush=True)
            results.append(result)
    return results


def summary(results: list[dict]) -> list[dict]:
    """Per (impl, alpha), over seeds: the median step's CPU seconds (after a warm-up step), mean decode steps per
    round, decoded / trained tokens over the run, the last 5 steps' reward (mean, and the seeds' spread), and the
    reward per CPU second reached (last-5 reward / total CPU seconds)."""
    out = []
    for key in dict.fromkeys((r["impl"], r["alpha"]) for r in results):
        runs = [r for r in results if (r["impl"], r["alpha"]) == key]
        finals = [statistics.mean(r["reward"][-5:]) for r in runs]
        out.append({
            "impl": key[0], "alpha": key[1], "seeds": len(runs),
            "median_step_cpu_s": statistics.median(t for r in runs for t in r["step_cpu_s"][1:]),
            "total_cpu_s": statistics.mean(sum(r["step_cpu_s"]) for r in runs),
            "decode_steps_per_round": statistics.mean(s for r in runs for s in r["decode_steps"]),
            "decoded_per_trained_token": sum(sum(r["decoded_tokens"]) for r in runs)
            / sum(sum(r["trained_tokens"]) for r in runs),
            "final_reward_mean": statistics.mean(finals), "final_reward_min": min(finals),
            "final_reward_max": max(finals),
            "mean_length": statistics.mean(x for r in runs for x in r["mean_length"]),
            "stale_token_share": statistics.mean(x for r in runs for x in r["stale_token_share"]),
        })
    base = next((s for s in out if s["impl"] == "ours" and s["alpha"] == 0.0), None)
    for s in out:
        if base is not None:
            s["step_vs_alpha0"] = s["median_step_cpu_s"] / base["median_step_cpu_s"]
            s["decode_steps_vs_alpha0"] = s["decode_steps_per_round"] / base["decode_steps_per_round"]
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_cpu) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((r["impl"], r["alpha"]) for r in results):
        runs = [r for r in results if (r["impl"], r["alpha"]) == key]
        label = "TRL 1.16" if key[0] == "trl" else f"alpha = {key[1]:g}" + (" (off)" if key[1] == 0 else "")
        steps = min(len(r["reward"]) for r in runs)
        mean = [statistics.mean(r["reward"][i] for r in runs) for i in range(steps)]
        low = [min(r["reward"][i] for r in runs) for i in range(steps)]
        high = [max(r["reward"][i] for r in runs) for i in range(steps)]
        x = list(range(1, steps + 1))
        line, = by_step.plot(x, mean, label=label)
        by_step.fill_between(x, low, high, alpha=0.15, color=line.get_color())
        cpu = [statistics.mean(sum(r["step_cpu_s"][:i + 1]) for r in runs) for i in range(steps)]
        by_cpu.plot(cpu, mean, label=label, color=line.get_color())
    by_step.set(xlabel="optimizer step", ylabel="reward (mean over seeds; band: seeds' min-max)",
                title="reward per step")
    by_cpu.set(xlabel="CPU seconds (one thread, mean over seeds)", ylabel="reward", title="reward per CPU second")
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="fixture", choices=("fixture", "shape"))
    parser.add_argument("--shape-steps", type=int, default=4)
    parser.add_argument("--shape-prompts", type=int, default=2)
    parser.add_argument("--shape-max-new", type=int, default=192)
    parser.add_argument("--shape-median", type=float, default=40.0)
    parser.add_argument("--shape-sigma", type=float, default=0.8)
    parser.add_argument("--alphas", default="0,0.25,0.5,1")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=320)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--trl", action="store_true", help="also TRL 1.16's GRPOTrainer (one run per seed)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    record = {"benchmark": "partial_rollouts", "cpu": _cpu(), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
              "threads": 1, "command": "PYTHONPATH=. python benchmarks/partial_rollouts.py " + " ".join(sys.argv[1:])}
    if args.part == "shape":
        record["shape"] = shape(args)
    else:
        record["runs"] = run(args)
        record["summary"] = summary(record["runs"])
        for entry in record["summary"]:
            print(json.dumps(entry))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot and "runs" in record:
        plot(record["runs"], args.plot)


if __name__ == "__main__":
    main()
