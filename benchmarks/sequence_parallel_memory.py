"""Per-process peak memory of one micro-step's policy forward and backward with sequence parallelism (issue 41,
item 4): what ALST's per-share loop saves against holding the group's rows at once, and against one process.

Each process holds `--rows` rows of a prompt of 16 tokens and a completion of T random tokens (its own micro-batch,
as a DDP process does), on the 2-layer proxy of Qwen2.5-0.5B (`shapes.py`: real widths, the 151,936-token
vocabulary), float32 on CPU, 1 thread per process, activation checkpointing on (the trainer's default), and runs
the trainer's scoring call and the backward of a weighted sum of the completion log-probs (an advantage stand-in):

- `unsharded`: one process, `modeling.forwards.score` padded (what a DDP process does at `padding_free=False`),
  over both micro-batches in turn (so that every mode's gradient is the same sum: `grad_norm`).
- `group_rows`: 2 processes (gloo), the group's 2 x rows gathered and scored at once, each process its half of the
  positions (`modeling.sequence_parallel.sharded_scores`): the layout before ALST's loop, as many tokens per
  process as `unsharded`.
- `alst`: 2 processes, each process's rows in turn (2 shares), each scored at half of its positions on each process
  and back-propagated before the next (`trainer.sequence_group.UlyssesGroup`'s loop; DDP's no_sync has nothing to
  hold back without a DDP wrapper, so each share's gradient is all-reduced by hand after both).

Per process: resident memory after the model is built, the peak (VmHWM) after the step, and the step's CPU seconds,
with glibc's heap held to the live tensors as the trainer holds it on CPU (`runtime.host_memory`). Weights and their
gradients (166M float32 parameters: 633 MiB each) and the accumulation of a second backward are in every figure and
do not grow with T: run a short T (256) beside the long one and compare what grows. The trainer's other forwards (old
and reference log-probs) are sharded the same way, without a graph.

    PYTHONPATH=. python benchmarks/sequence_parallel_memory.py --lengths 256,8192 \
        --out benchmarks/results/sequence_parallel_memory_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
MODES = {"unsharded": 1, "group_rows": 2, "alst": 2}  # mode -> processes
PROMPT = 16


def _inputs(rows: int, T: int, vocab: int, seed: int):
    """`[rows, PROMPT + T]` token ids (all real) and `[rows, T]` loss weights, the same for a given seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab - 1000, (rows, PROMPT + T), generator=generator)
    return ids, torch.ones_like(ids), torch.rand(rows, T, generator=generator) - 0.5


def child(mode: str, rank: int, world: int, T: int, rows: int, shape: str) -> dict:
    import torch
    import torch.distributed as torch_dist
    from fed_completions import peak_rss_mb, rss_mb
    from shapes import build_real_model, load_tokenizer

    from grpo_trainer.modeling import forwards, sequence_parallel
    from grpo_trainer.runtime.host_memory import hold_heap_to_live_tensors

    torch.set_num_threads(1)
    hold_heap_to_live_tensors()  # as the trainer does on CPU: resident memory follows the live tensors
    if world > 1:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo all-reduces; no JIT build
        torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_real_model(shape, load_tokenizer("char")[0], 0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    vocab = model.config.vocab_size
    loaded = rss_mb()
    start = time.process_time()
    if mode == "unsharded":  # both micro-batches in turn (a DDP process holds one at a time): the same gradient sum
        for seed in range(2):
            ids, mask, weights = _inputs(rows, T, vocab, seed)
            logps = forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=False)).logps
            (logps * weights).sum().backward()
            del logps
    else:
        sequence_parallel.install(model)
        shares = [_inputs(rows, T, vocab, seed=r) for r in range(world)]  # every process's micro-batch
        if mode == "group_rows":
            shares = [tuple(torch.cat(parts) for parts in zip(*shares))]
        for ids, mask, weights in shares:
            logps = sequence_parallel.sharded_scores(model, ids, mask, T, torch_dist.group.WORLD).logps
            (logps * weights).sum().backward()
            del logps
        sequence_parallel.deactivate()
        for parameter in model.parameters():
            torch_dist.all_reduce(parameter.grad)
    cpu_s = time.process_time() - start
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    if world > 1:
        torch_dist.destroy_process_group()
    return {"mode": mode, "rank": rank, "T": T, "rows_per_process": rows, "loaded_rss_mb": loaded,
            "peak_rss_mb": peak_rss_mb(), "cpu_s": cpu_s, "grad_norm": grad_norm}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, T: int, rows: int, shape: str) -> list[dict]:
    world, port = MODES[mode], _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, str(rank), str(world), str(T), str(rows),
                               shape], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            results.append({"mode": mode, "T": T, "error": f"exit {proc.returncode}: {err[-2000:]}"})
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--rows", type=int, default=2, help="rows per process (per_device_train_batch_size)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--shape", default="qwen2.5-0.5b-2layers", help="a shapes.QWEN_SHAPES name")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        mode, rank, world, T, rows, shape = cli.child
        print(json.dumps(child(mode, int(rank), int(world), int(T), int(rows), shape)))
        return
    record = {"date": time.strftime("%Y-%m-%d"), "threads_per_process": 1, "shape": cli.shape, "rows": cli.rows,
              "prompt_tokens": PROMPT, "results": []}
    for T in map(int, cli.lengths.split(",")):
        for mode in cli.modes.split(","):
            for result in run(mode, T, cli.rows, cli.shape):
                print(json.dumps(result), flush=True)
                record["results"].append(result)
            if cli.out:
                Path(cli.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
