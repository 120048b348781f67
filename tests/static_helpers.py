"""Test-only helpers for the static decode steps (`rollout.fast.static`), shared by tests/rollout/fast/test_static.py
(CPU) and tests/gpu/test_static_decode.py (CUDA): prompts of four lengths in groups, settings whose rows end at
different steps, and a decode that records every compaction."""

import pytest
import torch

from grpo_trainer.rollout.fast import backend as fast_backend
from grpo_trainer.rollout.fast import static
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import greedy_config


def varied_prompts(tokenizer, groups: int = 4, repeats: int = 4):
    texts = [t for t in ["copy 123:", "copy 98765:", "c", "abc d"][:groups] for _ in range(repeats)]
    return tokenize_prompts(tokenizer, texts, None)


def early_eos_config(tokenizer, model, prompts, repeats: int = 4, **overrides):
    """Greedy settings whose EOS tokens end every group but one within a few steps while that one runs to the
    limit (mixed lengths: 12 of 16 rows end, so the step shrinks to a bucket of 4 rows mid-round)."""
    with torch.no_grad():
        free = generate_rollout(model, prompts, greedy_config(tokenizer, max_new_tokens=24)).completion_ids
    groups = free[::repeats]  # one row per group: greedy rows of a group are identical
    for runner in range(groups.shape[0]):
        forbidden = set(groups[runner].tolist())
        eos = [next((tok for tok in groups[g, 1:8].tolist() if tok not in forbidden), None)
               for g in range(groups.shape[0]) if g != runner]
        if None not in eos:
            return greedy_config(tokenizer, max_new_tokens=24, eos_token_id=sorted(set(eos)), **overrides)
    raise AssertionError("the test needs tokens that end all groups but one")


def decode(model, prompts, config, mode, seed=0, outputs=None, steps=None, runs=None):
    """`backend._decode` in `mode` from a seed; appends (step, rows stepped, cache data pointers) per compaction
    to `steps`, and the `static.StaticSteps` that stepped the round to `runs` (its graphs, its compactions)."""
    torch.manual_seed(seed)
    calls, made = [], []
    compact, init = static.StaticSteps._compact, static.StaticSteps.__init__

    def spy_compact(self, n, t):
        calls.append((t, n, [cache.data_ptr() for cache in (*self.decoder.keys, *self.decoder.values)]))
        return compact(self, n, t)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(static.StaticSteps, "_compact", spy_compact)
        patch.setattr(static.StaticSteps, "__init__", spy_init)
        decoded = fast_backend._decode(model, config, prompts, outputs=outputs, mode=mode)
    if steps is not None:
        steps.extend(calls)
    if runs is not None:
        runs.extend(made)
    return decoded
