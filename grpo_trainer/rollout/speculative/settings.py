"""The options of speculative rollouts (`GRPOConfig.speculative_rollouts` and its fields, read by
`config.settings.speculative_settings`).

Shapes: `N` live rows of a forward, `Q` positions each (the row's last token and up to `Q - 1` draft tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["POLICIES", "SOURCES", "SpeculativeSettings"]

# Where drafts come from, tried in this order for every draft (`drafts.Drafter`): the other completions of the same
# prompt in the round, the same prompt's completions in earlier rounds, the prompt itself.
SOURCES = ("group", "history", "prompt")
# How wide a forward is made (`policy`): "fixed" drafts what the per-row lengths and `max_verify_tokens` allow (the
# default: a seeded run computes at the same widths every time, so it reproduces bit for bit); "measured" times the
# forwards and drafts where that pays on this device (the same tokens, values at other widths' float rounding).
POLICIES = ("measured", "fixed")


@dataclass(frozen=True)
class SpeculativeSettings:
    """How the fast decoder drafts and verifies (`rollout.speculative`)."""

    max_draft_tokens: int = 8  # a row's most draft tokens per forward (`policy.DraftPolicy`)
    # the most query positions in one forward, N x Q: past it drafts are cut (a compute-bound forward costs per
    # position, so a full batch drafts little and a batch's tail, a few long rows, drafts the most)
    max_verify_tokens: int = 256
    max_match: int = 4  # the longest suffix (in tokens) matched against a source; 1 is the shortest
    sources: tuple[str, ...] = SOURCES
    history_per_prompt: int = 16  # completions kept per prompt for later rounds' drafts ("history")
    history_tokens: int = 2**24  # their tokens kept in all (int32: 64 MiB), the least recently drafted prompt dropped
    policy: str = "fixed"

    def __post_init__(self) -> None:
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown or not self.sources:
            raise ValueError(f"speculative sources {list(self.sources)}: choose from {list(SOURCES)}.")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative policy {self.policy!r}: choose from {list(POLICIES)}.")
        for name in ("max_draft_tokens", "max_verify_tokens", "max_match", "history_per_prompt", "history_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative {name}={getattr(self, name)}: must be at least 1.")
