"""Rollout routing replay (R3, `routing_replay`) in process: how often the trainer's forward routes a token to other
experts than the sampler did at the same weights, what that does to the sampler/trainer log-prob mismatch, and
what recording and replaying cost. The measurement behind `routing_replay='auto'` (docs/MOE.md).

For each MoE family and dtype: a random model (seeded) samples B completions of T tokens with the forward tier
(`rollout.fast.forward`, the in-process rollout of MoE models: prefill + KV-cache decode) while its routers are
recorded; then the trainer's full-sequence forward scores the same tokens at the same weights, without and with
replay. Reported per run: the fraction of (token, layer) routes the trainer's own top-k would change
(`ReplayStats.flipped_fraction`: its own choice vs the recorded one, counted inside the replayed forward), and the
mean / max |log pi_sampler - log pi_trainer| over completion tokens, both ways; the seconds of the rollout with and
without recording and of a forward + backward with and without replay (median of `--repeats`, each pair's two
runs alternating). `--drifts`: the trainer's weights moved after sampling by drift x each tensor's std of Gaussian
noise (a stale sampler: an asynchronous round, an engine a step behind), routing and mismatch measured again.

    python benchmarks/routing_replay.py --threads 1 --out benchmarks/results/routing_replay_<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, MixtralConfig, Qwen3MoeConfig

from grpo_trainer.modeling import routing
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rollout.fast.forward import forward_rollout
from grpo_trainer.rollout.fast.guard import resolved
from grpo_trainer.rollout.types import PromptBatch

VOCAB = 512


def _common(hidden: int, layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1)


CONFIGS = {
    # Qwen3-30B-A3B's routing shape scaled down: 128 experts top 8 -> 32 experts top 4, renormalised
    "qwen3_moe": lambda hidden, layers: Qwen3MoeConfig(**_common(hidden, layers), intermediate_size=2 * hidden,
                                                       moe_intermediate_size=hidden // 2, head_dim=hidden // 4,
                                                       num_experts=32, num_experts_per_tok=4, norm_topk_prob=True),
    # Mixtral's: 8 experts top 2
    "mixtral": lambda hidden, layers: MixtralConfig(**_common(hidden, layers), intermediate_size=hidden,
                                                    num_local_experts=8, num_experts_per_tok=2),
}


def _paired_seconds(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of `first()` and `second()`, run alternately (the shared machine's load drifts between
    minutes, so each pair sees the same load), after one untimed call of each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for function, bucket in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            function()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def measure(family: str, dtype: torch.dtype, rows: int, prompt: int, new: int, hidden: int, layers: int,
            repeats: int, drifts: list[float]) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](hidden, layers), dtype=dtype).eval()
    ids = torch.randint(2, VOCAB, (rows, prompt))
    prompts = PromptBatch(ids, torch.ones_like(ids))
    config = resolved(model, GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new,
                                              eos_token_id=1, pad_token_id=0, disable_compile=True))

    def sample():
        torch.manual_seed(1)
        with torch.no_grad():
            return forward_rollout(model, prompts, config)

    def sample_recorded():
        torch.manual_seed(1)
        with torch.no_grad(), routing.recording(model) as calls:
            out = forward_rollout(model, prompts, config)
        return out, calls

    out, calls = sample_recorded()
    routes, reason = routing.assemble(calls, routing.find_routers(model)[0].experts, out.prompt_mask,
                                      out.completion_mask, prompts.distinct_rows()[1])
    assert reason is None, reason
    full = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    T = out.completion_ids.shape[1]
    scored = out.completion_mask.bool()

    stats = routing.ReplayStats()
    with torch.no_grad():
        plain = completion_logprobs(model, full, mask, T).logps
        with routing.replaying(model, routes, stats=stats):
            replayed = completion_logprobs(model, full, mask, T).logps
    off = (plain - out.sampler.logps)[scored].abs()
    on = (replayed - out.sampler.logps)[scored].abs()

    def train_step(replay: bool):
        model.zero_grad()
        context = routing.replaying(model, routes) if replay else torch.enable_grad()
        with context:
            logps = completion_logprobs(model, full, mask, T).logps
        (logps * scored).sum().backward()

    drifted = {}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    for drift in drifts:
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(drift * p.float().std() * torch.randn(p.shape, generator=generator).to(p.dtype))
        moved = routing.ReplayStats()
        with torch.no_grad():
            plain_moved = completion_logprobs(model, full, mask, T).logps
            with routing.replaying(model, routes, stats=moved):
                replayed_moved = completion_logprobs(model, full, mask, T).logps
            for n, p in model.named_parameters():
                p.copy_(state[n])
        off_moved = (plain_moved - out.sampler.logps)[scored].abs()
        on_moved = (replayed_moved - out.sampler.logps)[scored].abs()
        drifted[str(drift)] = {"flipped_fraction": moved.flipped_fraction,
                               "mismatch_off": {"mean": off_moved.mean().item(), "max": off_moved.max().item()},
                               "mismatch_on": {"mean": on_moved.mean().item(), "max": on_moved.max().item()}}
    rollout, rollout_recorded = _paired_seconds(sample, sample_recorded, repeats)
    step, step_replayed = _paired_seconds(lambda: train_step(False), lambda: train_step(True), repeats)
    return {
        "family": family, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "prompt_tokens": prompt,
        "new_tokens": new, "hidden": hidden, "layers": layers,
        "experts": routing.find_routers(model)[0].experts, "top_k": routing.find_routers(model)[0].top_k,
        "routes_bytes": routes.numel() * routes.element_size(),
        "routed_tokens": stats.tokens, "flipped_tokens": stats.flipped, "flipped_fraction": stats.flipped_fraction,
        "mismatch_off": {"mean": off.mean().item(), "max": off.max().item()},
        "mismatch_on": {"mean": on.mean().item(), "max": on.max().item()},
        "drifted": drifted,
        "seconds": {"rollout": rollout, "rollout_recorded": rollout_recorded, "forward_backward": step,
                    "forward_backward_replayed": step_replayed},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="qwen3_moe,mixtral")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--drifts", default="0.001,0.01")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for family in args.families.split(","):
        for dtype in args.dtypes.split(","):
            result = measure(family, getattr(torch, dtype), args.rows, args.prompt, args.new, args.hidden,
                             args.layers, args.repeats, [float(d) for d in args.drifts.split(",") if d])
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
