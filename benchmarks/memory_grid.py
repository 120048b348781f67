"""The memory planner against measurement on CPU: predicted vs measured peak resident memory (`VmHWM`) per
configuration, each run in its own process (or its own 2-process `accelerate launch` for ZeRO), at real checkpoint
shapes (`shapes.py`: Qwen2.5-0.5B and its 2-layer proxy with the same widths and 152k vocabulary).

Per configuration: 8 completions per step (2 prompts x G=4), `max_steps` optimizer steps (2 by default: the second
holds the optimizer state through its rollout and loss, the steady state the planner predicts), fp32, 1 thread,
the copy-digits task; the prediction is `trainer.memory.plan_run` on the run's own arguments, i.e. what the
trainer's check computed before loading the weights. A configuration the planner puts above `--skip-above-gib`
is not run (the machine is shared).

    PYTHONPATH=. python benchmarks/memory_grid.py --models-dir /tmp/planner/models \\
        --json-out benchmarks/results/memory_grid_<date>.json
    PYTHONPATH=. python benchmarks/memory_grid.py --configs proxy_T1024_full --phases   # allocated bytes per phase

`--phases` records the CPU allocator's live bytes (torch.profiler's memory events) at the peak of each phase of
the step (rollout, scoring, loss forward, backward, optimizer step), like `torch.cuda.max_memory_allocated` per
phase on a GPU; the profiler's own records raise the process's peak, so `--phases` runs are not accuracy runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PHASES = ("rollout", "scoring", "loss forward", "backward", "optimizer step")


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str
    shape: str  # a `shapes.QWEN_SHAPES` key
    completion_length: int
    beta: float = 0.0
    peft: str = "full"  # "full" or "lora" (r 8 on q/k/v/o, no dropout)
    checkpointing: bool = True
    zero: int = 0  # 0: one process; 2 or 3: two processes with DeepSpeed ZeRO over gloo
    bf16: bool = False  # autocast bfloat16 over float32 weights
    micro_batch: int = 8
    generations: int = 4
    steps: int = 2
    generation_backend: str = "fast"

    @property
    def processes(self) -> int:
        return 2 if self.zero else 1


FULL, PROXY = "qwen2.5-0.5b", "qwen2.5-0.5b-2layers"
GRID = [
    Config("full_T64", FULL, 64),
    Config("full_T64_lora", FULL, 64, peft="lora"),
    Config("full_T64_lora_beta", FULL, 64, beta=0.04, peft="lora"),
    Config("full_T128_lora_nockpt", FULL, 128, peft="lora", checkpointing=False),
    Config("full_T64_beta", FULL, 64, beta=0.04),
    Config("proxy_T256", PROXY, 256),
    Config("proxy_T512_lora", PROXY, 512, peft="lora"),
    Config("proxy_T1024", PROXY, 1024),
    Config("proxy_T1024_beta", PROXY, 1024, beta=0.04),
    Config("proxy_T1024_nockpt", PROXY, 1024, checkpointing=False),
    Config("proxy_T256_zero2", PROXY, 256, zero=2),
    # beta > 0 under ZeRO-3: with beta 0 each process skips its zero-advantage rows, so the processes project
    # different numbers of LM-head chunks, each gathering the head's weight: a collective mismatch (a bug of main,
    # reported with this grid in benchmarks/RESULTS.md)
    Config("proxy_T256_zero3_beta", PROXY, 256, beta=0.04, zero=3),
    Config("proxy_T64_bf16", PROXY, 64, bf16=True),
]
CONFIGS = {c.name: c for c in GRID}


# ------------------------------------------------------------------------------------------------ child side


def wrap_phases(trainer, wrapper, ours: bool = True, optimizer: bool = True) -> None:
    """`wrapper.wrap(owner, method, phase)` on each seam of a step's phases: the rollout (TRL's trainer:
    `_generate_single_turn`), our scoring, the loss forward, the backward and, with `optimizer`, the optimizer step
    (once `train` has built the optimizer)."""
    from transformers import TrainerCallback

    seams = [(trainer.rounds, "rollout", "rollout"), (trainer.scorer, "prepare", "scoring")] if ours else \
        [(trainer, "_generate_single_turn", "rollout")]
    for owner, name, phase in seams + [(trainer, "compute_loss", "loss forward"),
                                       (trainer.accelerator, "backward", "backward")]:
        wrapper.wrap(owner, name, phase)
    if optimizer:
        class OptimizerPhase(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                wrapper.wrap(trainer.optimizer, "step", "optimizer step")

        trainer.add_callback(OptimizerPhase())


def vm(key: str) -> float:
    """This process's `VmHWM` / `VmRSS` in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def build_args(config: Config, output_dir: str, device: str = "cpu", **overrides):
    """Our GRPOConfig for `config` on `device` (the GPU script trains with it on cuda)."""
    from grpo_trainer import GRPOConfig

    settings = dict(output_dir=output_dir, per_device_train_batch_size=config.micro_batch,
                    num_generations=config.generations, max_completion_length=config.completion_length,
                    beta=config.beta, learning_rate=1e-6, loss_type="dapo", gradient_checkpointing=config.checkpointing,
                    bf16=config.bf16, max_steps=config.steps, logging_steps=1, report_to="none", save_strategy="no",
                    disable_tqdm=True, seed=0, dataloader_num_workers=0, temperature=1.0,
                    generation_backend=config.generation_backend,
                    # the plan is the padded layout's (every row at its micro-batch's longest prompt and completion):
                    # packed forwards (padding_free) only lower the peak, by how much depends on the lengths sampled
                    padding_free=False)
    if config.bf16 and device == "cpu":
        settings["use_cpu"] = True  # TrainingArguments refuses bf16 on a machine without a GPU otherwise
    if config.zero:
        settings["ddp_backend"] = "gloo"
    settings.update(overrides)
    return GRPOConfig(**settings)


def peft_config(config: Config):
    if config.peft != "lora":
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


class PhasePeaks:
    """Each phase's peak of the CPU allocator's live bytes, from torch.profiler's memory events; phases marked by
    `record_function` around the trainer's methods."""

    def __init__(self) -> None:
        import torch

        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def wrap(self, owner, name: str, phase: str) -> None:
        import torch

        inner = getattr(owner, name)

        def marked(*args, **kwargs):
            with torch.profiler.record_function("phase::" + phase):
                return inner(*args, **kwargs)

        setattr(owner, name, marked)

    def peaks(self) -> dict:
        """phase -> peak live bytes (relative to the profiler's start), and the overall peak with its phase."""
        tree = self.profiler.profiler.kineto_results.experimental_event_tree()
        peaks = {p: 0 for p in PHASES}
        overall = {"bytes": 0, "phase": None}

        def walk(node, phase):
            name = node.name
            if name.startswith("phase::"):
                phase = name[len("phase::"):]
            fields = node.extra_fields
            total = getattr(fields, "total_allocated", None)
            if total is not None and hasattr(fields, "alloc_size"):
                if phase is not None:
                    peaks[phase] = max(peaks[phase], total)
                if total > overall["bytes"]:
                    overall.update(bytes=total, phase=phase)
            for child in node.children:
                walk(child, phase)

        for root in tree:
            walk(root, None)
        return {"phase_peak_bytes": peaks, "peak_bytes": overall["bytes"], "peak_phase": overall["phase"]}


class PhaseRSS:
    """`VmRSS` and `VmHWM` (MiB) after each call of the wrapped methods: where the resident peak was reached."""

    def __init__(self) -> None:
        self.records: list[tuple[str, float, float]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def recorded(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            finally:
                self.records.append((phase, round(vm("VmRSS")), round(vm("VmHWM"))))

        setattr(owner, name, recorded)


def child(config: Config, model_dir: str, out: str, phases: bool) -> None:
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from grpo_trainer import GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward
    from grpo_trainer.trainer import memory

    rss_after_import = vm("VmRSS")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = copy_digits_dataset(num_prompts=64, seed=0)
    adapter = peft_config(config)
    tracker = PhasePeaks() if phases else None
    with tempfile.TemporaryDirectory() as output_dir:
        args = build_args(config, output_dir)
        trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=adapter)
        run = memory.plan_run(model_dir, trainer.args, dataset, tokenizer, adapter, with_device=False)
        rss_after_init = vm("VmRSS")
        param_bytes = sum(p.nbytes for p in trainer.model.parameters())
        rss = PhaseRSS()
        wrap_phases(trainer, rss, optimizer=False)
        if tracker is not None:
            wrap_phases(trainer, tracker)
            tracker.profiler.start()
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        if tracker is not None:
            tracker.profiler.stop()
    plan = run.plan
    result = {"config": asdict(config), "rank": int(os.environ.get("RANK", 0)), "peak_rss_mib": vm("VmHWM"),
              "rss_after_import_mib": rss_after_import, "rss_after_init_mib": rss_after_init,
              "train_seconds": seconds, "param_bytes": param_bytes,
              "predicted_peak_mib": plan.peak_bytes / 2**20, "predicted_instant": plan.peak_instant,
              "predicted_totals_mib": [t / 2**20 for t in plan.totals()],
              "items": [{"name": i.name, "mib": [b / 2**20 for b in i.bytes], "note": i.note} for i in plan.items],
              "prompt_length": run.settings.prompt_length, "processes": trainer.accelerator.num_processes}
    result["rss_after_phase"] = rss.records
    if tracker is not None:
        result.update(tracker.peaks())
    Path(out).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------- parent side


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE"))}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true",
                "PYTHONWARNINGS": "ignore", "DS_BUILD_OPS": "0"})
    return env


def predict(config: Config, model_dir: str) -> float:
    """The planner's peak (MiB) for `config`, computed in this process from the model's config (no weights); a
    ZeRO launch's processes as `--processes 2 --zero_stage N` of `grpo-train plan` would give them (each process of
    the launch makes its own plan from the environment `accelerate launch` sets)."""
    from transformers import AutoTokenizer

    from grpo_trainer.cli.toy import copy_digits_dataset
    from grpo_trainer.planning import plan_memory
    from grpo_trainer.trainer import memory

    with tempfile.TemporaryDirectory() as output_dir:
        args = build_args(config, output_dir, ddp_backend=None)
        run = memory.plan_run(model_dir, args, copy_digits_dataset(num_prompts=64, seed=0),
                              AutoTokenizer.from_pretrained(model_dir), peft_config(config), with_device=False)
    settings = replace(run.settings, processes=config.processes, processes_per_node=config.processes,
                       zero_stage=config.zero)
    return plan_memory(settings, run.shape).peak_bytes / 2**20


def run_config(config: Config, model_dir: str, phases: bool, timeout: int) -> dict:
    """Run `config` in its own process(es); the result of its largest-peak process."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rank{rank}.json"
        child_args = [__file__, "--child", json.dumps(asdict(config)), "--model-dir", model_dir, "--out", str(out)]
        if phases:
            child_args.append("--phases")
        if config.zero:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(ROOT / f"accelerate_configs/cpu/deepspeed_zero{config.zero}.yaml"),
                       "--main_process_port", str(29500 + os.getpid() % 1000), *child_args]
        else:
            command = [sys.executable, *child_args]
        started = time.perf_counter()
        proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        wall = time.perf_counter() - started
        results = [json.loads(p.read_text()) for p in sorted(Path(scratch).glob("rank*.json"))]
        if proc.returncode != 0 or len(results) != config.processes:
            errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
            return {"config": asdict(config), "failed": True, "returncode": proc.returncode,
                    "errors": errors[-20:], "stderr_tail": proc.stderr[-4000:]}
    worst = max(results, key=lambda r: r["peak_rss_mib"])
    worst["ranks_peak_rss_mib"] = [r["peak_rss_mib"] for r in results]
    worst["wall_seconds"] = wall
    worst["error"] = worst["predicted_peak_mib"] / worst["peak_rss_mib"] - 1
    return worst


def _line(row: dict) -> str:
    c = row["config"]
    if row.get("failed"):
        return f"{c['name']:<26} FAILED (rc {row['returncode']})"
    if row.get("skipped"):
        return f"{c['name']:<26} skipped: {row['skipped']}"
    return (f"{c['name']:<26} measured {row['peak_rss_mib']:8.0f} MiB  predicted {row['predicted_peak_mib']:8.0f} MiB "
            f"({row['error']:+6.1%}) at {row['predicted_instant']}; train {row['train_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="Comma list of: " + ",".join(CONFIGS))
    parser.add_argument("--models-dir", default="/tmp/planner/models", help="Saved models (built if missing).")
    parser.add_argument("--skip-above-gib", type=float, default=10.0, help="Skip a configuration predicted above.")
    parser.add_argument("--phases", action="store_true", help="Also the allocator's live bytes per phase.")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per configuration (default 2).")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        out = opts.out.format(rank=os.environ.get("RANK", "0"))
        child(Config(**json.loads(opts.child)), opts.model_dir, out, opts.phases)
        return
    from shapes import save_real_model

    rows = []
    for name in opts.configs.split(","):
        config = CONFIGS[name] if opts.steps is None else replace(CONFIGS[name], steps=opts.steps)
        path = Path(opts.models_dir) / config.shape
        if not (path / "config.json").is_file():
            print("# " + save_real_model(config.shape, path, "char"), flush=True)
        predicted = predict(config, str(path))
        if predicted > opts.skip_above_gib * 1024:
            rows.append({"config": asdict(config), "skipped": f"predicted {predicted / 1024:.2f} GiB > "
                                                               f"{opts.skip_above_gib:g} GiB"})
        else:
            rows.append(run_config(config, str(path), opts.phases, opts.timeout))
        print(_line(rows[-1]), flush=True)
        if opts.json_out:
            Path(opts.json_out).write_text(json.dumps(_summary(rows), indent=1))
    print(json.dumps(_summary(rows)))


def _summary(rows: list[dict]) -> dict:
    measured = [r for r in rows if "error" in r]
    worst = max(measured, key=lambda r: abs(r["error"]), default=None)
    return {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
            "cpu": _cpu_name(), "worst_error": worst and worst["error"], "worst": worst and worst["config"]["name"],
            "rows": rows}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
