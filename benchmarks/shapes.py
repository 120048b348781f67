"""Real checkpoint shapes for the benchmarks, built offline: random weights in the public configs of Qwen2.5-0.5B
and Qwen2.5-1.5B, and a tokenizer with a real-size vocabulary.

The models have the published architecture (hidden and intermediate sizes, layers, query and key/value heads, the
151,936-entry vocabulary, tied embeddings, RoPE theta), so every matmul, the KV cache and the LM head have the
sizes users train at; only the weights are random (nothing is downloaded). A random model almost never samples its
EOS token, so every completion runs to `max_completion_length`: the token counts of both trainers are equal.

The tokenizer, in order of preference:
1. `--tokenizer PATH` (a directory with a saved tokenizer, e.g. a real Qwen2.5 checkout);
2. the Qwen-vocabulary tokenizer that `shared/peer_tests/fabricate_hub_cache.py` builds offline (the real
   151,643 byte-level BPE ranks plus Qwen's special tokens; the same ids as Qwen2.5's), if a fabricated cache is
   found under `/tmp/peer-hf-home` or `$PEER_HF_HOME`;
3. the character-level toy tokenizer padded with filler tokens to Qwen2.5's 151,665 entries, so that the vocabulary
   (and with it the LM head, the sampling and the log-prob arithmetic) has the real size.
Which one was used is printed and recorded in the results.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

__all__ = ["QWEN_SHAPES", "QWEN_TOKENIZER_LENGTH", "build_real_model", "find_qwen_tokenizer", "load_tokenizer",
           "parameter_count", "save_real_model"]

# The public `config.json` values of the two checkpoints (architecture only; dtype and generation settings are
# the benchmark's). Both tie the LM head to the input embedding.
QWEN_SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=32768),
}
# A memory proxy for one-step runs at long completions: Qwen2.5-0.5B's widths, heads and vocabulary (so the LM head,
# the logits and every `[B, T, V]` buffer have their real size) with 2 of its 24 layers, whose activations the
# 24-layer model would hold 12 times over. Its seconds say nothing about the real model's.
QWEN_SHAPES["qwen2.5-0.5b-2layers"] = {**QWEN_SHAPES["qwen2.5-0.5b"], "num_hidden_layers": 2}
QWEN_TOKENIZER_LENGTH = 151665  # len(Qwen2.5's tokenizer): 151,643 BPE ranks + 22 special tokens

_PEER_CACHE_GLOB = "hub/models--trl-internal-testing--tiny-Qwen2ForCausalLM-2.5/snapshots/*"


def find_qwen_tokenizer() -> str | None:
    """A fabricated Qwen2.5 tokenizer directory from a peer-test cache with the full vocabulary, or None."""
    roots = [os.environ.get("PEER_HF_HOME", ""), *sorted(glob.glob("/tmp/peer-hf-home/*"))]
    for root in filter(None, roots):
        for snapshot in sorted(glob.glob(os.path.join(root, _PEER_CACHE_GLOB))):
            if os.path.isfile(os.path.join(snapshot, "tokenizer.json")) and "compact" not in root:
                return snapshot
    return None


def load_tokenizer(path: str | None = "auto"):
    """(tokenizer, description). `path`: a tokenizer directory, "auto" (the peer cache's Qwen tokenizer if found,
    else the padded char-level one) or "char" (always the padded char-level one)."""
    from transformers import AutoTokenizer

    from grpo_trainer.cli.toy import make_tokenizer

    if path == "auto":
        path = find_qwen_tokenizer() or "char"
    if path != "char":
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if len(tokenizer) >= 100_000:
            return tokenizer, f"{type(tokenizer).__name__} from {path} ({len(tokenizer)} tokens)"
        raise ValueError(f"the tokenizer at {path} has {len(tokenizer)} tokens; a real-size vocabulary is wanted")
    tokenizer = make_tokenizer(extra_vocab=QWEN_TOKENIZER_LENGTH - len(make_tokenizer()))
    return tokenizer, f"char-level toy tokenizer padded to {len(tokenizer)} tokens (no Qwen tokenizer found)"


def build_real_model(shape: str, tokenizer, seed: int = 0, dtype=None):
    """A randomly initialised Qwen2 causal LM with the public config of `shape`, its generation config set from
    `tokenizer` (EOS: the chat end token where the tokenizer has one, and the EOS token)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    eos = [tokenizer.eos_token_id]
    end = tokenizer.convert_tokens_to_ids("<|end|>") if "<|end|>" in tokenizer.get_vocab() else None
    if end is not None and end not in eos:
        eos.append(end)
    config = Qwen2Config(**QWEN_SHAPES[shape], pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                         bos_token_id=None, use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    return model


def parameter_count(model) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_real_model(shape: str, path: Path, tokenizer_path: str | None = "auto", seed: int = 0) -> str:
    """Build and save one real-shape model with its tokenizer at `path` (and a one-line `DESCRIPTION` file);
    returns that description."""
    tokenizer, description = load_tokenizer(tokenizer_path)
    model = build_real_model(shape, tokenizer, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    text = (f"{shape}: {parameter_count(model) / 1e6:.1f}M parameters, vocabulary {model.config.vocab_size}, "
            f"float32, seed {seed}; tokenizer: {description}")
    (Path(path) / "DESCRIPTION").write_text(text + "\n")
    return text


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Save a random-weight model of a real checkpoint's shape.")
    parser.add_argument("shape", choices=sorted(QWEN_SHAPES))
    parser.add_argument("path")
    parser.add_argument("--tokenizer", default="auto", help="a tokenizer directory, 'auto' or 'char'")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    print(save_real_model(cli.shape, Path(cli.path), cli.tokenizer, cli.seed))
