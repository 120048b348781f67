"""The memory planner on one CUDA GPU: predicted vs `torch.cuda.max_memory_allocated` / `max_memory_reserved`, and
where a step's memory goes, phase by phase, for this trainer and for TRL 1.16's `trl.GRPOTrainer`.

Runs (each its own subprocess, bf16 mixed precision over float32 weights, random weights in Qwen2.5-0.5B's config,
the copy-digits task, G=4, 2 optimizer steps; `benchmarks/shapes.py`):

    grid        the planner's prediction (made before the weights load, as the trainer's check makes it) against
                the peaks of the whole run, over full / LoRA, beta 0 / 0.04, checkpointing on / off,
                T = 64 / 256 / 1024 (the fast backend runs `model.generate` on CUDA: one rollout path)
    phases      `max_memory_allocated` per phase of every step (the peak reset when each phase starts): rollout,
                scoring (reference / old log-probs), loss forward, backward, optimizer step; for ours (also with
                the LM head forced onto the model-logits path, as every bf16 run took it before the fix in
                `modeling/logprobs._head_reproduces_logits`) and for TRL, at the settings of
                benchmarks/results/gpu_2026-11-25_h100_baseline.json (B=16, T=256, beta 0, checkpointing)

    snapshots   (`--snapshot-configs`) where a configuration's memory is at the peak of each phase of its last step:
                the CUDA allocator's recorded history (`torch.cuda.memory._record_memory_history`), the blocks
                alive at the phase's peak grouped by the code that allocated them

    PYTHONPATH=. python benchmarks/gpu/memory_grid.py --json-out benchmarks/results/gpu_memory_<date>.json

About 6 minutes on an H100. Without a CUDA device it prints why and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_grid import Config, build_args, peft_config, wrap_phases  # noqa: E402 - benchmarks/ on sys.path above

SHAPE = "qwen2.5-0.5b"
BASELINE = Config("T256_full", SHAPE, 256, micro_batch=16, bf16=True)  # bench_gpu.py's H100 baseline settings
GRID = [
    BASELINE,
    replace(BASELINE, name="T256_full_beta", beta=0.04),
    replace(BASELINE, name="T256_lora", peft="lora"),
    replace(BASELINE, name="T256_lora_beta", peft="lora", beta=0.04),
    replace(BASELINE, name="T256_full_nockpt", checkpointing=False),
    replace(BASELINE, name="T256_lora_nockpt", peft="lora", checkpointing=False),
    replace(BASELINE, name="T64_full", completion_length=64),
    replace(BASELINE, name="T1024_full", completion_length=1024, micro_batch=8),
    replace(BASELINE, name="T1024_lora", completion_length=1024, micro_batch=8, peft="lora"),
]
PHASE_RUNS = ("ours", "ours_model_logits", "trl")


class _NoCuda:
    """Stand-ins for the `torch.cuda` calls in `--smoke` runs on CPU (which check the wiring, not memory)."""

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats() -> None:
        pass

    @staticmethod
    def max_memory_allocated() -> int:
        return 0

    max_memory_reserved = max_memory_allocated

    @staticmethod
    def get_device_name(index: int = 0) -> str:
        return "cpu (smoke run)"


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else _NoCuda


class Phases:
    """`max_memory_allocated` of each call of the wrapped methods, the peak reset at its start; the run's overall
    peaks are kept across the resets. With `record_step` N, the allocator's history is recorded from the start of
    the N-th rollout (the last step's, so the history stays small), and each phase's start and end leaves a marker
    allocation in it (`_phase_mark`), in the order of `self.marks`; `self.baseline` is what was allocated before."""

    def __init__(self, record_step: int = 0) -> None:
        self.records: list[tuple[str, float]] = []
        self.allocated = self.reserved = 0
        self.record_step, self.rollouts, self.baseline = record_step, 0, 0
        self.marks: list[tuple[str, str]] = []

    def mark(self, phase: str, edge: str) -> None:
        if not self.record_step:
            return
        if phase == "rollout" and edge == "start":
            self.rollouts += 1
            if self.rollouts == self.record_step:
                import torch

                self.baseline = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        if self.rollouts >= self.record_step:
            self.marks.append((phase, edge))
            _phase_mark()

    def fold(self) -> None:
        cuda = _cuda()
        self.allocated = max(self.allocated, cuda.max_memory_allocated())
        self.reserved = max(self.reserved, cuda.max_memory_reserved())

    def wrap(self, owner, name: str, phase: str) -> None:
        cuda = _cuda()
        inner = getattr(owner, name)

        def measured(*args, **kwargs):
            cuda.synchronize()
            self.fold()
            self.mark(phase, "start")
            cuda.reset_peak_memory_stats()
            try:
                return inner(*args, **kwargs)
            finally:
                cuda.synchronize()
                self.records.append((phase, cuda.max_memory_allocated() / 2**30))
                self.fold()
                self.mark(phase, "end")

        setattr(owner, name, measured)


def _phase_mark() -> None:
    """A marker in the allocator's history: one small block allocated and freed here (found by this name)."""
    import torch

    marker = torch.empty(512, dtype=torch.uint8, device="cuda")
    del marker


def _site(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame, and the innermost of this project's frames."""
    def where(frame: dict) -> str:
        name = frame["filename"]
        for root in ("grpo_trainer/", "transformers/", "peft/", "accelerate/", "torch/", "benchmarks/"):
            if root in name:
                name = root + name.split(root, 1)[1]
                break
        return f"{name}:{frame['line']} {frame['name']}"

    if not frames:
        return "(no Python frame: the autograd engine's thread)"
    if frames[0]["name"] == "<module>":  # outermost first: make it innermost first
        frames = frames[::-1]
    ours = next((f for f in frames if "grpo_trainer/" in f["filename"]), None)
    inner = where(frames[0])
    return inner if ours is None or ours is frames[0] else f"{inner} < {where(ours)}"


def phase_snapshots(trace: list[dict], marks: list[tuple[str, str]], top: int = 12, baseline: int = 0) -> list[dict]:
    """For the last occurrence of each phase in `marks`: its peak of allocated bytes (replaying `trace`, the CUDA
    allocator's recorded alloc/free events, over `baseline` bytes allocated before the history starts: an entry of
    its own) and the blocks alive at that peak, grouped by `_site`."""
    freed = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    live: dict[int, tuple[int, str]] = {}
    total, windows, mark_index, current = 0, {}, 0, None
    for event in trace:
        action = event["action"]
        if action == "alloc" and any(f["name"] == "_phase_mark" for f in event.get("frames", [])):
            if mark_index < len(marks):
                phase, edge = marks[mark_index]
                mark_index += 1
                if edge == "start":
                    current = {"phase": phase, "peak": -1, "live": None}
                else:
                    if current is not None:
                        windows[phase] = current
                    current = None
            continue
        if action == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if current is not None and total > current["peak"]:
                current["peak"], current["live"] = total, dict(live)
        elif action == freed and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return [{"phase": phase, "peak_gib": (baseline + window["peak"]) / 2**30,
             "top": _grouped(window["live"] or {}, baseline, top)} for phase, window in windows.items()]


def _grouped(live: dict[int, tuple[int, str]], baseline: int, top: int) -> list[dict]:
    """The `top` largest sites of the live blocks (bytes, block count), with what was allocated before the history
    as an entry of its own."""
    groups: dict[str, list[int]] = {"(allocated before the recorded step)": [baseline, 0]} if baseline else {}
    for size, site in live.values():
        entry = groups.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"site": site, "gib": b / 2**30, "blocks": n} for site, (b, n) in ranked[:top]]


def child(run: str, config: Config, model_dir: str, out: str, snapshot: bool = False) -> None:
    import torch
    from transformers import AutoTokenizer

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = copy_digits_dataset(num_prompts=256, seed=0)
    phases = Phases(record_step=config.steps if snapshot else 0)
    prediction = None
    cuda = _cuda()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a --smoke run
    with tempfile.TemporaryDirectory() as output_dir:
        if run == "trl":
            from trl import GRPOConfig, GRPOTrainer

            args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=config.micro_batch,
                              num_generations=config.generations, max_completion_length=config.completion_length,
                              beta=config.beta, learning_rate=1e-6, loss_type="dapo", bf16=device == "cuda",
                              gradient_checkpointing=config.checkpointing, max_steps=config.steps, logging_steps=1,
                              report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
            trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, peft_config=peft_config(config))
            wrap_phases(trainer, phases, ours=False)
        else:
            from grpo_trainer import GRPOTrainer
            from grpo_trainer.modeling import logprobs
            from grpo_trainer.trainer import memory

            if run == "ours_model_logits":  # the path every bf16 run took before the fix
                logprobs._head_reproduces_logits = lambda *a, **k: False
            args = build_args(config, output_dir, device, bf16=device == "cuda")
            plan = memory.plan_run(model_dir, args, dataset, tokenizer, peft_config(config), device=device,
                                   with_device=False).plan
            prediction = {"allocated_gib": plan.peak_bytes / 2**30, "reserved_gib": plan.reserved_bytes / 2**30,
                          "instant": plan.peak_instant, "totals_gib": [t / 2**30 for t in plan.totals(host=False)],
                          "items": [{"name": i.name, "gib": [b / 2**30 for b in i.bytes]} for i in plan.items
                                    if not i.host]}
            trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, peft_config=peft_config(config))
            wrap_phases(trainer, phases)
        cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        trainer.train()
        cuda.synchronize()
        phases.fold()
    snapshots = None
    if snapshot:
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        snapshots = phase_snapshots(trace, phases.marks, baseline=phases.baseline)
    result = {"run": run, "config": asdict(config), "seconds": time.perf_counter() - started,
              "peak_allocated_gib": phases.allocated / 2**30, "peak_reserved_gib": phases.reserved / 2**30,
              "phases_allocated_gib": phases.records, "prediction": prediction,
              "device": cuda.get_device_name(0), "torch": torch.__version__, "snapshots": snapshots}
    Path(out).write_text(json.dumps(result))


def run_child(run: str, config: Config, model_dir: str, timeout: int, snapshot: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, __file__, "--child", run, "--config", json.dumps(asdict(config)),
                   "--model-dir", model_dir, "--out", str(out)] + (["--snapshot"] if snapshot else [])
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"run": run, "config": asdict(config), "failed": f"timeout after {timeout} s"}
        if proc.returncode != 0 or not out.is_file():
            return {"run": run, "config": asdict(config), "failed": f"rc {proc.returncode}",
                    "stderr_tail": proc.stderr[-3000:]}
        return json.loads(out.read_text())


def _line(row: dict) -> str:
    name = f"{row['config']['name']} {row['run']}"
    if row.get("failed"):
        return f"# {name}: FAILED ({row['failed']})"
    text = f"# {name}: peak {row['peak_allocated_gib']:.2f} GiB allocated / {row['peak_reserved_gib']:.2f} reserved"
    if row.get("prediction"):
        p = row["prediction"]
        text += (f"; predicted {p['allocated_gib']:.2f} / {p['reserved_gib']:.2f} "
                 f"({p['allocated_gib'] / row['peak_allocated_gib'] - 1:+.1%} allocated) at {p['instant']}")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(c.name for c in GRID))
    parser.add_argument("--phase-runs", default=",".join(PHASE_RUNS), help="Per-phase diagnostic runs at the "
                        "baseline settings (comma list of: " + ",".join(PHASE_RUNS) + "; empty: none).")
    parser.add_argument("--snapshot-configs", default="", help="Configurations (comma list) to run once more with "
                        "the allocator's history recorded: what is alive at each phase's peak.")
    parser.add_argument("--models-dir", default=None, help="Keep the saved model here instead of a temporary one.")
    parser.add_argument("--timeout", type=int, default=240, help="Seconds per child run.")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        child(opts.child, Config(**json.loads(opts.config)), opts.model_dir, opts.out, opts.snapshot)
        return
    import torch

    if not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure (this benchmark runs on a GPU)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    from shapes import save_real_model

    configs = {c.name: c for c in GRID}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(opts.models_dir or scratch) / SHAPE
        if not (path / "config.json").is_file():
            print("# " + save_real_model(SHAPE, path, "auto"), flush=True)
        jobs = [("ours", configs[name], False) for name in opts.configs.split(",") if name]
        jobs += [("ours", configs[name], True) for name in opts.snapshot_configs.split(",") if name]
        jobs += [(run, BASELINE, False) for run in opts.phase_runs.split(",") if run and run != "ours"]
        for run, config, snapshot in jobs:
            rows.append(run_child(run, config, str(path), opts.timeout, snapshot))
            print(_line(rows[-1]), flush=True)
            for phase in rows[-1].get("snapshots") or []:
                print(f"#   {phase['phase']}: peak {phase['peak_gib']:.3f} GiB; " + "; ".join(
                    f"{t['gib']:.3f} {t['site']} (x{t['blocks']})" for t in phase["top"][:6]), flush=True)
            if opts.json_out:
                Path(opts.json_out).write_text(json.dumps(_summary(rows), indent=1))
    print(json.dumps(_summary(rows)))


def _summary(rows: list[dict]) -> dict:
    return {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]), "rows": rows}


if __name__ == "__main__":
    main()
