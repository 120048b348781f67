"""Point-mass drafts: the tokens most likely to follow a row's current suffix, read off token sequences the row's
sampler has reason to repeat.

Decisions:

1. A draft is the continuation, in some source sequence, of the longest suffix of the row's context (up to
   `max_match` tokens) that occurs there: n-gram lookup, as vLLM's `ngram` method and prompt-lookup decoding do,
   over an index updated as tokens are committed (`NgramIndex`, one dictionary insertion per suffix length per
   token), so a lookup costs no scan.
2. Sources (`settings.SOURCES`): "group", the completions of the same prompt in this round so far, the row's own
   included (a repeated step of its own); "history", that prompt's completions in earlier rounds (epochs > 1, a
   repeated prompt, `PromptHistory`); "prompt", the prompt's own tokens (prompt lookup). The longest suffix match
   over all of them wins (a sibling that matches one token is weaker evidence than an earlier completion that
   matches `max_match`); at equal length the earlier source in that order. Among occurrences of the same suffix,
   the one with the longest continuation.
3. A completion's context starts with a marker (`START`), so the first tokens of a completion are drafted from the
   first tokens of its siblings' and earlier completions.
4. Drafts change how many tokens a forward commits, never which (`verify`). They do change the widths the decoder
   computes at, and so the float rounding of the values kept: the history is part of a checkpoint
   (`PromptHistory.state_dict`), so that a resumed run drafts, and computes, as the straight run.
5. Memory. An n-gram index costs about 1 KB per indexed token (Python dictionaries), so it exists only where it is
   used: the round's own tokens (its siblings' and prompts', for the round), and the history's indexes for the
   prompts being drafted (rebuilt from the kept tokens, about 3 us per token, and cached for the most recent
   ones). What outlives a round is the history's tokens, 4 bytes each, `history_tokens` in all (64 MiB by
   default).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Sequence

from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

__all__ = ["INDEX_BYTES_PER_TOKEN", "INDEX_CACHE_TOKENS", "START", "Drafter", "NgramIndex", "PromptHistory"]

START = -1  # before a completion's first token (decision 3); never a token id

# Occurrences of one n-gram looked at per lookup, the most recent first: a frequent n-gram (a space) would
# otherwise make a lookup scan every place it occurred.
_OCCURRENCES = 8
# What an n-gram index holds per token (decision 5, `max_match` 4: measured 1.0 KB in tests/rollout/speculative/
# test_drafts.py; the memory planner's figure), and the history tokens whose indexes are kept between rounds.
INDEX_BYTES_PER_TOKEN = 1024
INDEX_CACHE_TOKENS = 2**16


class NgramIndex:
    """Where every n-gram (n = 1..max_match) of some sequences ends, for continuation lookups (decision 1)."""

    def __init__(self, max_match: int) -> None:
        self.max_match = max_match
        self.sequences: list[list[int]] = []
        self.ends: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)  # n-gram -> (sequence, end)

    def add(self, tokens: Sequence[int]) -> int:
        """A new sequence (indexed); its id for `extend`."""
        self.sequences.append([])
        self.extend(len(self.sequences) - 1, tokens)
        return len(self.sequences) - 1

    def extend(self, sequence: int, tokens: Sequence[int]) -> None:
        seq = self.sequences[sequence]
        for token in tokens:
            seq.append(token)
            end = len(seq)
            for n in range(1, min(self.max_match, end) + 1):
                self.ends[tuple(seq[end - n:])].append((sequence, end))

    def continuation(self, context: Sequence[int], limit: int, longest: int | None = None) -> tuple[int, list[int]]:
        """The longest suffix of `context` (at most `longest` tokens) found here with something after it: its length
        and up to `limit` tokens following it; (0, []) if there is none."""
        for n in range(min(self.max_match if longest is None else longest, len(context)), 0, -1):
            occurrences = self.ends.get(tuple(context[-n:]))
            if not occurrences:
                continue
            best: list[int] = []
            for sequence, end in occurrences[-_OCCURRENCES:][::-1]:
                following = self.sequences[sequence][end:end + limit]
                if len(following) > len(best):
                    best = following
                    if len(best) == limit:
                        break
            if best:
                return n, best
        return 0, []


class PromptHistory:
    """Each prompt's most recent completions across rounds (source "history", decision 5): kept as int32 arrays
    under a digest of the prompt, at most `history_per_prompt` per prompt and `history_tokens` tokens in all (the
    least recently used prompt dropped first); indexed when a round drafts the prompt, the indexes of the most
    recently drafted prompts kept up to `INDEX_CACHE_TOKENS`. A lock guards it: asynchronous rounds sample on a
    producer thread while evaluation rounds sample on the main one."""

    def __init__(self, settings: SpeculativeSettings) -> None:
        self.settings = settings
        self.completions: OrderedDict[bytes, list[array]] = OrderedDict()
        self.tokens = 0  # kept in `completions`
        self.indexes: OrderedDict[bytes, tuple[NgramIndex, int]] = OrderedDict()  # -> (index, its tokens)
        self.indexed = 0
        self.lock = threading.Lock()

    def state_dict(self) -> dict:
        """The kept completions, in use order, for a checkpoint (the indexes are rebuilt from them)."""
        with self.lock:
            return {"completions": [(key, [c.tobytes() for c in kept]) for key, kept in self.completions.items()]}

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.completions = OrderedDict(
                (key, [array("i", bytes(c)) for c in kept]) for key, kept in state["completions"])
            self.tokens = sum(len(c) for kept in self.completions.values() for c in kept)
            self.indexes.clear()
            self.indexed = 0

    @staticmethod
    def key(prompt: Sequence[int]) -> bytes:
        return hashlib.blake2b(array("i", prompt).tobytes(), digest_size=16).digest()

    def index(self, prompt: Sequence[int]) -> NgramIndex | None:
        """The n-gram index of `prompt`'s kept completions (each after `START`), or None if none is kept."""
        key = self.key(prompt)
        with self.lock:
            kept = self.completions.get(key)
            if kept is None:
                return None
            self.completions.move_to_end(key)
            if key in self.indexes:
                self.indexes.move_to_end(key)
                return self.indexes[key][0]
            index = NgramIndex(self.settings.max_match)
            for completion in kept:
                index.add([START, *completion])
            size = sum(map(len, kept))
            self.indexes[key] = (index, size)
            self.indexed += size
            while self.indexed > INDEX_CACHE_TOKENS and len(self.indexes) > 1:
                self.indexed -= self.indexes.popitem(last=False)[1][1]
            return index

    def add(self, prompt: Sequence[int], completions: list[list[int]]) -> None:
        """A round's completions of `prompt` (each up to and including its EOS): the most recent kept."""
        key = self.key(prompt)
        with self.lock:
            kept = self.completions.pop(key, [])
            self.tokens -= sum(map(len, kept))
            kept = (kept + [array("i", c) for c in completions])[-self.settings.history_per_prompt:]
            self.completions[key] = kept
            self.tokens += sum(map(len, kept))
            if key in self.indexes:  # rebuilt at its next use (a round drafting from the old one keeps it)
                self.indexed -= self.indexes.pop(key)[1]
            while self.tokens > self.settings.history_tokens and len(self.completions) > 1:
                _, dropped = self.completions.popitem(last=False)
                self.tokens -= sum(map(len, dropped))


class Drafter:
    """A round's drafts (decision 2). `groups[b]`: row b's group (its prompt's rows); `prompts[g]`: group g's real
    prompt tokens. Rows' committed tokens come in through `commit`."""

    def __init__(self, settings: SpeculativeSettings, groups: list[int], prompts: list[tuple[int, ...]],
                 history: PromptHistory | None) -> None:
        self.settings, self.groups, self.prompt_tokens = settings, groups, prompts
        self.siblings = [NgramIndex(settings.max_match) for _ in prompts]
        self.rows = [self.siblings[g].add([START]) for g in groups]  # row -> its sequence in its group's index
        use_history = history is not None and "history" in settings.sources
        self.earlier = [history.index(p) if use_history else None for p in prompts]
        self.prompt_index = []
        for tokens in prompts:
            index = NgramIndex(settings.max_match)
            index.add(tokens)
            self.prompt_index.append(index)
        self.history = history

    def context(self, row: int) -> list[int]:
        return self.siblings[self.groups[row]].sequences[self.rows[row]]

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        self.siblings[self.groups[row]].extend(self.rows[row], tokens)

    def draft(self, row: int, limit: int) -> list[int]:
        """Up to `limit` draft tokens for `row`'s next positions (decision 2); [] for none."""
        if limit <= 0:
            return []
        group, context = self.groups[row], self.context(row)
        best_match, best = 0, []
        for source in self.settings.sources:  # a longer match wins; at equal length the earlier source
            if source == "group":
                match, found = self.siblings[group].continuation(context, limit)
            elif source == "history":
                index = self.earlier[group]
                match, found = (0, []) if index is None else index.continuation(context, limit)
            else:  # the prompt has no START
                match, found = self.prompt_index[group].continuation(context[1:], limit)
            if match > best_match:
                best_match, best = match, found
                if match == min(self.settings.max_match, len(context)):
                    break
        return best

    def remember(self, completions: list[list[int]]) -> None:
        """The round's completions (each to its EOS) into the history, per prompt, for later rounds."""
        if self.history is None:
            return
        by_group: dict[int, list[list[int]]] = defaultdict(list)
        for row, completion in enumerate(completions):
            by_group[self.groups[row]].append(completion)
        for group, rows in by_group.items():
            self.history.add(self.prompt_tokens[group], rows)
