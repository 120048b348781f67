"""GRPO on vision-language models, one tiny model per family (built offline, `tests/toy_vlm.py`): training moves every
trainable parameter, vision tower included (so the images reach the loss forward), with TRL's options around
images: several images per prompt, the reference model, off-policy micro-batches, pad_to_multiple_of, LoRA,
rewards that read the images, and `log_multimodal`."""

import logging
import os

import pytest
from datasets import Dataset
from peft import LoraConfig
from PIL import Image

from grpo_trainer import GRPOTrainer
from grpo_trainer.rollout import backend
from tests.helpers import StopAt, make_args, make_trainer, train_and_compare, vlm_families
from tests.toy_vlm import VLM_FAMILIES, make_tiny_vlm

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
# LLaVA's vision features are the encoder's hidden states, never its post-layernorm (the pooler's): by design those
# weights get no gradient (TRL's test exempts them too, and requires them to stay as they were).
UNUSED_BY_DESIGN = {"llava": ("post_layernorm",), "llava_next": ("post_layernorm",)}


def image_dataset(rows: int = 6, images_per_row: list[int] | None = None) -> Dataset:
    """Conversational prompts with one image each (`image` column), or `images_per_row[i]` images each (`images`
    column, zen-multi-image's layout, rows without images included)."""
    def picture(i: int, j: int = 0) -> Image.Image:
        return Image.new("RGB", (28 + 6 * ((i + j) % 4), 40 - 4 * j), COLOURS[(i + j) % len(COLOURS)])

    prompts = [[{"role": "user", "content": f"Which colour is picture {i}?"}] for i in range(rows)]
    if images_per_row is None:
        return Dataset.from_dict({"prompt": prompts, "image": [picture(i) for i in range(rows)]})
    images = [[picture(i, j) for j in range(images_per_row[i % len(images_per_row)])] for i in range(rows)]
    return Dataset.from_dict({"prompt": prompts, "images": images})


def placeholder_dataset(column: str, rows: int = 4, images_per_row: int = 1) -> Dataset:
    """TRL's documented VLM format: the user's content already holds one `{"type": "image"}` placeholder per picture,
    the pictures themselves in an `image` (one per row) or `images` (a list per row) column."""
    def picture(i: int, j: int) -> Image.Image:
        return Image.new("RGB", (28 + 6 * ((i + j) % 4), 36), COLOURS[(i + j) % len(COLOURS)])

    prompts = [[{"role": "user", "content": [*({"type": "image"} for _ in range(images_per_row)),
                                             {"type": "text", "text": f"Which colour is picture {i}?"}]}]
               for i in range(rows)]
    pictures = [[picture(i, j) for j in range(images_per_row)] for i in range(rows)]
    return Dataset.from_dict({"prompt": prompts, column: [p[0] for p in pictures] if column == "image" else pictures})


def varied_reward(completions, **kwargs):
    """Differs between almost any two sampled texts, so every group has a non-zero advantage."""
    return [float(sum(map(ord, completion[0]["content"])) % 97) for completion in completions]


def vlm_trainer(family: str, output_dir, dataset: Dataset | None = None, reward=varied_reward,
                **settings) -> GRPOTrainer:
    """The tiny VLM of `family` with its processor, on `image_dataset()` unless given; one step unless asked."""
    model, processor = make_tiny_vlm(family)
    return make_trainer(output_dir, processor, dataset or image_dataset(), reward, model,
                        **{"max_steps": 1, **settings})


def train(family: str, tmp_path, dataset: Dataset | None = None, reward=varied_reward,
          **settings) -> tuple[GRPOTrainer, dict[str, bool]]:
    """A trained `vlm_trainer`, and which of its parameters changed."""
    trainer = vlm_trainer(family, tmp_path, dataset, reward, **settings)
    return trainer, train_and_compare(trainer)


@pytest.mark.parametrize("family", vlm_families(sorted(VLM_FAMILIES)))
def test_training_moves_every_parameter_vision_tower_included(family, tmp_path):
    trainer, moved = train(family, tmp_path)
    unused = [n for n in moved if any(part in n for part in UNUSED_BY_DESIGN.get(family, ()))]
    assert not any(moved[n] for n in unused), unused
    stuck = [n for n, m in moved.items() if not m and n not in unused]
    assert not stuck, stuck
    assert any(moved[n] for n in moved if "vision" in n or "visual" in n)  # the images reached the loss forward


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "llava_next"])
def test_several_images_per_prompt_and_prompts_without_any(family, tmp_path):
    dataset = image_dataset(rows=6, images_per_row=[1, 2, 0])
    trainer, moved = train(family, tmp_path, dataset, per_device_train_batch_size=6, num_generations=2)
    assert all(m for n, m in moved.items()
               if not any(part in n for part in UNUSED_BY_DESIGN.get(family, ())))


@pytest.mark.parametrize("family", vlm_families(["qwen2_vl", "qwen2_5_vl", "gemma3", "llava_next"]))
def test_trl_placeholder_format_passes_the_memory_check_and_trains(family, tmp_path):
    # The memory check (memory_check='error', the default) tokenises the first prompts before any weight loads; a
    # placeholder without its picture made the processor refuse the prompt ("Number of images provided (0) does not
    # match number of image placeholders (1)") and no TRL-format VLM dataset could be trained.
    trainer, moved = train(family, tmp_path, placeholder_dataset("image"), memory_check="error")
    assert trainer.args.memory_check == "error" and trainer.state.global_step == 1
    assert any(moved[n] for n in moved if "vision" in n or "visual" in n)  # the pictures reached the loss


def test_trl_placeholder_format_with_an_images_column(tmp_path):
    trainer, moved = train("qwen2_5_vl", tmp_path, placeholder_dataset("images", images_per_row=2),
                           memory_check="error")
    assert any(moved[n] for n in moved if "visual" in n)


@pytest.mark.parametrize("column", ["image", "images"])
def test_the_memory_check_sizes_placeholder_prompts_with_their_image_tokens(column, tmp_path):
    # The planned prompt length of TRL's placeholder format equals that of the same pictures and texts given as
    # plain-string prompts (whose image parts the trainer places itself, a path that never failed): the pictures'
    # expanded image tokens are counted, not refused and not left out.
    from grpo_trainer.trainer.memory import prompt_length

    _, processor = make_tiny_vlm("qwen2_vl")
    args = make_args(tmp_path)
    placeholders = placeholder_dataset(column, images_per_row=2 if column == "images" else 1)
    strings = placeholders.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"][0]["content"][-1]
                                                        ["text"]}]})
    text_only = Dataset.from_dict({"prompt": strings["prompt"]})
    planned = prompt_length(args, placeholders, processor)
    assert planned == prompt_length(args, strings, processor)
    assert prompt_length(args, placeholders.to_iterable_dataset(), processor) == planned  # a streamed dataset
    assert planned > prompt_length(args, text_only, processor)  # image tokens included


def test_reference_model_and_off_policy_micro_batches_carry_the_images(tmp_path):
    # beta > 0: reference forwards in chunks of 2 rows; steps_per_generation=2: the round is shuffled and split,
    # and the old log-probs are computed per micro-batch, each with its own rows' images.
    trainer, moved = train("qwen2_5_vl", tmp_path, beta=0.1, per_device_train_batch_size=2,
                           steps_per_generation=2, max_steps=2, logging_steps=1)
    assert all(moved.values())
    assert all("kl" in row for row in trainer.state.log_history if "reward" in row)


def test_pad_to_multiple_of_pads_the_token_types(tmp_path):
    trainer, moved = train("gemma3", tmp_path, pad_to_multiple_of=7)
    assert all(moved.values())


def test_lora_trains_the_language_model_only_with_the_adapter_free_reference(tmp_path):
    # Gemma 3's SigLIP tower has q_proj / v_proj too: the adapter must stay out of it.
    trainer, moved = train("gemma3", tmp_path, peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]),
                           beta=0.1)
    lora = [n for n in moved if "lora_" in n]
    assert lora and all(".language_model." in n for n in lora)
    assert all(moved[n] for n in lora if "lora_B" in n) and not any(moved[n] for n in moved if "lora_" not in n)
    assert trainer.ref_model is None and "kl" in trainer.state.log_history[0]


def test_rewards_see_the_images_and_the_log_keeps_them(tmp_path):
    seen = {}

    def reward(prompts, completions, image, **kwargs):
        seen["image"], seen["prompt"] = image, prompts[0]
        return varied_reward(completions)

    trainer, _ = train("qwen2_vl", tmp_path, reward=reward, log_completions=True, logging_steps=1)
    assert all(isinstance(i, Image.Image) for i in seen["image"])
    parts = seen["prompt"][0]["content"]
    assert parts[0]["type"] == "image" and isinstance(parts[0]["image"], Image.Image)  # TRL's prompt layout
    logs = trainer._logs
    assert len(logs["images"]) == len(logs["prompt"]) == 4 and isinstance(logs["images"][0][0], Image.Image)
    assert logs["prompt"][0][0]["content"][0] == {"type": "image"}  # the table holds no image objects
    assert os.path.exists(tmp_path / "completions" / "completions_00001.parquet")


def test_log_multimodal_false_keeps_no_images(tmp_path):
    trainer, _ = train("gemma3", tmp_path, log_completions=True, log_multimodal=False, logging_steps=1)
    assert len(trainer._logs["images"]) == 0 and len(trainer._logs["prompt"]) == 4


def test_a_model_path_loads_the_model_and_its_processor(tmp_path):
    model, processor = make_tiny_vlm("gemma3")
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    trainer = make_trainer(tmp_path / "run", None, image_dataset(), varied_reward, str(tmp_path / "model"),
                           max_steps=1)
    assert type(trainer.processing_class).__name__ == "Gemma3Processor"
    assert type(trainer.model).__name__ == "Gemma3ForConditionalGeneration"
    trainer.train()


def test_the_fast_backend_hands_image_rounds_to_generate(tmp_path, caplog):
    backend._told_about_images.discard("fast")  # said once per process
    with caplog.at_level(logging.INFO, logger="grpo_trainer.rollout.backend"):
        trainer, _ = train("llava", tmp_path, generation_backend="fast", max_steps=2)
    assert sum("does not take image inputs" in r.message for r in caplog.records) == 1  # two rounds, said once
    assert trainer.state.global_step == 2


def test_continuous_batching_is_refused_with_a_processor(tmp_path):
    with pytest.raises(ValueError, match="does not support multimodal models"):
        vlm_trainer("llava", tmp_path, use_transformers_continuous_batching=True)


def test_evaluate_with_images(tmp_path):
    trainer = vlm_trainer("qwen2_5_vl", tmp_path, eval_dataset=image_dataset(rows=2), per_device_eval_batch_size=4,
                          num_generations_eval=2)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "eval_reward" in metrics


def test_resume_in_the_middle_of_a_round_with_images(tmp_path):
    """A checkpoint taken between the micro-batches of a round keeps their image inputs: the resumed run ends
    where an uninterrupted one does."""
    def run(output_dir, stop_at, resume=None):
        trainer = vlm_trainer("qwen2_vl", output_dir, callbacks=[StopAt(stop_at)], per_device_train_batch_size=2,
                              steps_per_generation=2, max_steps=2, learning_rate=0.01, save_strategy="steps",
                              save_steps=1)
        trainer.train(resume_from_checkpoint=resume)
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    straight = run(tmp_path / "straight", 2)
    run(tmp_path / "split", 1)
    resumed = run(tmp_path / "split", 2, resume=str(tmp_path / "split" / "checkpoint-1"))
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) <= 1e-6
