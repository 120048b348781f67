"""The sequence-tiled MLP's price in compute (issue 41, item 1: its default chosen by measurement).

The decoder layers of a real checkpoint shape (Qwen2.5-0.5B or 1.5B widths, `--layers` of them; a 1,024-token
vocabulary, so that the LM head, which tiling does not touch, is not what is timed), float32 on CPU, 1 thread, one
row of T tokens: the training forward and backward through `modeling.forwards.score` with activation checkpointing
(the trainer's default), untiled and with `mlp_tile_tokens`, alternating, `--repeats` times each. Reports CPU
seconds (`time.process_time`) per forward+backward, the tiled run's ratio to the untiled, and the MLP's share of the
layers' arithmetic (from the shapes), from which the price on the whole model follows.

    PYTHONPATH=. python benchmarks/tiled_mlp_price.py --shape qwen2.5-0.5b --layers 4 --lengths 2048,4096 \
        --out benchmarks/results/tiled_mlp_price_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def layer_flops_per_token(shape: dict, T: int) -> dict[str, float]:
    """Forward multiply-adds x 2 per token of one layer: the MLP's three projections, the attention's four, and
    the attention scores and weighted values (causal: about T / 2 keys per query on average)."""
    E, FFN = shape["hidden_size"], shape["intermediate_size"]
    H, KV = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = E // H
    mlp = 2 * 3 * E * FFN
    projections = 2 * (E * H * D + 2 * E * KV * D + H * D * E)
    scores = 2 * 2 * H * D * T / 2
    return {"mlp": mlp, "projections": projections, "attention": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()

    import torch
    from shapes import QWEN_SHAPES
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_trainer.modeling import forwards
    from grpo_trainer.runtime import compat

    torch.set_num_threads(1)
    shape = {**QWEN_SHAPES[cli.shape], "num_hidden_layers": cli.layers, "vocab_size": 1024,
             "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).float().train()
    compat.enable_checkpointing(model)
    record = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "cpu": _cpu_model(), "threads": 1, "shape": cli.shape, "layers": cli.layers, "vocab": 1024,
              "tile": cli.tile, "checkpointing": True, "results": []}
    for T in map(int, cli.lengths.split(",")):
        ids = torch.randint(0, 1024, (1, T), generator=torch.Generator().manual_seed(T))
        mask = torch.ones_like(ids)
        plain = forwards.ForwardSettings(padding_free=False)
        settings = {"untiled": plain, "tiled": plain.with_forward(mlp_tile_tokens=cli.tile)}
        seconds: dict[str, list[float]] = {name: [] for name in settings}
        for repeat in range(cli.repeats):
            for name in (list(settings) if repeat % 2 == 0 else list(settings)[::-1]):
                model.zero_grad(set_to_none=True)
                forwards._VERDICTS.clear()
                start = time.process_time()
                forwards.score(model, ids, mask, T - 16, settings[name]).logps.sum().backward()
                seconds[name].append(time.process_time() - start)
        flops = layer_flops_per_token(shape, T)
        row = {"T": T, "cpu_s": seconds, "median_cpu_s": {k: statistics.median(v) for k, v in seconds.items()},
               "layer_flops_per_token": flops,
               "mlp_share_of_layer_flops": flops["mlp"] / sum(flops.values())}
        row["tiled_over_untiled"] = row["median_cpu_s"]["tiled"] / row["median_cpu_s"]["untiled"]
        print(json.dumps(row), flush=True)
        record["results"].append(row)
        if cli.out:
            Path(cli.out).write_text(json.dumps(record, indent=1) + "\n")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
