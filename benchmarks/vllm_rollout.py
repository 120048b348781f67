"""Rollout throughput at a real checkpoint's shape: vLLM (CPU build, in the training process) against this
project's fast decoder and transformers' `generate`.

The model has Qwen2.5-0.5B's config with random weights (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV
heads, vocabulary 151936, tied embeddings), in float32, on one thread. Each backend samples the same 8 distinct
prompts of 32 tokens for 64 new tokens at temperature 1 through the rollout-backend interface the trainer uses
(vLLM: `rollout.vllm.VLLMBackend`, with its weights pushed from the model first). Calls alternate between the
backends; after one warm-up call each, every backend runs `--repeats` times and the median is reported (vLLM's
prefix cache is reset before each call, so no call reuses an earlier one's prompts). Tokens per second count the
tokens actually sampled (a completion stops early only if it samples the EOS id, about 1 in 150k per token).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_rollout.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # vLLM leaves torch's thread count alone when this is set

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config  # noqa: E402

from grpo_trainer.cli.toy import make_tokenizer  # noqa: E402
from grpo_trainer.rollout.types import PromptBatch  # noqa: E402

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 64


def qwen05b_shape() -> AutoModelForCausalLM:
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=151643,
                         pad_token_id=151643, bos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompts() -> PromptBatch:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 150000, (PROMPTS, PROMPT_TOKENS), generator=generator)
    return PromptBatch(ids, torch.ones_like(ids))


def sampling_config(model) -> GenerationConfig:
    return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=NEW_TOKENS,
                            eos_token_id=[model.config.eos_token_id], pad_token_id=model.config.pad_token_id,
                            disable_compile=True)


def vllm_backend(model, tokenizer_dir: str):
    from transformers import AutoTokenizer

    from grpo_trainer.config import GRPOConfig
    from grpo_trainer.config.settings import backend_choice
    from grpo_trainer.rollout import select

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_vllm=True, use_cpu=True, report_to="none",
                      per_device_train_batch_size=PROMPTS, num_generations=2, max_prompt_length=PROMPT_TOKENS,
                      max_completion_length=NEW_TOKENS, vllm_max_model_length=512)
    backend = select(backend_choice(args))
    backend.check_model(model)
    started = time.perf_counter()
    backend.start(model, AutoTokenizer.from_pretrained(tokenizer_dir))
    backend.sync_weights(model, 0)
    return backend, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["vllm", "fast", "generate"])
    cli = parser.parse_args()
    torch.set_num_threads(1)

    from grpo_trainer.rollout.fast.backend import FastBackend
    from grpo_trainer.rollout.generate import GenerateBackend

    model, batch = qwen05b_shape(), prompts()
    config = sampling_config(model)
    tokenizer_dir = tempfile.mkdtemp()
    make_tokenizer().save_pretrained(tokenizer_dir)  # vLLM needs a tokenizer folder; prompts are token ids
    backends, setup = {}, {}
    if "vllm" in cli.backends:
        backends["vllm"], setup["vllm"] = vllm_backend(model, tokenizer_dir)
    if "fast" in cli.backends:
        backends["fast"] = FastBackend()
    if "generate" in cli.backends:
        backends["generate"] = GenerateBackend()

    def call(name: str) -> tuple[float, int]:
        backend = backends[name]
        if name == "vllm":
            backend.engine.llm.reset_prefix_cache()
        started = time.perf_counter()
        with torch.no_grad():
            out = backend.generate(model, batch, config)
        return time.perf_counter() - started, int(out.completion_mask.sum())

    first = {name: call(name)[0] for name in backends}  # warm-up (the first call pays one-off costs)
    runs = {name: [] for name in backends}
    for _ in range(cli.repeats):
        for name in backends:
            runs[name].append(call(name))
    result = {"load_average": os.getloadavg(), "threads": torch.get_num_threads(), "engine_start_s": setup,
              "first_call_s": first, "backends": {}}
    print(f"{'backend':10s} {'first call s':>12s} {'median s':>9s} {'tokens':>7s} {'tok/s':>8s}")
    for name, values in runs.items():
        seconds = statistics.median(v[0] for v in values)
        tokens = statistics.median(v[1] for v in values)
        result["backends"][name] = {"seconds": [v[0] for v in values], "tokens": tokens,
                                    "median_tokens_per_s": tokens / seconds}
        print(f"{name:10s} {first[name]:12.2f} {seconds:9.2f} {tokens:7.0f} {tokens / seconds:8.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
