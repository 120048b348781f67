"""Tiny vision-language models and their processors, built offline: the VLM tests and the VLM example use them.

Nothing here downloads anything. Each family gets a randomly initialised model from a config a few thousand times
smaller than the real one, and a processor assembled locally the way the real one is: the family's own processor
class, its PIL image processor (the torchvision-based fast ones are not needed), and a character-level tokenizer
(`toy.make_tokenizer`'s alphabet) holding the family's image tokens, with a chat template that writes each image
part as the family's image placeholder. The processor expands that placeholder into as many image tokens as the
vision tower produces features, exactly as the real processor does.

Processor classes that also take a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3.5, Gemma 4) cannot be built
without torchvision in transformers 5.x (their video processors need it), so an image-only subclass of the real
class stands in for them: the same `__call__`, image processing and token expansion, no video processor (nor
Gemma 4's audio feature extractor).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForImageTextToText, PreTrainedModel, PreTrainedTokenizerFast, ProcessorMixin

from grpo_trainer.cli.toy import SPECIAL_TOKENS

__all__ = ["VLM_FAMILIES", "chat_template", "make_tiny_vlm"]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_template(image_placeholder: str) -> str:
    """The toy chat template, writing each image content part as `image_placeholder`."""
    return _CHAT_TEMPLATE.replace("IMAGE", image_placeholder)


def _tokenizer(image_tokens: list[str], named: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """`toy.make_tokenizer`'s character-level tokenizer plus the family's image tokens (special, never split);
    `named` makes some of them attributes (`tokenizer.boi_token`, `tokenizer.boi_token_id`, ...)."""
    specials = SPECIAL_TOKENS + image_tokens
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "|".join(_escape(t) for t in sorted(specials, key=len, reverse=True))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pattern}|."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    extra = dict(named or {})
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left",
        clean_up_tokenization_spaces=False, extra_special_tokens=extra or None)


def _escape(token: str) -> str:
    """`token` as a literal in the pre-tokenizer's regular expression."""
    return "".join("\\" + c if c in r"\|.^$*+?()[]{}" else c for c in token)


def _image_only(processor_class: type) -> type:
    """`processor_class` without its video processor (see the module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(processor_class.__name__, (processor_class,), {"__init__": __init__})


def _without_video(processor_class: type) -> type:
    """`processor_class` accepting None for its video processor and audio feature extractor (Gemma 4 passes them to
    `ProcessorMixin` by keyword, so `_image_only` cannot drop them)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return None if argument is None else processor_class.check_argument_for_proper_class(self, argument_name,
                                                                                            argument)

    return type(processor_class.__name__, (processor_class,),
                {"check_argument_for_proper_class": check_argument_for_proper_class})


def _ids(tokenizer: PreTrainedTokenizerFast, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _text(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict:
    """A two-layer, 32-wide decoder config over the toy vocabulary."""
    return {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 1024,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
            **overrides}


def _qwen_processor(processor_class: type, patch: int) -> tuple[Any, ProcessorMixin, list[int]]:
    """The Qwen-VL families' tokenizer and image-only processor, and the ids of their vision start, end, image and
    video tokens. `patch`-pixel patches merged 2 x 2: a (2 x patch)-pixel square image is one image token; images
    up to 4 x patch pixels a side."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = _tokenizer(tokens)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2, max_pixels=(4 * patch) ** 2,
                                               patch_size=patch, merge_size=2, temporal_patch_size=2)
    processor = _image_only(processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    return tokenizer, processor, _ids(tokenizer, *tokens)


def _qwen2_vl(version: str) -> tuple[Any, ProcessorMixin]:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLProcessor

    tokenizer, processor, (start, end, image, video) = _qwen_processor(Qwen2VLProcessor, patch=14)
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    if version == "2.5":
        vision = {**vision, "out_hidden_size": 32, "intermediate_size": 64, "fullatt_block_indexes": [0],
                  "window_size": 56}
        config_class = Qwen2_5_VLConfig
    else:
        config_class = Qwen2VLConfig
    config = config_class(text_config=_text(tokenizer, rope_parameters=rope), vision_config=vision,
                          image_token_id=image, video_token_id=video, vision_start_token_id=start,
                          vision_end_token_id=end, tie_word_embeddings=True)
    return config, processor


def _qwen3_5(moe: bool) -> tuple[Any, ProcessorMixin]:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLProcessor

    tokenizer, processor, (start, end, image, video) = _qwen_processor(Qwen3VLProcessor, patch=16)
    # One gated-delta-net (linear attention) layer and one full-attention layer, as the real model alternates them.
    text = _text(tokenizer, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=2,
                 linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                 rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0, "mrope_interleaved": True})
    if moe:
        text = {**text, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32, "num_position_embeddings": 16}
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True)
    return config, processor


def _llava() -> tuple[Any, ProcessorMixin]:
    from transformers import LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    (image,) = _ids(tokenizer, "<image>")
    # A 28 x 28 image of 14-pixel patches: 4 image tokens (the class token is dropped, "default" strategy).
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               num_additional_image_tokens=1, vision_feature_select_strategy="default",
                               chat_template=chat_template("<image>"))
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "projection_dim": 32}
    config = LlavaConfig(text_config={"model_type": "llama", **_text(tokenizer)}, vision_config=vision,
                         image_token_index=image, vision_feature_select_strategy="default", vision_feature_layer=-1,
                         tie_word_embeddings=True)
    return config, processor


def _gemma3() -> tuple[Any, ProcessorMixin]:
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokens = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tokenizer = _tokenizer(tokens, {"boi_token": tokens[0], "eoi_token": tokens[1], "image_token": tokens[2]})
    boi, eoi, image = _ids(tokenizer, *tokens)
    # A 28 x 28 image of 14-pixel patches: 4 patches, kept as 4 image tokens (the projector's pooling is 1 x 1).
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=chat_template("<start_of_image>"))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14, "vision_use_head": False}  # Gemma 3 uses no pooling head
    config = Gemma3Config(text_config=_text(tokenizer, sliding_window=64, query_pre_attn_scalar=8),
                          vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi,
                          image_token_index=image, tie_word_embeddings=True)
    return config, processor


def _gemma4() -> tuple[Any, ProcessorMixin]:
    from transformers import Gemma4Config, Gemma4Processor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokens = ["<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>"]
    names = ["boi_token", "eoi_token", "image_token", "boa_token", "eoa_token", "audio_token"]
    tokenizer = _tokenizer(tokens, dict(zip(names, tokens)))
    boi, eoi, image, boa = _ids(tokenizer, *tokens[:4])
    # 70 image tokens per image (the smallest budget Gemma 4 allows): up to 630 16-pixel patches, pooled 3 x 3.
    image_processor = Gemma4ImageProcessorPil(max_soft_tokens=70, patch_size=16, pooling_kernel_size=3)
    processor = _without_video(Gemma4Processor)(None, image_processor, tokenizer, None, image_seq_length=70,
                                                chat_template=chat_template("<|image|>"))
    text = _text(tokenizer, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                 num_kv_shared_layers=0, global_head_dim=8, hidden_size_per_layer_input=16,
                 vocab_size_per_layer_input=len(tokenizer))
    vision = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 630, "default_output_length": 70,
              "patch_size": 16, "pooling_kernel_size": 3}
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=boi,
                          eoi_token_id=eoi, image_token_id=image, video_token_id=processor.video_token_id,
                          boa_token_id=boa, tie_word_embeddings=True)
    return config, processor


def _llava_next() -> tuple[Any, ProcessorMixin]:
    from transformers import LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    (image,) = _ids(tokenizer, "<image>")
    # 28 x 28 crops of 14-pixel patches (4 features each); "any resolution" tiles up to 56 x 56.
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                 image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]])
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                   num_additional_image_tokens=1,  # CLIP's class token
                                   vision_feature_select_strategy="default", chat_template=chat_template("<image>"))
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "projection_dim": 32}
    config = LlavaNextConfig(text_config={"model_type": "llama", **_text(tokenizer)}, vision_config=vision,
                             image_token_index=image, image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
                             vision_feature_select_strategy="default", vision_feature_layer=-1,
                             tie_word_embeddings=True)
    return config, processor


def _idefics3() -> tuple[Any, ProcessorMixin]:
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokens = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    tokenizer = _tokenizer(tokens, {"fake_image_token": tokens[0], "image_token": tokens[1],
                                    "global_image_token": tokens[2], "end_of_utterance_token": tokens[3]})
    (image,) = _ids(tokenizer, "<image>")
    # One 28 x 28 image (no tiling) of 14-pixel patches, merged 2 x 2 by the pixel shuffle: one image token.
    size = {"size": {"longest_edge": 28}, "max_image_size": {"longest_edge": 28}, "do_image_splitting": False}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**size), tokenizer=tokenizer,
                                  image_seq_len=1, chat_template=chat_template("<image>"))
    config = Idefics3Config(text_config={"model_type": "llama", **_text(tokenizer)}, vision_config=vision,
                          image_token_id=image, scale_factor=2, tie_word_embeddings=True)
    return config, processor


VLM_FAMILIES: dict[str, Callable[[], tuple[Any, ProcessorMixin]]] = {
    "qwen2_vl": lambda: _qwen2_vl("2"),
    "qwen2_5_vl": lambda: _qwen2_vl("2.5"),
    "qwen3_5": lambda: _qwen3_5(moe=False),
    "qwen3_5_moe": lambda: _qwen3_5(moe=True),
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "llava": _llava,
    "llava_next": _llava_next,
    "idefics3": _idefics3,
}


def make_tiny_vlm(family: str, seed: int = 0) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A randomly initialised tiny VLM of `family` (a key of `VLM_FAMILIES`) in float32, and its processor."""
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; choose one of {sorted(VLM_FAMILIES)}.")
    config, processor = VLM_FAMILIES[family]()
    tokenizer = processor.tokenizer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        for name, param in model.named_parameters():
            # transformers initialises Gemma 3's image projection to zeros (a checkpoint's is trained): the vision
            # tower would get no gradient from a first step, unlike with any real model.
            if name.endswith("mm_input_projection_weight"):
                torch.nn.init.normal_(param, std=config.text_config.initializer_range)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = None
    return model, processor
