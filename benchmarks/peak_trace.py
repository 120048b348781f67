"""What is live at a training step's memory peak: torch.profiler's allocation records replayed in time order, and at
the highest sum of live bytes the live tensors grouped by where they were allocated (the innermost grpo_trainer /
transformers frames and the op), with torch's own categories (parameter, gradient, optimizer state, ...) beside.

Trains as `long_completions.py` does (identical completions of T random tokens through `rollout_func`, 2 rows, the
2-layer Qwen2.5-0.5B proxy, float32, 1 thread), under the profiler (with stacks, so far slower than a plain run;
the live bytes are the allocator's, relative to the profiler's start: the weights loaded before it are not in the
groups, and torch's categories count them):

    PYTHONPATH=. python benchmarks/peak_trace.py --trainer ours --length 4096 --steps 2 --mlp-tile-tokens 1024 \\
        > benchmarks/results/peak_trace_T4096_tiled_<date>.log

It found that at T = 4,096 with the tiled MLP our step peaked in the second step's backward, at the tied
embedding's dense lookup gradient beside the head's (benchmarks/RESULTS.md, "A tied embedding's gradient").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def live_at_peak(profiler) -> tuple[int, dict]:
    """(peak live bytes since the profiler started, {ptr: (bytes, allocation stack)} live then)."""
    events = []

    def walk(node, stack):
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr"):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size, stack[-40:]))
        try:
            name = node.name
        except UnicodeDecodeError:  # a frame name the profiler recorded in another encoding
            name = "?"
        for child in node.children:
            walk(child, stack if hasattr(fields, "alloc_size") else stack + [name])

    for root in profiler.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    events.sort(key=lambda e: e[0])
    live, total, best, best_live = {}, 0, 0, {}
    for _, ptr, size, stack in events:
        if size > 0:
            live[ptr] = (size, stack)
        else:
            live.pop(ptr, None)
        total += size
        if total > best:
            best, best_live = total, dict(live)
    return best, best_live


def grouped(live: dict) -> list[tuple[str, int, int]]:
    """(where, bytes, tensors), largest first: the innermost 5 frames of this project or transformers, and the op."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, stack in live.values():
        frames = [f for f in stack if ".py(" in f and "torch/" not in f and "autograd/function" not in f]
        ops = [f for f in stack if f.startswith(("aten::", "autograd::", "mkldnn"))]
        key = " | ".join(frames[-5:]) + " || " + (ops[0] if ops else "")
        groups[key][0] += size
        groups[key][1] += 1
    return sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda g: -g[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("ours", "trl"), default="ours")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mlp-tile-tokens", type=int, default=0)
    parser.add_argument("--recompute-attention", action="store_true")
    parser.add_argument("--shape", default="qwen2.5-0.5b-2layers")
    cli = parser.parse_args()

    import numpy as np
    import torch
    from fed_completions import distinct_rewards, peak_rss_mb, prompts, random_completions, rss_mb, training_args
    from shapes import save_real_model
    from torch.profiler._memory_profiler import Category, MemoryProfileTimeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cli.trainer == "ours":
        from grpo_trainer import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as output:
        print(save_real_model(cli.shape, Path(model_dir), "char"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        print("loaded", rss_mb())
        options = {"mlp_tile_tokens": cli.mlp_tile_tokens} if cli.mlp_tile_tokens else {}
        if cli.recompute_attention:
            options["recompute_attention"] = True
        trainer = GRPOTrainer(model, distinct_rewards, processing_class=tokenizer, train_dataset=prompts(),
                              args=training_args(GRPOConfig, output, cli.length, cli.steps, "cpu", **options),
                              rollout_func=random_completions(tokenizer, model.config.vocab_size, cli.length))
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                          record_shapes=True, with_stack=True)
        with profiler:
            trainer.train()
    print("peak", peak_rss_mb())
    _, sizes = MemoryProfileTimeline(profiler._memory_profile())._coalesce_timeline("cpu")
    sizes = np.array(sizes)  # [events, 1 + categories]
    at = int(sizes.sum(1).argmax())
    print("peak live MiB", sizes[at].sum() / 2**20)
    names = ["unknown"] + [c.name for c in Category]  # torch's columns: unknown, then the categories it records
    for name, value in zip(names + [f"column {i}" for i in range(len(names), len(sizes[at]))], sizes[at]):
        if value:
            print(f"  {name:20s} {value / 2**20:9.1f}")
    best, live = live_at_peak(profiler)
    print("reconstructed peak MiB", best / 2**20)
    for where, size, count in grouped(live)[:30]:
        print(f"{size / 2**20:9.1f} MiB x{count:4d}  {where[-420:]}")


if __name__ == "__main__":
    main()
