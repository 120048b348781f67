"""Image inputs of vision-language models, from the processor to the loss forward: one typed `ImageInputs`.

A processor (`transformers.ProcessorMixin`) returns, beside `input_ids` and `attention_mask`, whatever its model
takes: `pixel_values`, `image_grid_thw`, `image_sizes`, `pixel_attention_mask`, `token_type_ids`,
`mm_token_type_ids`, ... These travel with the prompts to `generate` and to every log-prob forward (policy, old,
reference), through every row selection (micro-batches, the reference's chunks, skipped rows).

Decisions:

1. Two kinds of fields. Token fields `[B, S]` (`token_type_ids`, `mm_token_type_ids`) span the prompt columns:
   they are trimmed and padded with the prompt ids, and extended with zeros over the completion columns for the
   forward (a completion holds no image). Image fields have a leading axis of their own, not one entry per row:
   patches of all images (Qwen2-VL's `pixel_values`), images (`image_grid_thw`, `image_sizes`, Gemma 3's and
   LLaVA's `pixel_values`) or rows (Idefics3's `pixel_values` and `pixel_attention_mask`). Each image field
   records how many entries along that axis each row owns (`units`), so selecting rows gathers exactly their
   entries, whatever the layout. A layout none of these explains (tile-indexed InternVL / LFM2-VL) is refused
   with the field's name.
2. Prompts go through the processor's own chat template (`apply_chat_template(tokenize=True)`, as TRL does), which
   expands each image part into as many image tokens as the vision tower yields features.
3. `max_prompt_length` never cuts image tokens: a row keeps every token of its image spans (image tokens and the
   special tokens around them) and the last text tokens that fit, in their order.
4. Positions: a model that derives positions from its image inputs (M-RoPE, `get_rope_index`: the Qwen-VL family)
   is given none when a batch has images, and computes them as `generate` did; every other model gets the
   attention-mask positions `generate` uses.
5. A completion must not sample an image placeholder token (its features would not exist): sampling suppresses
   the model's image (and video) token ids, as TRL does.
6. An inference engine that processes images itself (vLLM) takes the prompt as the chat template wrote it, each
   image as its placeholder, and expands the placeholders the way its own processor does. `unexpanded_ids` undoes
   the processor's expansion, image by image, with the processor itself (what it puts in place of the placeholder
   for that image), so the engine starts from the same text; the engine's expanded ids are then checked against
   the trainer's (`rollout.vllm`).

Shapes: `B` rows, `S` prompt columns, `T` completion columns, `U` entries of an image field.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from transformers import ProcessorMixin

from grpo_trainer.data.checks import is_conversational
from grpo_trainer.data.images import count_images, prompt_images, with_images
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.types import ImageInputs, PromptBatch

__all__ = ["forward_inputs", "image_placeholder", "image_token_ids", "is_processor", "protected_columns",
           "split_fields", "text_tokenizer", "tokenize_with_processor", "truncate_keeping", "unexpanded_ids"]

logger = logging.getLogger(__name__)


def is_processor(processing_class: Any) -> bool:
    return isinstance(processing_class, ProcessorMixin)


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def _units(name: str, value: Tensor, images_per_row: Tensor, patches_per_row: Tensor | None) -> Tensor:
    """How many entries of image field `name` each row owns (decision 1)."""
    entries, rows = value.shape[0], images_per_row.shape[0]
    if patches_per_row is not None and entries == int(patches_per_row.sum()):
        return patches_per_row
    if entries == int(images_per_row.sum()):
        return images_per_row
    if entries == rows:
        return torch.ones_like(images_per_row)
    raise ValueError(f"the processor's {name!r} has {entries} entries for {rows} prompts holding "
                     f"{int(images_per_row.sum())} images: neither one per image, per image patch (image_grid_thw) "
                     "nor per prompt. This tile-indexed layout is not supported; use a model whose processor returns "
                     "one of those layouts.")


def split_fields(encoded: dict, images_per_row: list[int]) -> ImageInputs:
    """The processor's outputs other than `input_ids` / `attention_mask`, sorted into token and image fields."""
    ids = encoded["input_ids"]
    counts = torch.tensor(images_per_row, dtype=torch.long)
    grid = encoded.get("image_grid_thw")
    patches = None
    if isinstance(grid, Tensor) and grid.shape[0] == int(counts.sum()):
        per_image = grid.prod(-1)  # [images] patches of each image
        patches = torch.stack([part.sum() for part in per_image.split(images_per_row)]) if len(per_image) else \
            torch.zeros_like(counts)
    inputs = ImageInputs()
    for name, value in encoded.items():
        if name in ("input_ids", "attention_mask"):
            continue
        if not isinstance(value, Tensor):
            raise ValueError(f"the processor returned {name!r} as {type(value).__name__}, not a tensor; call it with "
                             "return_tensors='pt'.")
        if value.dim() == 2 and value.shape == ids.shape:
            inputs.token_fields[name] = value
        else:
            inputs.image_fields[name] = value
            inputs.units[name] = _units(name, value, counts, patches)
    return inputs


def tokenize_with_processor(processor: ProcessorMixin, prompts: list, max_prompt_length: int | None,
                            chat_template_kwargs: dict | None = None, pad_to_multiple_of: int | None = None
                            ) -> PromptBatch:
    """Left-padded prompt ids and mask `[B, S]` through the processor (decision 2), with its other outputs as
    `PromptBatch.images` (None when it returned nothing else)."""
    tokenizer = processor.tokenizer
    padding = {"padding": True, "padding_side": "left", "return_tensors": "pt"}
    if is_conversational(prompts[0]):
        prompts = [with_images(prompt) for prompt in prompts]  # typed blocks; images already placed
        encoded = processor.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                processor_kwargs=padding, **(chat_template_kwargs or {}))
    else:
        encoded = processor(text=prompts, **padding)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    images = split_fields(encoded, [count_images(prompt) for prompt in prompts])
    if max_prompt_length is not None and ids.shape[1] > max_prompt_length:
        keep = truncate_keeping(mask, protected_columns(ids, images, processor), max_prompt_length)
        ids, mask, images = _compact(ids, mask, images, keep, tokenizer.pad_token_id)
    extra = -ids.shape[1] % pad_to_multiple_of if pad_to_multiple_of else 0
    if extra:
        ids = nn.functional.pad(ids, (extra, 0), value=tokenizer.pad_token_id)
        mask = nn.functional.pad(mask, (extra, 0), value=0)
        images = images.pad_columns((extra, 0))
    has_inputs = images.token_fields or images.image_fields
    return PromptBatch(ids, mask, images if has_inputs else None, [prompt_images(prompt) for prompt in prompts])


def protected_columns(ids: Tensor, images: ImageInputs, processor: ProcessorMixin) -> Tensor:
    """`[B, S]` True at the tokens of image spans (decision 3): image tokens (a token field marks them, or they
    are the processor's or tokenizer's image token), and the runs of special tokens that contain them
    (begin/end-of-image, tile markers)."""
    tokenizer = processor.tokenizer
    image = torch.zeros_like(ids, dtype=torch.bool)
    for value in images.token_fields.values():
        image |= value != 0
    for owner in (processor, tokenizer):
        image_token = getattr(owner, "image_token_id", None)
        if isinstance(image_token, int):
            image |= ids == image_token
    special_ids = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special = image | torch.isin(ids, torch.tensor(sorted(special_ids), device=ids.device))
    # Label the runs of consecutive special tokens; a run is protected when it holds an image token.
    starts = torch.ones_like(special)
    starts[:, 1:] = special[:, 1:] != special[:, :-1]
    run = starts.long().cumsum(1) - 1  # [B, S] run index within the row
    holds_image = torch.zeros(ids.shape, dtype=torch.long, device=ids.device).scatter_add_(1, run, image.long())
    return special & (holds_image.gather(1, run) > 0)


def truncate_keeping(mask: Tensor, protected: Tensor, max_length: int) -> Tensor:
    """`[B, S]` the columns each row keeps: all its `protected` columns and its last real tokens up to
    `max_length` in all (more only when the protected ones alone exceed it)."""
    real = mask.bool()
    text = real & ~protected
    room = (max_length - (real & protected).sum(1, keepdim=True)).clamp(min=0)  # [B, 1]
    text_from_end = text.flip(1).long().cumsum(1).flip(1)  # [B, S] text tokens at or after each column
    keep = (real & protected) | (text & (text_from_end <= room))
    too_long = (real & protected).sum(1) > max_length
    if bool(too_long.any()):
        logger.warning("max_prompt_length=%d is shorter than the image tokens of %d prompt(s); their image tokens "
                       "are kept whole, so those prompts are longer.", max_length, int(too_long.sum()))
    return keep


def _compact(ids: Tensor, mask: Tensor, images: ImageInputs, keep: Tensor, pad_id: int
             ) -> tuple[Tensor, Tensor, ImageInputs]:
    """The kept columns of each row, left-padded to the longest row."""
    width = int(keep.sum(1).max())
    # Stable sort: dropped columns first, kept ones last and in order; then the last `width` columns.
    order = torch.sort(keep.int(), dim=1, stable=True).indices[:, -width:]  # [B, width]
    kept = keep.gather(1, order)

    def take(value: Tensor, fill: int) -> Tensor:
        return value.gather(1, order).masked_fill(~kept, fill)

    fields = {k: take(v, 0) for k, v in images.token_fields.items()}
    return take(ids, pad_id), take(mask, 0), ImageInputs(fields, images.image_fields, images.units)


def _positions_from_images(model: nn.Module) -> bool:
    lm = causal_lm(model)
    return any(hasattr(m, "get_rope_index") for m in (lm, getattr(lm, "model", None)) if m is not None)


def forward_inputs(model: nn.Module, images: ImageInputs | None, completion_width: int) -> dict[str, Any] | None:
    """The extra keyword arguments of a log-prob forward over prompt + `completion_width` columns: the image
    inputs, and `position_ids=None` for models that compute positions from them (decision 4)."""
    if images is None:
        return None
    inputs = images.model_inputs(completion_width)
    if images.has_images and _positions_from_images(model):
        inputs["position_ids"] = None
    return inputs


def image_placeholder(processor: ProcessorMixin) -> str:
    """The text the processor's chat template writes for one image part (decision 6): what a conversation with an
    image part renders to, less what the same conversation without it does."""
    def rendered(parts: list[dict]) -> str:
        text = processor.apply_chat_template([[{"role": "user", "content": parts}]], tokenize=False,
                                             add_generation_prompt=True)
        return text[0] if isinstance(text, list) else text

    with_image, without = rendered([{"type": "image"}, {"type": "text", "text": "x"}]), rendered(
        [{"type": "text", "text": "x"}])
    start = next((i for i, (a, b) in enumerate(zip(with_image, without)) if a != b), len(without))
    end = next((i for i, (a, b) in enumerate(zip(reversed(with_image), reversed(without))) if a != b), 0)
    return with_image[start:len(with_image) - min(end, len(without) - start)]


def _expansion(processor: ProcessorMixin, placeholder: str, image: Any) -> list[int]:
    """The tokens the processor puts in place of `placeholder` for `image`, without the special tokens its tokenizer
    adds around any text."""
    tokenizer = processor.tokenizer
    plain = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
    wrapped = tokenizer(placeholder)["input_ids"]
    at = next((i for i in range(len(wrapped) - len(plain) + 1) if wrapped[i:i + len(plain)] == plain), 0)
    before, after = wrapped[:at], wrapped[at + len(plain):]
    ids = list(processor(text=[placeholder], images=[[image]])["input_ids"][0])
    if before and ids[:len(before)] == before:
        ids = ids[len(before):]
    if after and ids[len(ids) - len(after):] == after:
        ids = ids[:len(ids) - len(after)]
    return ids


def unexpanded_ids(processor: ProcessorMixin, placeholder: str, ids: list[int], images: list) -> list[int]:
    """One prompt's processor-expanded `ids` (no padding) with each image's tokens put back to the chat template's
    `placeholder` (decision 6); ValueError when an image's tokens are not found in order."""
    placeholder_ids = processor.tokenizer(placeholder, add_special_tokens=False)["input_ids"]
    out, position = [], 0
    for number, image in enumerate(images):
        expansion = _expansion(processor, placeholder, image)
        at = next((i for i in range(position, len(ids) - len(expansion) + 1) if ids[i:i + len(expansion)] == expansion),
                  None)
        if at is None:
            raise ValueError(f"the processor's {len(expansion)} tokens for image {number} are not in the prompt as it "
                             "tokenised it")
        out += ids[position:at] + placeholder_ids
        position = at + len(expansion)
    return out + ids[position:]


def image_token_ids(model: nn.Module) -> list[int]:
    """The model's image and video placeholder token ids (decision 5)."""
    config = causal_lm(model).config
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    return sorted({i for i in ids if isinstance(i, int)})
