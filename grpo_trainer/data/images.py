"""Images in dataset rows and conversational prompts, with TRL 1.16's contract for vision-language models.

Decisions:

1. A row's images come from an `images` column (a list per row) or else an `image` column (one image, or None for
   none); a round none of whose rows has an image is text-only (`row_images` returns None), since processors
   refuse a batch with an empty image list.
2. Images go into conversational prompts as content parts (`with_images`): string contents become typed blocks
   (`{"type": "text", "text": ...}`), and the first user message gets one `{"type": "image"}` part per image in
   front of its text unless the prompt already places image parts itself; those placeholders are then filled in
   order. A count that does not match is an error. Plain-text prompts with images are refused: the processor's chat
   template is what places the image tokens.
3. What is logged or saved drops the image objects and keeps the parts (`strip_images`), as TRL's table does.
"""

from __future__ import annotations

from typing import Any

from grpo_trainer.data.checks import is_conversational

__all__ = ["attach_images", "count_images", "prompt_images", "row_images", "row_prompts", "strip_images", "with_images"]

_ROLES = ("system", "user", "assistant", "tool")


def row_images(rows: list[dict]) -> list[list | None] | None:
    """Each row's images (None for a row without any), or None when no row has one (decision 1)."""
    if "images" in rows[0]:
        images = [row.get("images") for row in rows]
    elif "image" in rows[0]:
        images = [[row["image"]] if row.get("image") is not None else None for row in rows]
    else:
        return None
    return images if any(images) else None


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def with_images(prompt: list[dict], images: list | None = None) -> list[dict]:
    """`prompt` (a list of messages) with every content as typed blocks and `images` in its image parts
    (decision 2). The messages are copied, never changed in place."""
    images = list(images or [])
    messages, placed = [], False
    for message in prompt:
        role, content = message["role"], message.get("content")
        if role not in _ROLES:
            raise ValueError(f"Invalid role in message: {role}. Expected 'system', 'user', 'assistant', or 'tool'.")
        if isinstance(content, str):
            blocks = [_text_block(content)]
            if role == "user" and not placed:
                blocks = [{"type": "image"} for _ in images] + blocks
                placed = True
            message = {**message, "content": blocks}
        messages.append(message)
    open_parts = [(i, j) for i, m in enumerate(messages) if m["role"] != "tool" and isinstance(m.get("content"), list)
                  for j, part in enumerate(m["content"]) if part.get("type") == "image" and part.get("image") is None]
    if len(open_parts) != len(images):
        raise ValueError(f"Number of images provided ({len(images)}) does not match number of image placeholders "
                         f"({len(open_parts)}).")
    for (i, j), image in zip(open_parts, images):
        content = list(messages[i]["content"])
        content[j] = {**content[j], "image": image}
        messages[i] = {**messages[i], "content": content}
    return messages


def attach_images(prompts: list, images: list[list | None]) -> list:
    """Each prompt with its row's images in its content parts (decision 2); plain-text prompts are refused."""
    if not is_conversational(prompts[0]):
        raise ValueError("Multimodal training requires conversational prompts. It looks like the dataset contains "
                         "non-conversational inputs, likely because a chat template was applied before passing the "
                         "dataset to the trainer. Please provide the raw conversational prompts and let the trainer "
                         "apply the chat template internally.")
    return [with_images(prompt, row) for prompt, row in zip(prompts, images)]


def row_prompts(rows: list[dict]) -> list:
    """The rows' prompts as the rollout tokenises them: each with its row's images in its image parts (decisions 1
    and 2), or as they are for a text-only round. Every reader of prompts that a processor tokenises goes through
    here: a prompt in TRL's VLM format (`{"type": "image"}` placeholders) cannot be tokenised without its images."""
    prompts = [row["prompt"] for row in rows]
    images = row_images(rows)  # [B] lists of images, or None for a text-only round
    return prompts if images is None else attach_images(prompts, images)


def prompt_images(prompt: Any) -> list:
    """The images of a conversational prompt's image parts, in order (none for plain text)."""
    if not isinstance(prompt, list):
        return []
    return [part["image"] for message in prompt if isinstance(message.get("content"), list)
            for part in message["content"] if part.get("type") == "image" and part.get("image") is not None]


def count_images(prompt: Any) -> int:
    """Image parts holding an image in a conversational prompt (0 for plain text)."""
    return len(prompt_images(prompt))


def strip_images(value: Any) -> Any:
    """A conversation with each image part reduced to `{"type": "image"}` (anything else as it is)."""
    if not isinstance(value, list):
        return value
    stripped = []
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            message = {**message, "content": content}
        stripped.append(message)
    return stripped
