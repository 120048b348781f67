"""Side-by-side benchmark: `grpo_trainer.GRPOTrainer` against `trl.GRPOTrainer` on the same machine.

Both trainers get the same saved tiny model, the same tokenizer, the same dataset, reward, seed and config
(`num_generations` 4, 8 completions per step, identical learning rate, loss type, gradient checkpointing, and
`bf16=False`, which TRL needs explicitly on CPU). Every run is its own subprocess, so peak RSS is per run and
neither library's imports or caches leak into the other's numbers; runs alternate ours / TRL per configuration
so both see the same machine load.

Per configuration it prints median seconds per step after warm-up (CPU seconds from `time.process_time` and
wall seconds; on a shared machine CPU seconds are the steadier number), completion tokens per second, peak RSS
(`VmHWM` of the child), the reward at the start and end of the run, and the ours / TRL ratios; then where each
step's time goes (both trainers' stages wrapped with timers inside the child). The last line of stdout is one JSON
object.

    PYTHONPATH=. python benchmarks/bench_vs_trl.py --quick
    PYTHONPATH=. python benchmarks/bench_vs_trl.py                      # the full grid (long)
    PYTHONPATH=. python benchmarks/bench_vs_trl.py --sizes large --lengths 256 --betas 0.04 --peft full

Real checkpoint shapes (`shapes.py`: random weights in the public configs of Qwen2.5-0.5B / 1.5B, a real-size
tokenizer), with the floor (what any trainer pays: one generation of the same tokens, one forward and backward)
and one-step memory-only runs at a longer completion length:

    PYTHONPATH=. python benchmarks/bench_vs_trl.py --real --impls ours,trl,floor
    PYTHONPATH=. python benchmarks/bench_vs_trl.py --sizes qwen2.5-0.5b --lengths 64 --betas 0 --peft full \
        --threads 1 --warmup 1 --steps 3 --impls ours,trl,floor --memory-lengths 1024

Completion lengths as real runs have them (a random model never samples EOS, so without this every completion has
exactly `max_completion_length` tokens and padding never shows): `--length-spread MEDIAN,SIGMA` ends each
completion with EOS at a seeded log-normal length between 16 and T, in both trainers alike (`tests/toy_lengths.py`: a
logits processor added where transformers builds them, which `model.generate` and our rollouts both call; a row's
length depends only on its prompt, its copy number and the seed). `ours_packed` is ours with `padding_free=True`.
Each run then also reports the padding fraction of its policy forward's input (1 - real / computed tokens of the
padded `[B, S+T]` micro-batch; for `ours_packed` also of its packed rows) and the CPU seconds of the policy's
forward and backward per step (median over the measured steps):

    PYTHONPATH=. python benchmarks/bench_vs_trl.py --sizes qwen2.5-0.5b --lengths 512 --betas 0 --peft full \
        --threads 1 --warmup 1 --steps 3 --impls ours,ours_packed,trl --length-spread 128,0.6
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN_SHAPES  # noqa: E402  (benchmarks/shapes.py, next to this file)

# name -> (vocabulary size, hidden size, layers, attention heads)
MODEL_SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (2048, 128, 4, 4),  # ~0.85M parameters, 2k vocabulary
    "large": (32000, 512, 2, 8),  # ~21M parameters (16M of them the tied 32k embedding)
}
PHASES = ("generation", "reference_forward", "policy_forward", "backward", "optimizer", "rewards")
# "ours_packed": ours with padding_free=True (packed log-prob forwards, `modeling.packing`).
IMPLS = ("ours", "trl", "floor", "ours_packed")
MIN_SPREAD_LENGTH = 16  # the shortest completion --length-spread draws


@dataclass(frozen=True)
class Case:
    size: str
    max_completion_length: int
    beta: float
    peft: str  # "full" or "lora"
    threads: int
    checkpointing: bool = True  # gradient_checkpointing (TRL's default)
    memory_only: bool = False  # one step, no warm-up: peak RSS only
    spread: str = ""  # "MEDIAN,SIGMA": completion lengths log-normal in [16, T] (`--length-spread`); "": all T

    @property
    def name(self) -> str:
        return (f"{self.size}/T{self.max_completion_length}/beta{self.beta:g}/{self.peft}/{self.threads}t"
                + ("" if self.checkpointing else "/nockpt") + ("/mem" if self.memory_only else "")
                + (f"/spread{self.spread}" if self.spread else ""))

    def lengths(self, seed: int):
        """The `--length-spread` schedule (`tests.toy_lengths.LogNormalLengths`), or None."""
        if not self.spread:
            return None
        from tests.toy_lengths import LogNormalLengths

        median, sigma = (float(x) for x in self.spread.split(","))
        return LogNormalLengths(maximum=self.max_completion_length, median=median, sigma=sigma,
                                minimum=MIN_SPREAD_LENGTH, seed=seed)


# ------------------------------------------------------------------------------------------------ child side


def _child(impl: str, case: Case, model_dir: str, steps: int, warmup: int, learning_rate: float, seed: int) -> dict:
    """One training run; returns its measurements. Runs inside its own process."""
    import torch

    torch.set_num_threads(case.threads)
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward

    if impl.startswith("ours"):
        from grpo_trainer import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    rss_after_import = _peak_rss_mb()

    class StepClock(TrainerCallback):
        """Each step's CPU and wall seconds, its share of every instrumented phase (`phases`), and the token counts
        `_instrument_tokens` adds to its entry of `tokens`."""

        def __init__(self) -> None:
            self.cpu: list[float] = []
            self.wall: list[float] = []
            self.phases: dict[str, float] = {}
            self.step_phases: list[dict[str, float]] = []
            self.tokens: list[dict[str, int]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._cpu, self._wall, self._phases = time.process_time(), time.perf_counter(), dict(self.phases)
            self.tokens.append({"real": 0, "padded": 0, "packed": 0, "packed_real": 0})

        def on_step_end(self, args, state, control, **kwargs):
            self.cpu.append(time.process_time() - self._cpu)
            self.wall.append(time.perf_counter() - self._wall)
            self.step_phases.append({k: v - self._phases.get(k, 0.0) for k, v in self.phases.items()})

    peft_config = None
    if case.peft == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=case.max_completion_length, beta=case.beta, learning_rate=learning_rate,
            loss_type="dapo", scale_rewards="group", gradient_checkpointing=case.checkpointing, bf16=False,
            max_steps=warmup + steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
            seed=seed, dataloader_num_workers=0, temperature=1.0,
            **({"padding_free": True} if impl == "ours_packed" else {}),
        )
        clock = StepClock()
        trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args,
                              train_dataset=copy_digits_dataset(num_prompts=64, seed=seed),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config,
                              callbacks=[clock])
        rss_after_init = _peak_rss_mb()  # model loading's own peak (the same for both trainers)
        schedule = case.lengths(seed)
        if schedule is not None:
            from tests.toy_lengths import install_lengths

            install_lengths(trainer.model, schedule, trainer.processing_class.pad_token_id)
        _instrument_tokens(trainer, impl, clock.tokens)
        phases = _instrument_ours(trainer) if impl.startswith("ours") else _instrument_trl(trainer)
        _instrument_optimizer(phases)
        clock.phases = phases
        trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    lengths = [row["completions/mean_length"] for row in history]
    measured = slice(warmup, None)
    cpu, wall = statistics.median(clock.cpu[measured]), statistics.median(clock.wall[measured])
    tokens = 8 * statistics.mean(lengths[measured])  # completion tokens per step
    result = {
        "impl": impl, "case": asdict(case), "cpu_s_per_step": cpu, "wall_s_per_step": wall,
        "tokens_per_step": tokens, "tokens_per_cpu_s": tokens / cpu, "tokens_per_wall_s": tokens / wall,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_import_mb": rss_after_import, "rss_after_init_mb": rss_after_init,
        "rewards": [row["reward"] for row in history],
        "step_cpu_s": clock.cpu, "step_wall_s": clock.wall,
    }
    steps_timed = len(clock.cpu)
    result["phases_cpu_s_per_step"] = {k: v / steps_timed for k, v in phases.items()}
    result["step_cpu_s_mean"] = sum(clock.cpu) / steps_timed
    step_phases = clock.step_phases[measured]
    result["fwd_bwd_cpu_s"] = statistics.median(p["policy_forward"] + p["backward"] for p in step_phases)
    result["reference_cpu_s"] = statistics.median(p["reference_forward"] for p in step_phases)
    steps = clock.tokens[measured]
    real = sum(s["real"] for s in steps)
    result["padding_fraction"] = 1 - real / sum(s["padded"] for s in steps)
    if impl == "ours_packed":
        packed = sum(s["packed"] for s in steps)
        result["packed_filler_fraction"] = 1 - sum(s["packed_real"] for s in steps) / packed if packed else None
    return result


def _instrument_tokens(trainer, impl: str, steps: list[dict[str, int]]) -> None:
    """Adds to the current step's entry of `steps`: the real and computed (padded `[B, S+T]`) tokens of the
    micro-batches the loss sees, and for `ours_packed` the packed rows' tokens (`R x W`) and the real ones in them,
    of its forwards with gradients."""
    import torch

    def count(prompt_mask, completion_mask) -> None:
        steps[-1]["real"] += int(prompt_mask.sum() + completion_mask.sum())
        steps[-1]["padded"] += prompt_mask.numel() + completion_mask.numel()

    if impl.startswith("ours"):
        compute_loss = trainer.compute_loss

        def ours(model, inputs, *args, **kwargs):
            count(inputs.prompt_mask, inputs.completion_mask)
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = ours
        from grpo_trainer.modeling import forwards

        packed_logprobs = forwards.packed_logprobs

        def packed(model, batch, *args, **kwargs):
            if torch.is_grad_enabled():
                steps[-1]["packed"] += batch.tokens_computed
                steps[-1]["packed_real"] += batch.real_tokens
            return packed_logprobs(model, batch, *args, **kwargs)

        forwards.packed_logprobs = packed
    else:
        compute_loss = trainer._compute_loss

        def trl(model, inputs):
            count(inputs["prompt_mask"], inputs["completion_mask"])
            return compute_loss(model, inputs)

        trainer._compute_loss = trl


def _instrument_optimizer(totals: dict[str, float]) -> None:
    """Add every optimizer step's CPU seconds to `totals["optimizer"]` (global hooks: the same for both trainers,
    whatever wraps the optimizer)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    started = []
    register_optimizer_step_pre_hook(lambda *args: started.append(time.process_time()))
    register_optimizer_step_post_hook(lambda *args: totals.__setitem__(
        "optimizer", totals["optimizer"] + time.process_time() - started.pop()))


def _floor(case: Case, model_dir: str, steps: int, warmup: int, learning_rate: float, seed: int) -> dict:
    """What any trainer pays per step for this configuration, measured on the same model and tokens: one
    generation of the step's completions (the fastest generator at hand, `generation_backend='fast'`, keeping
    nothing for the loss), one forward and backward of their log-probs (no activation checkpointing, the
    memory-lean LM head), the optimizer step, and for beta > 0 one reference forward without gradients. Each part
    is timed on its own (CPU seconds, median of the measured repeats)."""
    import torch

    torch.set_num_threads(case.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

    from grpo_trainer import GRPOConfig
    from grpo_trainer.cli.toy import copy_digits_dataset
    from grpo_trainer.config.settings import sampling_settings
    from grpo_trainer.modeling.logprobs import completion_logprobs
    from grpo_trainer.rollout.capture import KEEP_NOTHING
    from grpo_trainer.rollout.fast.backend import FastBackend
    from grpo_trainer.rollout.prompts import tokenize_prompts
    from grpo_trainer.rollout.settings import make_generation_config

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if case.peft == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=case.max_completion_length, learning_rate=learning_rate,
                          bf16=False, report_to="none", temperature=1.0)
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    config = make_generation_config(sampling_settings(args), model.generation_config, tokenizer,
                                    case.max_completion_length)
    rows = copy_digits_dataset(num_prompts=64, seed=seed)["prompt"]
    times: dict[str, list[float]] = {"generation": [], "forward_backward": [], "optimizer": [],
                                     "reference_forward": []}
    tokens = []
    schedule = case.lengths(seed)
    if schedule is not None:
        from tests.toy_lengths import install_lengths

        install_lengths(model, schedule, tokenizer.pad_token_id)
    for step in range(warmup + steps):
        prompts = tokenize_prompts(tokenizer, [p for p in rows[2 * step:2 * step + 2] for _ in range(4)], None)
        model.eval()
        started = time.process_time()
        with torch.no_grad():
            rollout = FastBackend().generate(model, prompts, config, KEEP_NOTHING)
        times["generation"].append(time.process_time() - started)
        tokens.append(int(rollout.completion_mask.sum()))
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        T = rollout.completion_ids.shape[1]
        started = time.process_time()
        if case.beta != 0:
            with torch.no_grad():
                completion_logprobs(model, ids, mask, T)
        times["reference_forward"].append(time.process_time() - started)
        model.train()
        started = time.process_time()
        logps = completion_logprobs(model, ids, mask, T).logps
        loss = -(logps * rollout.completion_mask).sum() / rollout.completion_mask.sum()
        loss.backward()
        times["forward_backward"].append(time.process_time() - started)
        started = time.process_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times["optimizer"].append(time.process_time() - started)
    measured = slice(warmup, None)
    parts = {k: statistics.median(v[measured]) for k, v in times.items()}
    floor = parts["generation"] + parts["forward_backward"]
    return {"case": asdict(case), "parts_cpu_s": parts, "floor_cpu_s": floor,
            "floor_with_optimizer_cpu_s": floor + parts["optimizer"],
            "floor_with_reference_cpu_s": floor + parts["optimizer"] + parts["reference_forward"],
            "tokens_per_step": statistics.mean(tokens[measured]), "peak_rss_mb": _peak_rss_mb(), "times": times}


def _peak_rss_mb() -> float:
    """This process's peak resident set size. Linux keeps `ru_maxrss` across fork + exec, so a child would report
    the benchmark driver's peak if that were higher; `VmHWM` belongs to the process's own address space."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn, phase, totals, phase_fn=None):
    """`fn` with its CPU seconds added to `totals[phase]` (or to `totals[phase_fn()]`, decided at call time)."""
    def wrapper(*args, **kwargs):
        name = phase_fn() if phase_fn else phase
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.process_time() - start
    return wrapper


def _instrument_ours(trainer) -> dict[str, float]:
    """Wrap our trainer's stages with CPU-time accumulators (whole run, warm-up included)."""
    totals = dict.fromkeys(PHASES, 0.0)
    trainer.rounds.rollout = _timed(trainer.rounds.rollout, "generation", totals)
    trainer.scorer.prepare = _timed(trainer.scorer.prepare, "reference_forward", totals)
    trainer.compute_loss = _timed(trainer.compute_loss, "policy_forward", totals)
    trainer.accelerator.backward = _timed(trainer.accelerator.backward, "backward", totals)
    trainer.reward_sources.score = _timed(trainer.reward_sources.score, "rewards", totals)
    return totals


def _instrument_trl(trainer) -> dict[str, float]:
    """The same stages in TRL 1.16: its transformers generation, its log-prob helper (reference when called
    without gradients, policy with them), backward and rewards."""
    import torch

    totals = dict.fromkeys(PHASES, 0.0)
    which = lambda: "policy_forward" if torch.is_grad_enabled() else "reference_forward"  # noqa: E731
    trainer._generate_single_turn = _timed(trainer._generate_single_turn, "generation", totals)
    trainer._get_per_token_logps_and_entropies = _timed(trainer._get_per_token_logps_and_entropies, None, totals,
                                                        which)
    trainer.accelerator.backward = _timed(trainer.accelerator.backward, "backward", totals)
    trainer._calculate_rewards = _timed(trainer._calculate_rewards, "rewards", totals)
    return totals


# ----------------------------------------------------------------------------------------------- parent side


def build_models(directory: Path, sizes: list[str], tokenizer: str) -> dict[str, str]:
    """Save one model + tokenizer per size (offline, seeded); returns size -> path. Real shapes are built in a
    subprocess (so this process never holds their weights) and reused when `directory` already has them."""
    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

    paths = {}
    for size in sizes:
        path = directory / size
        paths[size] = str(path)
        if size in QWEN_SHAPES:
            if not (path / "config.json").is_file():
                subprocess.run([sys.executable, str(Path(__file__).with_name("shapes.py")), size, str(path),
                                "--tokenizer", tokenizer], check=True, env=_child_env(1))
            print(f"# model {(path / 'DESCRIPTION').read_text().strip()}, at {path}", flush=True)
            continue
        vocab, hidden, layers, heads = MODEL_SIZES[size]
        base = len(make_tokenizer())
        toy_tokenizer = make_tokenizer(extra_vocab=vocab - base)
        model = make_tiny_model(toy_tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
        model.save_pretrained(path)
        toy_tokenizer.save_pretrained(path)
        print(f"# model {size}: vocab {len(toy_tokenizer)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"parameters, saved to {path}", flush=True)
    return paths


def _child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "WANDB_DISABLED": "true", "PYTHONWARNINGS": "ignore"}


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_child(impl: str, case: Case, model_dir: str, opts: argparse.Namespace) -> dict:
    """One child run. A child whose resident memory passes `--max-rss-gb` is stopped (so that a run cannot push
    a shared machine into swapping or the OOM killer) and reported as over the limit."""
    steps, warmup = (1, 0) if case.memory_only else (opts.steps, opts.warmup)
    env = _child_env(case.threads)
    command = [sys.executable, __file__, "--child", impl, "--case", json.dumps(asdict(case)), "--model-dir",
               model_dir, "--steps", str(steps), "--warmup", str(warmup), "--learning-rate",
               str(opts.learning_rate), "--seed", str(opts.seed)]
    limit_mb, highest = opts.max_rss_gb * 1024, 0.0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
        started = time.time()
        while proc.poll() is None:
            highest = max(highest, _rss_mb(proc.pid))
            if highest > limit_mb or time.time() - started > opts.timeout:
                proc.kill()
                proc.wait()
                why = "over_rss_limit" if highest > limit_mb else "timeout"
                print(f"# {impl} {case.name}: stopped ({why}, RSS {highest:.0f} MB)", flush=True)
                return {"impl": impl, "case": asdict(case), why: True, "peak_rss_mb": highest}
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {case.name} failed (rc {proc.returncode}):\n{stderr[-4000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "impl": impl}


def _completed(runs: list[dict]) -> list[dict]:
    return [r for r in runs if not (r.get("over_rss_limit") or r.get("timeout"))]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _trainer_columns(impl: str, runs: list[dict]) -> dict:
    """A trainer's medians over its completed repeats (or why none completed)."""
    done = _completed(runs)
    if not done:
        return {f"{impl}_stopped": "over_rss_limit" if runs[0].get("over_rss_limit") else "timeout",
                f"{impl}_peak_rss_mb": max(r["peak_rss_mb"] for r in runs)} if runs else {}
    columns = {f"{impl}_{key}": _median(done, key)
               for key in ("cpu_s_per_step", "wall_s_per_step", "tokens_per_cpu_s", "peak_rss_mb",
                           "rss_after_import_mb", "rss_after_init_mb", "tokens_per_step", "fwd_bwd_cpu_s",
                           "reference_cpu_s", "padding_fraction") if key in done[0]}
    if done[0].get("packed_filler_fraction") is not None:
        columns[f"{impl}_packed_filler_fraction"] = _median(done, "packed_filler_fraction")
    quarter = max(1, len(done[0]["rewards"]) // 4)  # learning: first vs last quarter of the steps
    columns.update({
        f"{impl}_cpu_s_per_step_runs": [r["cpu_s_per_step"] for r in done],  # each repeat's, for the spread
        f"{impl}_step_cpu_s": [r["step_cpu_s"] for r in done],
        f"{impl}_mean_reward": statistics.mean(r for run in done for r in run["rewards"]),
        f"{impl}_reward_start": statistics.mean(r for run in done for r in run["rewards"][:quarter]),
        f"{impl}_reward_end": statistics.mean(r for run in done for r in run["rewards"][-quarter:]),
        f"{impl}_rewards": done[0]["rewards"],
        f"{impl}_phases_cpu_s_per_step": done[0]["phases_cpu_s_per_step"],
        f"{impl}_step_cpu_s_mean": done[0]["step_cpu_s_mean"],
    })
    return columns


def _floor_columns(impl: str, runs: list[dict]) -> dict:
    done = _completed(runs)
    if not done:
        return {}
    columns = {f"{impl}_parts_cpu_s": {k: statistics.median(f["parts_cpu_s"][k] for f in done)
                                       for k in done[0]["parts_cpu_s"]},
               f"{impl}_peak_rss_mb": _median(done, "peak_rss_mb"), f"{impl}_tokens": _median(done, "tokens_per_step")}
    for key in ("floor_cpu_s", "floor_with_optimizer_cpu_s", "floor_with_reference_cpu_s"):
        columns[impl + key[len("floor"):]] = _median(done, key)
    return columns


def summarise(case: Case, runs: dict[str, list[dict]]) -> dict:
    """One row: medians per implementation, ours / TRL and ours / floor ratios."""
    row: dict = {"case": case.name, **asdict(case)}
    for impl, impl_runs in runs.items():
        row.update(_floor_columns(impl, impl_runs) if impl.startswith("floor") else _trainer_columns(impl, impl_runs))
    ratios = {"cpu_ratio": ("ours_cpu_s_per_step", "trl_cpu_s_per_step"),
              "wall_ratio": ("ours_wall_s_per_step", "trl_wall_s_per_step"),
              "rss_ratio": ("ours_peak_rss_mb", "trl_peak_rss_mb"),
              "floor_ratio": ("ours_cpu_s_per_step", "floor_cpu_s"),
              "packed_cpu_ratio": ("ours_packed_cpu_s_per_step", "ours_cpu_s_per_step"),
              "packed_fwd_bwd_ratio": ("ours_packed_fwd_bwd_cpu_s", "ours_fwd_bwd_cpu_s"),
              "packed_trl_ratio": ("ours_packed_cpu_s_per_step", "trl_cpu_s_per_step"),
              "packed_rss_ratio": ("ours_packed_peak_rss_mb", "trl_peak_rss_mb")}
    for name, (numerator, denominator) in ratios.items():
        if numerator in row and denominator in row:
            row[name] = row[numerator] / row[denominator]
    return row


def _cell(row: dict, key: str, fmt: str, width: int) -> str:
    value = row.get(key)
    if value is None:
        stopped = row.get(key.split("_")[0] + "_stopped")
        return f"{('>' if stopped else '-'):>{width}}"
    return f"{value:>{width}{fmt}}"


def print_table(rows: list[dict]) -> None:
    header = (f"{'configuration':<40} {'ours s/step':>11} {'TRL s/step':>10} {'ratio':>6} {'wall':>5} "
              f"{'floor s':>8} {'ours/floor':>10} {'ours tok/s':>10} {'TRL tok/s':>9} {'ours RSS MB':>11} "
              f"{'TRL RSS MB':>10} {'RSS ratio':>9} {'floor RSS':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        trl_rss = _cell(r, "trl_peak_rss_mb", ".0f", 10)
        if r.get("trl_stopped"):
            trl_rss = f"{'>' + format(r['trl_peak_rss_mb'], '.0f'):>10}"
        print(f"{r['case']:<40} {_cell(r, 'ours_cpu_s_per_step', '.2f', 11)} "
              f"{_cell(r, 'trl_cpu_s_per_step', '.2f', 10)} {_cell(r, 'cpu_ratio', '.2f', 6)} "
              f"{_cell(r, 'wall_ratio', '.2f', 5)} {_cell(r, 'floor_cpu_s', '.2f', 8)} "
              f"{_cell(r, 'floor_ratio', '.2f', 10)} {_cell(r, 'ours_tokens_per_cpu_s', '.1f', 10)} "
              f"{_cell(r, 'trl_tokens_per_cpu_s', '.1f', 9)} {_cell(r, 'ours_peak_rss_mb', '.0f', 11)} {trl_rss} "
              f"{_cell(r, 'rss_ratio', '.2f', 9)} {_cell(r, 'floor_peak_rss_mb', '.0f', 9)}")
    print("\nWhere a step's CPU time goes (mean over all steps, warm-up included; `rest`: advantages, loss, "
          "bookkeeping):")
    print(f"{'configuration':<40} {'impl':<5} {'step':>8} " + " ".join(f"{p:>17}" for p in (*PHASES, "rest")))
    for r in rows:
        for impl in ("ours", "trl"):
            if f"{impl}_phases_cpu_s_per_step" not in r:
                continue
            phases, total = r[f"{impl}_phases_cpu_s_per_step"], r[f"{impl}_step_cpu_s_mean"]
            rest = total - sum(phases.values())
            cells = [f"{v:7.2f}s {100 * v / total:5.1f}%" for v in (*(phases.get(p, 0.0) for p in PHASES), rest)]
            print(f"{r['case']:<40} {impl:<5} {total:7.2f}s " + " ".join(f"{c:>17}" for c in cells))
    _print_spread([r for r in rows if r.get("spread")])
    floors = [(r, impl) for r in rows for impl in ("floor",) if f"{impl}_parts_cpu_s" in r]
    if floors:
        print("\nThe floor (median of the measured repeats): generation + forward/backward; then with the optimizer "
              "step, and with a reference forward (beta > 0):")
        print(f"{'configuration':<40} {'impl':<10} {'generation':>10} {'fwd+bwd':>8} {'optimizer':>9} {'ref fwd':>8} "
              f"{'floor':>8} {'+opt':>8} {'+opt+ref':>8}")
        for r, impl in floors:
            p = r[f"{impl}_parts_cpu_s"]
            print(f"{r['case']:<40} {impl:<10} {p['generation']:>10.2f} {p['forward_backward']:>8.2f} "
                  f"{p['optimizer']:>9.2f} {p['reference_forward']:>8.2f} {r[impl + '_cpu_s']:>8.2f} "
                  f"{r[impl + '_with_optimizer_cpu_s']:>8.2f} {r[impl + '_with_reference_cpu_s']:>8.2f}")


def _print_spread(rows: list[dict]) -> None:
    """The --length-spread rows: padding, CPU seconds, the policy's forward + backward, peak RSS; their ratios."""
    if not rows:
        return
    print("\nVariable completion lengths (--length-spread): padding fraction of the policy forward's input (filler: "
          "of ours_packed's packed rows), CPU s per step, CPU s of the policy forward + backward per step (median of "
          "the measured steps), peak RSS MB:")
    print(f"{'configuration':<56} {'impl':<11} {'padding':>7} {'filler':>6} {'s/step':>7} {'fwd+bwd':>7} {'RSS MB':>7}")
    for r in rows:
        for impl in ("ours", "ours_packed", "trl"):
            if f"{impl}_cpu_s_per_step" not in r:
                continue
            cells = [_cell(r, f"{impl}_{key}", fmt, width) for key, fmt, width in (
                ("padding_fraction", ".2f", 7), ("packed_filler_fraction", ".2f", 6), ("cpu_s_per_step", ".2f", 7),
                ("fwd_bwd_cpu_s", ".2f", 7), ("peak_rss_mb", ".0f", 7))]
            print(f"{r['case']:<56} {impl:<11} " + " ".join(cells))
        ratios = [f"{label} {_cell(r, key, '.2f', 4)}" for label, key in (
            ("packed/padded step", "packed_cpu_ratio"), ("fwd+bwd", "packed_fwd_bwd_ratio"),
            ("packed/TRL step", "packed_trl_ratio"), ("RSS", "packed_rss_ratio"))]
        print(f"{'':<56} {'ratios':<11} " + ", ".join(ratios))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Small model, T=64, beta 0.04, full FT, 1 thread.")
    parser.add_argument("--real", action="store_true",
                        help="The real-shape grid: Qwen2.5-0.5B shape, T 64 and 256, beta 0 and 0.04, full and "
                             "LoRA, 1 thread, 1 warm-up + 3 measured steps; one-step memory runs at T=1024.")
    parser.add_argument("--sizes", default="small,large",
                        help="Comma list of: " + ",".join([*MODEL_SIZES, *QWEN_SHAPES]))
    parser.add_argument("--lengths", default="64,256", help="max_completion_length values.")
    parser.add_argument("--memory-lengths", default="",
                        help="max_completion_length values run for peak memory only (one step, no warm-up).")
    parser.add_argument("--betas", default="0.04,0", help="KL coefficients.")
    parser.add_argument("--peft", default="full,lora", help="full and/or lora.")
    parser.add_argument("--threads", default="1,2", help="torch threads per run.")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient_checkpointing=False.")
    parser.add_argument("--length-spread", default="",
                        help="MEDIAN,SIGMA: completions end with EOS at seeded log-normal lengths in [16, T] in both "
                             "trainers (e.g. 128,0.6: about half of a micro-batch's tokens padding at T=512); "
                             "default: every completion T tokens (a random model never samples EOS).")
    parser.add_argument("--impls", default="ours,trl", help="Comma list of: " + ", ".join(IMPLS) + ".")
    parser.add_argument("--tokenizer", default="auto",
                        help="Real shapes' tokenizer: a directory, 'auto' (the fabricated Qwen tokenizer if found, "
                             "else 'char') or 'char' (the char-level tokenizer padded to Qwen's size).")
    parser.add_argument("--models-dir", default=None,
                        help="Keep the saved models here (reused by later runs) instead of a temporary folder.")
    parser.add_argument("--steps", type=int, default=8, help="Measured steps per run (after warm-up).")
    parser.add_argument("--warmup", type=int, default=2, help="Steps left out of the medians.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per implementation per configuration.")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds per child run.")
    parser.add_argument("--max-rss-gb", type=float, default=20.0,
                        help="Stop a child whose resident memory passes this (reported as over the limit).")
    parser.add_argument("--json-out", default=None, help="Also write the final JSON to this file.")
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.sizes, opts.lengths, opts.betas, opts.peft, opts.threads = "small", "64", "0.04", "full", "1"
        opts.steps, opts.warmup = min(opts.steps, 6), min(opts.warmup, 2)
    if opts.real:
        opts.sizes, opts.lengths, opts.memory_lengths, opts.threads = "qwen2.5-0.5b", "64,256", "1024", "1"
        opts.steps, opts.warmup, opts.impls = 3, 1, "ours,trl,floor"
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.child:
        run = _floor if opts.child.startswith("floor") else functools.partial(_child, opts.child)
        result = run(Case(**json.loads(opts.case)), opts.model_dir, opts.steps, opts.warmup, opts.learning_rate,
                     opts.seed)
        print("RESULT " + json.dumps(result), flush=True)
        return

    def split(text: str, kind: type) -> list:
        return [kind(x) for x in text.split(",") if x]

    sizes, impls = split(opts.sizes, str), split(opts.impls, str)
    grid = itertools.product(sizes, split(opts.lengths, int), split(opts.betas, float), split(opts.peft, str),
                             split(opts.threads, int))
    memory = itertools.product(sizes, split(opts.memory_lengths, int), split(opts.betas, float),
                               split(opts.peft, str), split(opts.threads, int))
    checkpointing = not opts.no_checkpointing
    cases = [Case(*c, checkpointing=checkpointing, spread=opts.length_spread) for c in grid] + \
        [Case(*c, checkpointing=checkpointing, memory_only=True, spread=opts.length_spread) for c in memory]
    load = os.getloadavg()
    print(f"# {len(cases)} configurations x {opts.repeats} repeat(s) x {len(impls)} implementations; "
          f"{opts.warmup} warm-up + {opts.steps} measured steps each (memory-only: 1 step); load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(opts.models_dir) if opts.models_dir else Path(scratch)
        paths = build_models(directory, sizes, opts.tokenizer)
        for case in cases:
            runs: dict[str, list[dict]] = {impl: [] for impl in impls}
            for repeat in range(opts.repeats):
                order = impls if repeat % 2 == 0 else impls[::-1]  # alternate who goes first
                for impl in order:
                    if impl.startswith("floor") and case.memory_only:
                        continue
                    runs[impl].append(run_child(impl, case, paths[case.size], opts))
            row = summarise(case, runs)
            row["load_average"] = os.getloadavg()
            rows.append(row)
            print(f"# {case.name}: ours {row.get('ours_cpu_s_per_step', float('nan')):.2f} s/step, TRL "
                  f"{row.get('trl_cpu_s_per_step', float('nan')):.2f} s/step (CPU ratio "
                  f"{row.get('cpu_ratio', float('nan')):.2f}), floor {row.get('floor_cpu_s', float('nan')):.2f} s, "
                  f"RSS ours/TRL {row.get('ours_peak_rss_mb', float('nan')):.0f}/"
                  f"{row.get('trl_peak_rss_mb', float('nan')):.0f} MB; load {row['load_average'][0]:.2f}", flush=True)
    print()
    print_table(rows)
    ratios = [r["cpu_ratio"] for r in rows if "cpu_ratio" in r and not r["memory_only"]]
    summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
               "elapsed_s": time.time() - started, "load_average_end": os.getloadavg(),
               "max_cpu_ratio": max(ratios, default=None), "rows": rows}
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
