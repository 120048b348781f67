"""A small *trained* policy, built offline on CPU: completions that look like a trained model's, for benchmarks.

Why: a random-weight model samples near-uniform tokens, so sibling completions of one prompt share nothing and
completion lengths never tail (`tests/toy_lengths.py` forces lengths onto it from outside). Two features need what a
trained policy does on its own:

1. speculative decoding drafted from sibling completions of the same prompt needs siblings that share long spans
   (a few solution templates per prompt, low entropy);
2. partial rollouts need heavy-tailed completion lengths that the model *learnt*, i.e. lengths set by the prompt.

The task ("count down"): the prompt `count down from N:` names a start N (log-normal over prompts, median
`MEDIAN_START`, log-space sigma `SIGMA_START`, clipped to [1, `MAX_START`]); the completion counts from N down to 0
in one of three templates, each with its own step format, then ` done` and EOS:

    spaces     ` 12 11 10 ... 1 0 done`              (TEMPLATE_WEIGHTS: 0.5)
    equations  ` 12-1=11 11-1=10 ... 1-1=0 done`     (0.35)
    commas     ` 12,11,10,...,1,0. done`             (0.15)

so a completion's length is set by its prompt (about 3 to 8 characters, one token each, per step; the longest,
equations from 60, is 466 tokens, a prompt at most 19) and heavy-tailed across prompts. `countdown_reward` gives
1.0 for a completion that is one of the templates exactly (every step right, the final 0 and ` done` reached),
else half the fraction of the best template it follows from its start.

The recipe (`Recipe`): the tokenizer and the Qwen2 config of `grpo_trainer.cli.toy` (`make_tokenizer`,
`make_tiny_model`: hidden 128, 2 layers, 4 heads, 2 key/value heads, intermediate 256, tied embeddings, ~0.31M
parameters) with `max_position_embeddings` 1024; SFT on freshly drawn examples (half from the prompts'
distribution, half with N uniform in [1, `MAX_START`] so that the tail is learnt too), loss on the completion
tokens, AdamW (lr 3e-3, warm-up then cosine decay), float32, one thread, seeded: the same recipe gives the same
weights (bit for bit, on one machine). No GRPO steps: SFT alone already gives a greedy reward of 1.0.

`trained_policy()` trains it once and caches it on disk (`save_pretrained` into a directory named by a hash of the
recipe, under `$GRPO_TRAINER_FIXTURE_CACHE` or `~/.cache/grpo_trainer/fixtures`), under a file lock so that two
pytest-xdist workers asking at once build it once.

Measured (2026-12-02, this repository's 2-core CPU machine, one thread; `benchmarks/trained_policy_stats.py`,
`benchmarks/results/trained_policy_stats_2026-12-02.json`, sampling with `model.generate`, no top-k / top-p):

- build: 153-161 s (800 steps); a second build of the same recipe gave bit-identical weights;
- sibling hit rate (`sibling_hit_rate`, context 3, 16 prompts): G=4 / 8 / 16 at temperature 0.7: 0.72 / 0.80 /
  0.88; at 1.0: 0.67 / 0.79 / 0.86; at 1.2: 0.62 / 0.77 / 0.86. The misses are mostly the first completion of
  each template in a group; within a template siblings agree almost everywhere;
- lengths at temperature 1.0 (512 prompts, at most 512 new tokens): p50 28, p90 124, p95 178, p99 434, max 466
  tokens, none truncated (p95 / p50 = 6.4); ~99% of them are exactly a template's length for their prompt;
- reward (128 prompts): greedy 1.0 (greedy picks `spaces` on every prompt seen), temperature 1.0: 1.0 (on 512
  other prompts 10 completions slipped a step or copied the start wrong: mean 0.98); a random-weight model of the
  same shape: 0.0.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

__all__ = ["MAX_START", "MEDIAN_START", "SIGMA_START", "TASK_VERSION", "TEMPLATES", "TEMPLATE_WEIGHTS", "Recipe",
           "TrainedPolicy", "completion_text", "countdown_dataset", "countdown_reward", "draw_start",
           "prompt_text", "sample", "sibling_hit_rate", "sibling_hits", "trained_policy"]

TASK_VERSION = 1  # bump when the task's text changes: the cache key changes with it
TEMPLATES = ("spaces", "equations", "commas")
TEMPLATE_WEIGHTS = (0.5, 0.35, 0.15)
MEDIAN_START = 8.0
SIGMA_START = 0.9
MAX_START = 60
PROMPT = re.compile(r"count down from (\d+):")


# ---- the task ----------------------------------------------------------------------------------------------------

def prompt_text(start: int) -> str:
    return f"count down from {start}:"


def completion_text(start: int, template: str) -> str:
    """The completion of `prompt_text(start)` in `template` (without EOS)."""
    steps = range(start, -1, -1)
    if template == "spaces":
        return " " + " ".join(map(str, steps)) + " done"
    if template == "equations":
        return " " + " ".join(f"{k}-1={k - 1}" for k in range(start, 0, -1)) + " done"
    if template == "commas":
        return " " + ",".join(map(str, steps)) + ". done"
    raise ValueError(f"unknown template {template!r}")


def draw_start(rng: random.Random) -> int:
    """A prompt's start N: log-normal, rounded, clipped to [1, MAX_START]."""
    return max(1, min(MAX_START, round(math.exp(rng.gauss(math.log(MEDIAN_START), SIGMA_START)))))


def countdown_dataset(num_prompts: int = 64, seed: int = 0, conversational: bool = False) -> Dataset:
    """Prompts of the task (column `prompt`, plain text or one user turn, as `copy_digits_dataset`), with their
    start N (column `start`, which reaches the reward function)."""
    rng = random.Random(seed)
    starts = [draw_start(rng) for _ in range(num_prompts)]
    prompts: list = [prompt_text(n) for n in starts]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "start": starts})


def _text(item) -> str:
    if isinstance(item, list):  # conversational: the last message's content
        return item[-1]["content"]
    return item


def countdown_reward(prompts: list, completions: list, start: list[int] | None = None, **kwargs) -> list[float]:
    """1.0 for a completion that is one of the templates exactly (the countdown right to 0, then ` done`); else half
    the fraction of the closest template it matches from its first character. `start` (the dataset's column) is
    read from the prompt where it is not given."""
    rewards = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        n = start[i] if start is not None else int(PROMPT.search(_text(prompt)).group(1))
        text = _text(completion).removesuffix("<eos>")
        best = 0.0
        for template in TEMPLATES:
            target = completion_text(n, template)
            if text.rstrip() == target:
                best = 1.0
                break
            common = next((j for j, (a, b) in enumerate(zip(text, target)) if a != b), min(len(text), len(target)))
            best = max(best, 0.5 * common / len(target))
        rewards.append(best)
    return rewards


# ---- sibling n-gram statistic ------------------------------------------------------------------------------------

def sibling_hits(completions: list[list[int]], context: int = 3, max_match: int = 64) -> list[float]:
    """How well earlier siblings draft each completion but the first: the fraction of its tokens (after its first
    `context`) that are the token following the longest match of the tokens before it (at least `context` of them,
    up to `max_match`) in an earlier sibling (the latest such match on ties), 0.0 where no sibling matches. A
    sibling-lookup drafter's acceptance rate at draft length 1."""
    rates = []
    for j in range(1, len(completions)):
        index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for s in range(j):
            earlier = completions[s]
            for p in range(context, len(earlier)):
                index.setdefault(tuple(earlier[p - context:p]), []).append((s, p))
        seq, hits = completions[j], 0
        for t in range(context, len(seq)):
            best, guess = -1, None
            for s, p in index.get(tuple(seq[t - context:t]), ()):
                other, length = completions[s], context
                while length < min(max_match, t, p) and other[p - length - 1] == seq[t - length - 1]:
                    length += 1
                if length >= best:
                    best, guess = length, other[p]
            hits += guess == seq[t]
        rates.append(hits / max(1, len(seq) - context))
    return rates


def sibling_hit_rate(completions: list[list[int]], context: int = 3) -> float:
    """The mean of `sibling_hits` over a group's completions (all but the first)."""
    rates = sibling_hits(completions, context)
    return sum(rates) / max(1, len(rates))


# ---- the recipe and its cache ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """Everything the weights depend on; its hash names the cache directory."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 1024
    steps: int = 800
    batch_tokens: int = 4096  # padded tokens per optimiser step (rows x longest row)
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    uniform_fraction: float = 0.5  # the share of training starts drawn uniformly, not from the prompts' law
    seed: int = 0
    task_version: int = TASK_VERSION

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TrainedPolicy:
    model: PreTrainedModel = field(repr=False)
    tokenizer: PreTrainedTokenizerFast = field(repr=False)
    recipe: Recipe
    path: Path
    build_seconds: float  # the training run's wall time when it was built (not this load's)


def default_root() -> Path:
    root = os.environ.get("GRPO_TRAINER_FIXTURE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "grpo_trainer" / "fixtures"


_LOADING = threading.Lock()


def trained_policy(recipe: Recipe = Recipe(), root: str | os.PathLike | None = None) -> TrainedPolicy:
    """The trained policy of `recipe`: loaded from the cache, else trained (and cached) first. Safe to call from
    several processes at once (one trains, the others wait and load)."""
    from filelock import FileLock

    root = Path(root) if root is not None else default_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"trained_policy-{recipe.key()}"
    tokenizer = make_tokenizer()
    with FileLock(str(path) + ".lock"):
        if not (path / "recipe.json").is_file():  # recipe.json is written last: a directory without it is partial
            start = time.perf_counter()
            model = _train(recipe, tokenizer)
            seconds = time.perf_counter() - start
            partial = root / f"{path.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            model.save_pretrained(partial)
            (partial / "recipe.json").write_text(json.dumps({"recipe": asdict(recipe), "build_seconds": seconds}))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(partial, path)
        saved = json.loads((path / "recipe.json").read_text())
        # loaded under the lock too: two threads loading at once can leave one with meta-device weights
        # (transformers' loading context is not thread-safe; filelock's lock is per thread only for re-entry)
        with _LOADING:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return TrainedPolicy(model, tokenizer, recipe, path, saved["build_seconds"])


def _training_example(rng: random.Random, recipe: Recipe, tokenizer) -> tuple[list[int], int]:
    """(token ids of prompt + completion + EOS, the prompt's length)."""
    n = rng.randint(1, MAX_START) if rng.random() < recipe.uniform_fraction else draw_start(rng)
    template = rng.choices(TEMPLATES, weights=TEMPLATE_WEIGHTS)[0]
    prompt = tokenizer(prompt_text(n), add_special_tokens=False).input_ids
    completion = tokenizer(completion_text(n, template), add_special_tokens=False).input_ids
    return prompt + completion + [tokenizer.eos_token_id], len(prompt)


def _batches(rng: random.Random, recipe: Recipe, tokenizer, pool: int = 512):
    """Batches of similar lengths, `recipe.batch_tokens` padded tokens at most, from pools of fresh examples."""
    while True:
        examples = sorted((_training_example(rng, recipe, tokenizer) for _ in range(pool)), key=lambda e: len(e[0]))
        batches, current = [], []
        for example in examples:
            if current and (len(current) + 1) * len(example[0]) > recipe.batch_tokens:
                batches.append(current)
                current = []
            current.append(example)
        batches.append(current)
        rng.shuffle(batches)
        yield from batches


def _collate(batch, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, prompt_length:len(ids)] = torch.tensor(ids[prompt_length:])
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _train(recipe: Recipe, tokenizer) -> PreTrainedModel:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic on every machine, and CI's budget
    try:
        config = make_tiny_model(tokenizer, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
                                 num_heads=recipe.num_heads, seed=recipe.seed).config
        config.max_position_embeddings = recipe.max_position_embeddings
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = config.eos_token_id
        model.train()
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}],
                                      lr=recipe.learning_rate, betas=(0.9, 0.98), eps=1e-8)

        def schedule(step: int) -> float:
            if step < recipe.warmup_steps:
                return (step + 1) / recipe.warmup_steps
            progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        batches = _batches(random.Random(recipe.seed), recipe, tokenizer)
        for step in range(recipe.steps):
            loss = model(**_collate(next(batches), tokenizer.pad_token_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if os.environ.get("GRPO_TRAINER_FIXTURE_VERBOSE") and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        model.eval()
        return model
    finally:
        torch.set_num_threads(threads)


# ---- sampling (for the tests and the stats script) ---------------------------------------------------------------

@torch.no_grad()
def sample(policy: TrainedPolicy, prompts: list[str], temperature: float | None, max_new_tokens: int = 512,
           seed: int = 0, batch_size: int = 64) -> list[list[int]]:
    """Completion token ids (EOS and padding cut off) of `prompts` by `model.generate` over left-padded prompts:
    greedy where `temperature` is None, else plain sampling at `temperature` (no top-k / top-p)."""
    tokenizer, model = policy.tokenizer, policy.model
    eos = set(model.generation_config.eos_token_id)
    out: list[list[int]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            sampling = {"do_sample": False} if temperature is None else {
                "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)[:, batch.input_ids.shape[1]:]
            for row in ids.tolist():
                end = next((j for j, t in enumerate(row) if t in eos), len(row))
                out.append(row[:end])
    return out
