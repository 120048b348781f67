"""The objects that cross the rollout boundary: the prompts going in (`PromptBatch`, with a vision-language model's
`ImageInputs`), the completions coming out (`Rollout`), and the end every backend gives its completions the same way
(`end_at_first_eos`: the EOS ids and pad id of the generation config, the mask up to the first EOS, padding after it).

`SamplerRecord` says how a rollout was sampled (which sampler, which weights, the sampler's log-probs, kept supports
under truncated sampling, what it captured for replay); it travels with the round to the last micro-step, and every
consumer (old log-probs, importance sampling, the off-policy mask, the mismatch report) reads it.

`ImageInputs` (built by `rollout.multimodal`) holds the model inputs a processor returned beside the prompt ids: token
fields aligned with the prompt columns, image fields with their own leading axis (`U` entries: images or patches),
and how many entries of each image field every row owns, so rows can be selected and columns trimmed.

Shapes: `B` rows (each prompt already repeated G times), `S` prompt tokens, `T` completion tokens, `L` decoder
layers, `E` hidden size, `V` vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

__all__ = ["DecodeCounts", "ImageInputs", "KeptSupports", "PromptBatch", "ReplayCapture", "Rollout", "RoundEnd",
           "SamplerKind", "SamplerRecord", "completion_mask", "end_at_first_eos", "special_tokens"]


def _index(index: slice | Tensor, rows: int, device: torch.device) -> Tensor:
    return torch.arange(rows, device=device)[index] if isinstance(index, slice) else index.to(device)


@dataclass
class ImageInputs:
    """The model inputs a processor returned beside the prompt ids, for `B` rows (`rollout.multimodal`, decision 1)."""

    token_fields: dict[str, Tensor] = field(default_factory=dict)  # name -> [B, S], aligned with the prompt ids
    image_fields: dict[str, Tensor] = field(default_factory=dict)  # name -> [U, ...]
    units: dict[str, Tensor] = field(default_factory=dict)  # name -> [B] long: entries of that image field per row

    def select_rows(self, index: slice | Tensor) -> ImageInputs:
        """The inputs of rows `index` (a slice or a `[b]` index tensor, in any order)."""
        token_fields = {k: v[index] for k, v in self.token_fields.items()}
        image_fields, units = {}, {}
        for name, value in self.image_fields.items():
            counts = self.units[name]  # [B]
            rows = _index(index, counts.shape[0], counts.device)  # [b]
            starts = counts.cumsum(0) - counts  # [B] first entry of each row
            kept = counts[rows]  # [b]
            # entry e of the selection belongs to kept row r and is starts[r] + (e - first entry of r in selection)
            offsets = torch.repeat_interleave(starts[rows] - (kept.cumsum(0) - kept), kept)
            entries = offsets + torch.arange(int(kept.sum()), device=counts.device)
            image_fields[name] = value[entries.to(value.device)]
            units[name] = kept
        return ImageInputs(token_fields, image_fields, units)

    def select_columns(self, columns: slice) -> ImageInputs:
        """The token fields' prompt `columns` (trimming padding); image fields unchanged."""
        return ImageInputs({k: v[:, columns] for k, v in self.token_fields.items()}, self.image_fields, self.units)

    def pad_columns(self, widths: tuple[int, int]) -> ImageInputs:
        """Token fields padded with zeros by `(left, right)` prompt columns."""
        padded = {k: nn.functional.pad(v, widths) for k, v in self.token_fields.items()}
        return ImageInputs(padded, self.image_fields, self.units)

    @staticmethod
    def concat(parts: list[ImageInputs]) -> ImageInputs:
        """The rows of `parts` in order (their token fields already of one width: `pad_columns`)."""
        first = parts[0]
        return ImageInputs({k: torch.cat([p.token_fields[k] for p in parts]) for k in first.token_fields},
                           {k: torch.cat([p.image_fields[k] for p in parts]) for k in first.image_fields},
                           {k: torch.cat([p.units[k] for p in parts]) for k in first.units})

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs({k: v.to(device) for k, v in self.token_fields.items()},
                           {k: v.to(device) for k, v in self.image_fields.items()},
                           {k: v.to(device) for k, v in self.units.items()})

    def model_inputs(self, completion_width: int = 0) -> dict[str, Tensor]:
        """Keyword arguments for the model: token fields over `S + completion_width` columns (zeros over the
        completion), and the image fields."""
        inputs = {k: nn.functional.pad(v, (0, completion_width)) for k, v in self.token_fields.items()}
        return {**inputs, **self.image_fields}

    @property
    def has_images(self) -> bool:
        return any(value.shape[0] > 0 for value in self.image_fields.values())


SamplerKind = Literal["decoder", "generate", "engine", "rollout_func"]
_COMPLETION, _SEQUENCE = "completion", "sequence"


def _columns(axis: str, dim: int = 1) -> Any:
    """A record field spanning the completion columns (or the whole sequence) from dimension `dim`."""
    return field(default=None, metadata={"columns": axis, "dim": dim})


def _mapped(record: Any, fn: Callable[[Tensor, str, int], Tensor]) -> Any:
    """`record` (a frozen dataclass of column fields and nested records) with `fn(value, axis, dim)` applied to
    every tensor it holds."""
    values = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if dataclasses.is_dataclass(value):
            values[f.name] = _mapped(value, fn)
        elif isinstance(value, Tensor) and "columns" in f.metadata:
            values[f.name] = fn(value, f.metadata["columns"], f.metadata["dim"])
    return dataclasses.replace(record, **values)


def _joined(records: list[Any]) -> dict[str, Any]:
    """The tensor fields of `records` (one type) concatenated along the rows; None where some record has none."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(records[0]):
        column = [getattr(r, f.name) for r in records]
        if dataclasses.is_dataclass(column[0]):
            values[f.name] = dataclasses.replace(column[0], **_joined(column))
        elif "columns" in f.metadata:
            values[f.name] = None if any(v is None for v in column) else torch.cat(column)
    return values


class _Columns:
    """Row selection, column trimming, padding and concatenation of a record whose fields declare their columns
    (`Round`'s decision 1, for the record's tensors)."""

    def select_rows(self, index: slice | Tensor) -> Any:
        return _mapped(self, lambda value, axis, dim: value[index])

    def select_columns(self, keep: dict[str, slice]) -> Any:
        """`keep`: axis (`completion`, `sequence`) -> the columns kept."""
        return _mapped(self, lambda value, axis, dim: value[(slice(None),) * dim + (keep[axis],)])

    def pad_columns(self, sides: dict[str, tuple[int, int]]) -> Any:
        """Zeros on each axis' `(left, right)` sides (F.pad counts its pairs from the last dimension backwards)."""
        return _mapped(self, lambda value, axis, dim: nn.functional.pad(
            value, (0, 0) * (value.dim() - dim - 1) + sides[axis]))


@dataclass(frozen=True)
class KeptSupports(_Columns):
    """Truncated sampling (top-k / top-p / min-p, `algorithms.truncation`) as the sampler knew it at draw time (the
    fast loop), or, for `mask`, as the trainer's first forward at the sampling weights collected it."""

    # the kept support of each position, packed (bit v % 8 of byte v // 8: token v could be drawn)
    mask: Tensor | None = _columns(_COMPLETION)  # [B, T, ceil(V / 8)] uint8
    log_mass: Tensor | None = _columns(_COMPLETION)  # [B, T] log of the mass the tempered softmax put on it
    # each token's log-prob under the processed distribution it was drawn from (after every logits processor)
    drawn_logps: Tensor | None = _columns(_COMPLETION)  # [B, T]


@dataclass(frozen=True)
class ReplayCapture(_Columns):
    """What the sampler captured for the loss to replay (`capture.Capture`, `modeling.replay`)."""

    probs: Tensor | None = _columns(_COMPLETION)  # [B, T, V] the whole tempered softmax at every step
    # every decoder layer's output at every prompt and completion column (zeros for the last completion token)
    layer_outputs: Tensor | None = _columns(_SEQUENCE, dim=2)  # [B, L, S + T, E]


@dataclass(frozen=True)
class SamplerRecord(_Columns):
    """How a round was sampled: by which sampler, with which weights, and what the sampler knew of each token.

    `logps` are the sampler's own log-prob of each sampled token: an engine's (vLLM, a `rollout_func`: computed by
    other kernels, so never a stand-in for the trainer's values; NaN where it gave none, 0 on padding) or the
    in-process sampler's. `exact`: they and `entropy` are computed as the loss computes them (the full tempered
    softmax, or the kept supports' softmax under `keep_sampling_mask`) at the weights the loss starts from, so they
    stand in for the loss forward's own values (`capture.drop_unusable` clears `exact` values that are not; the
    off-policy preparation clears `exact` once the weights moved)."""

    kind: SamplerKind = "generate"
    version: int = 0  # optimizer steps the sampling weights had taken
    logps: Tensor | None = _columns(_COMPLETION)  # [B, T] float32
    entropy: Tensor | None = _columns(_COMPLETION)  # [B, T] float32, `exact` only
    exact: bool = False
    kept: KeptSupports = field(default_factory=KeptSupports)
    replay: ReplayCapture = field(default_factory=ReplayCapture)
    # A Mixture-of-Experts model's routing (`modeling.routing`, `capture.routed`): the experts the sampler chose for
    # every prompt and completion token in every MoE layer, coded expert + 1 (0, as padding: not recorded, routes
    # freely). Replayed by every forward of the round, so it outlives the stand-ins (`without_stand_ins`).
    routes: Tensor | None = _columns(_SEQUENCE)  # [B, S + T, L, k] uint8 / int16
    # Partial rollouts (`rollout.partial`): the optimizer step of the weights that sampled each token, where a
    # round's rows were sampled over several rounds; None: every token was sampled at `version`.
    versions: Tensor | None = _columns(_COMPLETION)  # [B, T] long

    @property
    def stand_ins(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """(log-probs, entropies, softmax) that replace the loss forward's own values; Nones unless `exact`."""
        return (self.logps, self.entropy, self.replay.probs) if self.exact else (None, None, None)

    def without_stand_ins(self) -> SamplerRecord:
        """The record once the weights moved past the sampling ones: the sampler's log-probs stay (what it drew
        from), nothing stands in for the loss's values and nothing is replayed."""
        return dataclasses.replace(self, entropy=None, exact=False, replay=ReplayCapture())

    @staticmethod
    def concat(records: list[SamplerRecord]) -> SamplerRecord:
        """The rows of `records` in order (their columns already of one width): a tensor some lack is dropped; the
        oldest version is kept."""
        return dataclasses.replace(records[0], version=min(r.version for r in records),
                                   exact=all(r.exact for r in records), **_joined(records))


@dataclass(frozen=True)
class RoundEnd:
    """Partial rollouts (`rollout.partial`): when a rollout may end before every row has. Rows belong to groups;
    a group is complete once every one of its rows in the batch has ended (a group with no row here already is),
    and the rollout may end once `needed` groups are complete, the `required` ones among them. Each row also ends
    after its own budget of new tokens (a resumed row's share of `max_completion_length`)."""

    groups: Tensor  # [B] long: each row's group, in [0, Q)
    needed: int  # complete groups that end the rollout
    required: Tensor  # [Q] bool: groups that must be complete before it ends
    budgets: Tensor  # [B] long: each row's most new tokens

    def complete(self, finished: Tensor) -> Tensor:
        """`[Q]` bool: the groups whose rows have all ended, given each row's `finished` `[B]`."""
        open_rows = torch.zeros(self.required.shape[0], dtype=torch.long, device=finished.device)
        return open_rows.scatter_add_(0, self.groups.to(finished.device), (~finished).long()) == 0

    def reached(self, finished: Tensor) -> bool:
        complete = self.complete(finished)
        return int(complete.sum()) >= self.needed and bool((complete | ~self.required.to(complete.device)).all())

    def to(self, device: torch.device | str) -> RoundEnd:
        return RoundEnd(self.groups.to(device), self.needed, self.required.to(device), self.budgets.to(device))


@dataclass
class PromptBatch:
    """Tokenised prompts, one row per completion to sample."""

    ids: Tensor  # [B, S] left-padded, so every completion starts at the same column
    mask: Tensor  # [B, S] 1 for real tokens
    # A vision-language model's inputs beside the ids (pixel values, image grids, token types), when a processor
    # tokenised the prompts (`rollout.multimodal`); None for a tokenizer's prompts.
    images: ImageInputs | None = None
    # The same prompts' images as given (PIL images, each row's in the order of its image parts), for an inference
    # engine that processes them itself (vLLM); None for a tokenizer's prompts.
    image_lists: list[list] | None = None
    # Partial rollouts: the rule by which the rollout may end before every row has (`RoundEnd`); None: it ends once
    # every row has. Only the fast decoder's plain loop honours one; every other sampler refuses it.
    end: RoundEnd | None = None

    def to(self, device: torch.device | str) -> PromptBatch:
        images = None if self.images is None else self.images.to(device)
        end = None if self.end is None else self.end.to(device)
        return PromptBatch(self.ids.to(device), self.mask.to(device), images, self.image_lists, end)

    def distinct_rows(self) -> tuple[Tensor, Tensor]:
        """Indices of the first row of each run of identical consecutive rows `[P]` (a prompt's G copies), and
        each row's run `[B]`."""
        same = (self.ids[1:] == self.ids[:-1]).all(1) & (self.mask[1:] == self.mask[:-1]).all(1)  # [B-1]
        starts = torch.cat([same.new_ones(1), ~same])  # [B]
        return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


@dataclass(frozen=True)
class DecodeCounts:
    """What a round's decoding cost, in units that transfer between devices (`rollout.speculative`): a decode step
    costs about the same for few rows as for many on a GPU, so `forwards` (sequential decoder forwards after the
    prefill) is its time; `row_forwards / generated` is decoder forwards per generated token (1 without drafts)."""

    forwards: int = 0  # decoder forwards after the prefill
    row_forwards: int = 0  # rows fed, summed over those forwards
    positions: int = 0  # query positions fed, summed (N x Q per forward: the compute)
    generated: int = 0  # tokens committed, every row's up to its end
    drafted: int = 0  # draft tokens fed for verification
    accepted: int = 0  # of them, committed

    def metrics(self) -> dict[str, float]:
        """The round's `speculative/...` metrics."""
        return {
            "speculative/decode_steps": float(self.forwards),
            "speculative/forwards_per_token": self.row_forwards / max(1, self.generated),
            "speculative/drafted_tokens": float(self.drafted),
            "speculative/accepted_tokens": float(self.accepted),
            "speculative/acceptance_rate": self.accepted / max(1, self.drafted),
            "speculative/mean_accepted_length": self.generated / max(1, self.row_forwards),
            "speculative/draft_share": self.accepted / max(1, self.generated),
        }


@dataclass
class Rollout:
    """One generation round's completions on one process, as a backend returns them."""

    prompt_ids: Tensor  # [B, S] left-padded
    prompt_mask: Tensor  # [B, S]
    completion_ids: Tensor  # [B, T] right-padded with the pad id
    completion_mask: Tensor  # [B, T] 1 up to and including the first EOS
    is_truncated: Tensor  # [B] bool: the completion never emitted EOS
    # How the completions were sampled: the sampler's log-probs, kept supports and replay capture (`SamplerRecord`).
    sampler: SamplerRecord = field(default_factory=lambda: SamplerRecord())
    # Multi-turn rollouts (`rollout.multiturn`): 1 for completion tokens the policy sampled, 0 for tokens a tool or
    # environment wrote. None: the policy sampled every completion token.
    env_mask: Tensor | None = None  # [B, T] int
    # What decoding cost, where a backend counts it (the fast decoder with speculative rollouts); None elsewhere.
    decode: DecodeCounts | None = None

    @property
    def sampled_mask(self) -> Tensor:
        """`[B, T]` 1 for the completion tokens the policy sampled (what lengths and token counts count)."""
        return self.completion_mask if self.env_mask is None else self.completion_mask * self.env_mask


def completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask `[B, T]` that keeps each row up to and including its first EOS, and `[B]` truncated flags."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    # Number of EOS strictly before each position: 0 means "still inside the completion".
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).int(), ~is_eos.any(dim=1)


def special_tokens(config: GenerationConfig) -> tuple[list[int], int]:
    """The EOS ids and the pad id a rollout under `config` uses (generate's fallback: the first EOS pads)."""
    eos = config.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return eos, config.pad_token_id if config.pad_token_id is not None else eos[0]


def end_at_first_eos(completion_ids: Tensor, config: GenerationConfig) -> tuple[Tensor, Tensor, Tensor]:
    """A backend's completions `[B, T]` as a `Rollout` holds them, every token after a row's first EOS replaced by
    the pad id; with their mask `[B, T]` and truncated flags `[B]` (`completion_mask`)."""
    eos, pad = special_tokens(config)
    mask, truncated = completion_mask(completion_ids, eos)
    return completion_ids.masked_fill(mask == 0, pad), mask, truncated
