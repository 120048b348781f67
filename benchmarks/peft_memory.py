"""Peak memory of LoRA GRPO with beta > 0: the reference as the adapter-disabled policy vs a full reference copy.

Each variant trains in its own subprocess (so peak RSS is its own) with the same model, seed and data:

- `disabled_adapter`: what GRPOTrainer does; `trainer.ref_model is None` and reference log-probs come from the
  policy inside `disable_adapter()`.
- `full_copy`: the same run, except that the reference is a frozen copy of the base model (what a trainer that
  keeps a separate reference model holds), made by patching `models.make_reference_model`.

The two runs compute the same reference log-probs, so their losses and KL must agree; the script checks that.

    PYTHONPATH=. python benchmarks/peft_memory.py                       # ~110M-parameter model, 2 steps
    PYTHONPATH=. python benchmarks/peft_memory.py --hidden 256 --layers 2 --extra-vocab 0   # quick
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

VARIANTS = ("disabled_adapter", "full_copy")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child(variant: str, opts: argparse.Namespace) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from peft import LoraConfig

    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli import toy as tiny
    from grpo_trainer.runtime import models

    torch.set_num_threads(opts.threads)
    tokenizer = tiny.make_tokenizer(extra_vocab=opts.extra_vocab)
    model = tiny.make_tiny_model(tokenizer, hidden_size=opts.hidden, num_layers=opts.layers, num_heads=opts.heads)
    params = sum(p.numel() for p in model.parameters())
    rss_model = _rss_mib()
    if variant == "full_copy":
        def full_copy(policy, beta):  # a frozen copy of the adapter-free base model
            reference = copy.deepcopy(policy).unload().eval()
            return reference.requires_grad_(False)

        models.make_reference_model = full_copy
    torch.manual_seed(0)  # same LoRA initialisation in both variants
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=opts.completion_length, learning_rate=1e-3, beta=0.04,
                          max_steps=opts.steps, logging_steps=1, report_to="none", save_strategy="no",
                          gradient_checkpointing=False, disable_tqdm=True)
        trainer = GRPOTrainer(model, tiny.copy_digits_reward, args=args, train_dataset=tiny.copy_digits_dataset(64),
                              processing_class=tokenizer,
                              peft_config=LoraConfig(r=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "kl" in e]
    return {"variant": variant, "params": params, "rss_after_model_mib": rss_model, "peak_rss_mib": _peak_rss_mib(),
            "ref_model_params": sum(p.numel() for p in trainer.ref_model.parameters()) if trainer.ref_model else 0,
            "train_s": seconds, "kl": [e["kl"] for e in logs], "loss": [e["loss"] for e in logs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--extra-vocab", type=int, default=32000, help="filler tokens: a realistic embedding size")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(opts.child, opts)))
        return

    results = []
    forwarded = sys.argv[1:]
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--child", variant, *forwarded], check=False,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))

    ours, full = results
    print(f"model: {ours['params'] / 1e6:.1f}M parameters = {ours['params'] * 4 / 2**20:.0f} MiB in fp32; "
          f"LoRA r=16 on q_proj,v_proj; beta=0.04; {opts.steps} steps\n")
    print("| reference | reference params | RSS after model built (MiB) | peak RSS (MiB) | train time (s) |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['variant']} | {r['ref_model_params'] / 1e6:.1f}M | {r['rss_after_model_mib']:.0f} | "
              f"{r['peak_rss_mib']:.0f} | {r['train_s']:.1f} |")
    print(f"\npeak RSS saved by the adapter-disabled reference: {full['peak_rss_mib'] - ours['peak_rss_mib']:.0f} MiB")
    print(f"kl per step   disabled_adapter={ours['kl']}  full_copy={full['kl']}")
    print(f"loss per step disabled_adapter={ours['loss']}  full_copy={full['loss']}")
    same = all(abs(a - b) <= 1e-6 for a, b in zip(ours["kl"] + ours["loss"], full["kl"] + full["loss"]))
    print("same losses and KL in both variants:", same)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
