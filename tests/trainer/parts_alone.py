"""What the tests that build a trainer part alone share (test_off_policy_alone.py, test_policy_scorer_alone.py): a
tiny model, a hand-made round of it, and the log-probs a plain forward gives that round, the values every scorer
forward must reproduce."""

import torch

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.trainer.round import Round

TOKENIZER = make_tokenizer()
# B = 4 completions (2 prompts x G = 2) of T = 5 columns; rows of 5, 3, 4 and 5 tokens (the rest is padding)
LENGTHS = (5, 3, 4, 5)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """The test tokenizer's tiny Qwen2 (hidden 64, 2 layers), float32, without dropout (evaluation mode)."""
    return make_tiny_model(TOKENIZER, seed=seed).eval()


def hand_round(advantages=(1.0, -1.0, 0.5, -0.5), sampler: SamplerRecord | None = None) -> Round:
    """Two prompts of different lengths (the shorter one left-padded), each twice, with fixed completions of
    `LENGTHS` tokens (right-padded with the pad id)."""
    prompts = tokenize_prompts(TOKENIZER, ["copy 12:", "copy 12:", "copy 3456:", "copy 3456:"], None)
    generator = torch.Generator().manual_seed(0)
    vocabulary = len(TOKENIZER)
    ids = torch.randint(10, vocabulary, (4, max(LENGTHS)), generator=generator)  # [B, T], no special token
    mask = torch.tensor([[int(j < n) for j in range(max(LENGTHS))] for n in LENGTHS])  # [B, T]
    ids = ids.masked_fill(mask == 0, TOKENIZER.pad_token_id)
    return Round(prompt_ids=prompts.ids, prompt_mask=prompts.mask, completion_ids=ids, completion_mask=mask,
                 advantages=torch.tensor(advantages), sampler=sampler or SamplerRecord())


def plain_logps(model: torch.nn.Module, round_: Round) -> torch.Tensor:
    """`[B, T]` log pi(token) of each completion token by one plain forward (the full `[B, S + T, V]` logits, positions
    counting real tokens as `generate` counts them), 0 on padding: what a log-prob forward of the round must give."""
    ids, mask, width = round_.sequences()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()  # [B, S + T, V]
    logps = logits[:, -width - 1:-1].log_softmax(-1)  # [B, T, V]: position t predicts token t + 1
    return logps.gather(-1, round_.completion_ids[..., None]).squeeze(-1) * round_.completion_mask


def plain_entropy(model: torch.nn.Module, round_: Round) -> torch.Tensor:
    """`[B, T]` the entropy of each completion position's distribution by the same plain forward, 0 on padding."""
    ids, mask, width = round_.sequences()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    logps = logits[:, -width - 1:-1].log_softmax(-1)
    return -(logps.exp() * logps).sum(-1) * round_.completion_mask


def masked(values: torch.Tensor, round_: Round) -> torch.Tensor:
    """`values` `[B, T']` padded to the round's T and zeroed on its padding (a forward's values there mean nothing)."""
    width = round_.completion_ids.shape[1]
    return torch.nn.functional.pad(values, (0, width - values.shape[1])) * round_.completion_mask


class ForwardCount:
    """How many forwards `model` ran while this is open (a forward hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def __enter__(self) -> "ForwardCount":
        def counted(module, inputs, output):
            self.calls += 1

        self.handle = self.model.register_forward_hook(counted)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
