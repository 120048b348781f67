"""Images in dataset rows and prompts: TRL 1.16's `image` / `images` columns and `prepare_multimodal_messages`."""

import pytest
from datasets import Dataset

from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.data.checks import check_dataset
from grpo_trainer.data.images import attach_images, count_images, row_images, strip_images, with_images

RED, BLUE = object(), object()  # stand-ins: images are passed through, never inspected here


def test_row_images_reads_images_then_image_and_drops_image_free_rounds():
    assert row_images([{"images": [RED, BLUE]}, {"images": []}]) == [[RED, BLUE], []]
    assert row_images([{"image": RED}, {"image": None}]) == [[RED], None]
    assert row_images([{"images": [], "image": RED}]) is None  # `images` wins; no image at all: a text round
    assert row_images([{"image": None}, {"image": None}]) is None
    assert row_images([{"prompt": "p"}]) is None


def test_with_images_puts_them_before_the_first_user_text_as_trl():
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "colour?"},
              {"role": "assistant", "content": "red"}, {"role": "user", "content": "and now?"}]
    out = with_images(prompt, [RED, BLUE])
    assert out == [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                   {"role": "user", "content": [{"type": "image", "image": RED}, {"type": "image", "image": BLUE},
                                                {"type": "text", "text": "colour?"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
                   {"role": "user", "content": [{"type": "text", "text": "and now?"}]}]
    assert prompt[1]["content"] == "colour?"  # the row itself is untouched
    assert count_images(out) == 2


def test_with_images_fills_the_placeholders_a_prompt_places_itself_in_order():
    # zen-multi-image's layout: typed parts, placeholders anywhere; a dataset's Arrow struct adds "image": None
    prompt = [{"role": "user", "content": [{"type": "text", "text": "Is", "image": None},
                                           {"type": "image", "text": None, "image": None},
                                           {"type": "text", "text": "like", "image": None}, {"type": "image"}]}]
    out = with_images(prompt, [RED, BLUE])
    assert [part.get("image") for part in out[0]["content"]] == [None, RED, None, BLUE]
    with pytest.raises(ValueError, match=r"Number of images provided \(1\) does not match number of image "
                                         r"placeholders \(2\)"):
        with_images(prompt, [RED])


def test_with_images_refuses_unknown_roles_and_plain_text_prompts():
    with pytest.raises(ValueError, match="Invalid role in message: robot"):
        with_images([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="Multimodal training requires conversational prompts"):
        attach_images(["What colour?"], [[RED]])
    assert attach_images([[{"role": "user", "content": "a"}]], [None]) == [
        [{"role": "user", "content": [{"type": "text", "text": "a"}]}]]


def test_strip_images_keeps_the_parts_without_the_objects():
    prompt = with_images([{"role": "user", "content": "colour?"}], [RED])
    assert strip_images(prompt) == [{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "colour?"}]}]
    assert strip_images("plain text") == "plain text"


def test_an_image_column_needs_a_processor():
    from PIL import Image

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "colour?"}]],
                                 "image": [Image.new("RGB", (8, 8), "red")]})
    with pytest.raises(ValueError, match="has an 'image' column.*AutoProcessor.from_pretrained"):
        check_dataset(dataset, "train_dataset", make_tokenizer())
