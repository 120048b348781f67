"""Image inputs from the processor to the forward: row selection over every layout, image-safe truncation and
padding, the loss forward's log-probs equal to generate's scores with the images in, and the rollout backends'
image capability."""

import logging

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig

from grpo_trainer.data.images import with_images
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rollout.backend import BACKENDS, serving
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.generate import GenerateBackend
from grpo_trainer.rollout.multimodal import (
    forward_inputs,
    image_placeholder,
    image_token_ids,
    protected_columns,
    truncate_keeping,
    unexpanded_ids,
)
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import SamplingSettings, make_generation_config
from grpo_trainer.rollout.types import ImageInputs
from tests.helpers import vlm_families
from tests.toy_vlm import VLM_FAMILIES, make_tiny_vlm

FAMILIES = vlm_families(sorted(VLM_FAMILIES))


def _image(colour: str, width: int = 40, height: int = 30) -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def _prompts() -> list:
    """Three rows: one image, two images around the text, none."""
    return [with_images([{"role": "user", "content": "colour?"}], [_image("red")]),
            with_images([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"},
                                                      {"type": "text", "text": "and"}, {"type": "image"}]}],
                        [_image("blue", 50, 60), _image("green", 20, 20)]),
            with_images([{"role": "user", "content": "no image here"}])]


def test_select_rows_gathers_each_rows_entries_in_every_layout():
    # Three rows owning 3, 0 and 5 patches; 1, 0 and 2 images; one entry each in a per-row field.
    inputs = ImageInputs(
        token_fields={"token_type_ids": torch.tensor([[0, 1], [0, 0], [1, 1]])},
        image_fields={"pixel_values": torch.arange(8), "image_grid_thw": torch.tensor([[10], [20], [30]]),
                      "pixel_attention_mask": torch.tensor([100, 200, 300])},
        units={"pixel_values": torch.tensor([3, 0, 5]), "image_grid_thw": torch.tensor([1, 0, 2]),
               "pixel_attention_mask": torch.tensor([1, 1, 1])})
    picked = inputs.select_rows(torch.tensor([2, 0]))
    # row 2 owns patches 3..7 and images 1..2; row 0 patches 0..2 and image 0
    assert picked.image_fields["pixel_values"].tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert picked.image_fields["image_grid_thw"].tolist() == [[20], [30], [10]]
    assert picked.image_fields["pixel_attention_mask"].tolist() == [300, 100]
    assert picked.token_fields["token_type_ids"].tolist() == [[1, 1], [0, 1]]
    assert picked.units["pixel_values"].tolist() == [5, 3]
    sliced = inputs.select_rows(slice(1, 3))  # row 1 owns nothing
    assert sliced.image_fields["pixel_values"].tolist() == [3, 4, 5, 6, 7]
    assert sliced.image_fields["image_grid_thw"].tolist() == [[20], [30]]
    assert sliced.select_rows(torch.tensor([0])).image_fields["pixel_values"].numel() == 0


def test_truncation_keeps_image_spans_whole_and_the_last_text_tokens():
    # row 0: [pad, t, t, S, I, I, E, t, t] with S/I/E an image span; row 1: eight text tokens
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    protected = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0], [0] * 9]).bool()
    keep = truncate_keeping(mask, protected, max_length=5)
    # row 0: 4 image columns leave room for 1 text token, the last one; row 1: the last 5 tokens
    assert keep.int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 0, 1], [0, 0, 0, 0, 1, 1, 1, 1, 1]]
    # images longer than the limit are kept whole, with no text
    assert truncate_keeping(mask[:1], protected[:1], 2).int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 0, 0]]


def test_protected_columns_are_the_image_tokens_and_their_markers():
    _, processor = make_tiny_vlm("qwen2_vl")
    prompt = with_images([{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                                       {"type": "text", "text": "now"}]}], [_image("red")])
    batch = tokenize_prompts(processor, [prompt], None)
    tokens = processor.tokenizer.convert_ids_to_tokens(batch.ids[0])
    protected = protected_columns(batch.ids, batch.images, processor)[0]
    assert [t for t, p in zip(tokens, protected) if p] == ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rows_image_inputs_are_those_of_its_prompt_alone(family):
    _, processor = make_tiny_vlm(family)
    prompts = _prompts()
    batch = tokenize_prompts(processor, prompts, None)
    assert batch.images is not None and batch.images.has_images
    for row, prompt in enumerate(prompts):
        alone = tokenize_prompts(processor, [prompt], None)
        picked = batch.images.select_rows(torch.tensor([row]))
        width = alone.ids.shape[1]
        assert torch.equal(batch.ids[row, -width:], alone.ids[0])
        for name, value in picked.token_fields.items():
            assert torch.equal(value[:, -width:], alone.images.token_fields[name]), name
        for name, value in picked.image_fields.items():
            expected = alone.images.image_fields.get(name) if alone.images is not None else None
            if expected is None:
                assert value.numel() == 0 or not value.any(), name  # a row without images owns nothing (or padding)
                continue
            # Per-row and per-image layouts pad to the batch's most images / tiles: the row's own part, then zeros.
            own = value[tuple(slice(0, d) for d in expected.shape)]
            assert torch.equal(own, expected), name
            assert value.sum() == own.sum(), name


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "llava_next", "idefics3"])
def test_max_prompt_length_never_cuts_image_tokens(family):
    model, processor = make_tiny_vlm(family)
    prompt = with_images([{"role": "user", "content": "a long question about the colour of this square " * 2}],
                         [_image("red")])
    full = tokenize_prompts(processor, [prompt], None)
    cut = tokenize_prompts(processor, [prompt], max_prompt_length=int(full.mask.sum()) - 20)
    image_ids = image_token_ids(model)
    assert cut.ids.shape[1] == full.ids.shape[1] - 20
    assert int(torch.isin(cut.ids, torch.tensor(image_ids)).sum()) == int(torch.isin(full.ids,
                                                                                    torch.tensor(image_ids)).sum())
    assert torch.equal(cut.ids[0, -10:], full.ids[0, -10:])  # the text nearest the completion stays
    for name, value in cut.images.token_fields.items():  # token types still mark the image tokens
        assert torch.equal(value[0] != 0, torch.isin(cut.ids[0], torch.tensor(image_ids))), name
    with torch.no_grad():  # the image features still find as many image tokens
        model(input_ids=cut.ids, attention_mask=cut.mask, **forward_inputs(model, cut.images, 0))


def test_pad_to_multiple_of_pads_the_token_types_with_the_ids():
    _, processor = make_tiny_vlm("gemma3")
    batch = tokenize_prompts(processor, _prompts(), None)
    padded = tokenize_prompts(processor, _prompts(), None, pad_to_multiple_of=7)
    extra = padded.ids.shape[1] - batch.ids.shape[1]
    assert padded.ids.shape[1] % 7 == 0 and extra > 0
    types = padded.images.token_fields["token_type_ids"]
    assert types.shape == padded.ids.shape and not types[:, :extra].any()
    assert torch.equal(types[:, extra:], batch.images.token_fields["token_type_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_logprobs_are_generates_scores_with_the_images(family):
    """The loss forward scores exactly the distributions `generate` sampled from: the image inputs reach it (the
    same log-probs without them differ), and positions match generate's (M-RoPE included)."""
    model, processor = make_tiny_vlm(family)
    model.eval()
    batch = tokenize_prompts(processor, _prompts(), None)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=[processor.tokenizer.eos_token_id],
                              pad_token_id=processor.tokenizer.pad_token_id, disable_compile=True)
    with torch.no_grad():
        out = model.generate(input_ids=batch.ids, attention_mask=batch.mask, generation_config=config,
                             return_dict_in_generate=True, output_logits=True, **batch.images.model_inputs())
        completion = out.sequences[:, batch.ids.shape[1]:]  # [B, T]
        T = completion.shape[1]
        expected = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)  # [B, T, V]
        expected = expected.gather(-1, completion[..., None]).squeeze(-1)
        ids, mask = torch.cat([batch.ids, completion], 1), torch.cat([batch.mask, torch.ones_like(completion)], 1)
        logps = completion_logprobs(model, ids, mask, T, model_inputs=forward_inputs(model, batch.images, T)).logps
        blind = completion_logprobs(model, ids, mask, T).logps
    torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(blind[:2], expected[:2], atol=1e-3)  # rows 0 and 1 have images


def test_image_tokens_are_never_sampled():
    """Image placeholders are suppressed in sampling: a completion never holds one, so the loss never scores an
    image token (prompt columns are never scored either)."""
    model, processor = make_tiny_vlm("qwen2_vl")
    image_id = model.config.image_token_id
    model.lm_head.register_forward_hook(lambda m, i, logits: logits.index_add(
        -1, torch.tensor([image_id]), torch.full((*logits.shape[:-1], 1), 50.0)))  # the model wants image tokens
    batch = tokenize_prompts(processor, _prompts(), None)
    backend = GenerateBackend()
    for suppress, expect_image in ((None, True), (image_token_ids(model), False)):
        config = make_generation_config(SamplingSettings(), model.generation_config, processor.tokenizer, 4,
                                        suppress_tokens=suppress)
        rollout = backend.generate(model, batch, config)
        assert bool((rollout.completion_ids == image_id).any()) == expect_image


def test_backends_declare_images_and_others_hand_image_rounds_to_generate():
    assert GenerateBackend.capabilities.images and not FastBackend.capabilities.images
    assert not BACKENDS["transformers_continuous_batching"].capabilities.images
    _, processor = make_tiny_vlm("gemma3")
    with_pictures = tokenize_prompts(processor, _prompts(), None)
    text_only = tokenize_prompts(processor, [with_images([{"role": "user", "content": "hi"}])], None)
    fast = FastBackend()
    assert isinstance(serving(fast, with_pictures), GenerateBackend)
    assert serving(fast, text_only) is fast  # token types alone are no images
    generate = GenerateBackend()
    assert serving(generate, with_pictures) is generate
    # vLLM takes images (as TRL 1.16 does); whether it takes a given family's is its `image_support`'s call
    # (tests/vllm_integration/test_vllm_images.py)
    assert BACKENDS["vllm"].capabilities.images


def test_a_backend_that_takes_images_but_not_these_hands_them_to_generate_with_its_reason(caplog):
    class Picky(GenerateBackend):
        name = "picky"

        def image_support(self, prompts):
            return "picky cannot take gemma3's image prompts"

    _, processor = make_tiny_vlm("gemma3")
    with caplog.at_level(logging.INFO, logger="grpo_trainer.rollout.backend"):
        assert isinstance(serving(Picky(), tokenize_prompts(processor, _prompts(), None)), GenerateBackend)
    said = [(r.levelname, r.message) for r in caplog.records if r.name == "grpo_trainer.rollout.backend"]
    assert said == [("WARNING", "picky cannot take gemma3's image prompts")]


def test_processor_setup_lets_ddp_find_the_vision_towers_unused_parameters(tmp_path):
    from grpo_trainer import GRPOConfig
    from grpo_trainer.cli.toy import make_tokenizer
    from grpo_trainer.trainer.setup import check_processor_setup

    _, processor = make_tiny_vlm("llava")
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    check_processor_setup(args, processor)
    assert args.ddp_find_unused_parameters is True  # a round without images leaves the vision tower unused
    reentrant = GRPOConfig(output_dir=str(tmp_path), report_to="none",
                           gradient_checkpointing_kwargs={"use_reentrant": True})
    check_processor_setup(reentrant, processor)
    assert reentrant.ddp_find_unused_parameters is None  # reentrant checkpointing cannot look for them
    text = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    check_processor_setup(text, make_tokenizer())
    assert text.ddp_find_unused_parameters is None


@pytest.mark.parametrize("family", FAMILIES)
def test_unexpanded_ids_are_the_chat_templates_text_with_one_placeholder_per_image(family):
    """What vLLM is given for an image prompt: the processor's expansion of each image undone, which is the chat
    template's text tokenised as it is (each image part one placeholder), whatever the family's expansion."""
    _, processor = make_tiny_vlm(family)
    pictures = [Image.new("RGB", (28, 40), "red"), Image.new("RGB", (56, 30), "blue")]
    prompt = [{"role": "user", "content": [{"type": "image", "image": pictures[0]}, {"type": "text", "text": "ab"},
                                           {"type": "image", "image": pictures[1]}]}]
    batch = tokenize_prompts(processor, [prompt], None)
    ids = batch.ids[0][batch.mask[0].bool()].tolist()
    placeholder = image_placeholder(processor)
    text = processor.apply_chat_template([prompt], tokenize=False, add_generation_prompt=True)[0]
    assert text.count(placeholder) == 2 and batch.image_lists == [pictures]
    unexpanded = unexpanded_ids(processor, placeholder, ids, pictures)
    assert unexpanded == processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(unexpanded) < len(ids)  # the processor did expand them
    with pytest.raises(ValueError, match="tokens for image 2 are not in the prompt"):  # one image more than parts
        unexpanded_ids(processor, placeholder, ids, [*pictures, pictures[0]])
