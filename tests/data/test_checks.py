"""Every row's prompt is checked before any model is loaded (on the Arrow column for a `datasets.Dataset`), the
first bad row is named, and a dataset too small for one generation round is refused with the sizes."""

from unittest import mock

import pytest
from datasets import Dataset, IterableDataset
from datasets.formatting.formatting import PythonFormatter

from grpo_trainer.data.checks import check_dataset, check_enough_prompts

CHAT = [{"role": "user", "content": "copy 1:"}]


@pytest.mark.parametrize("prompts, message", [
    (["copy 1:", "copy 2:", None, "copy 4:"], "train_dataset row 2 has no prompt ('prompt' is None)"),
    ([None, None], "train_dataset row 0 has no prompt"),  # a column of nulls only
    ([CHAT, CHAT, None], "train_dataset row 2 has no prompt"),
    ([CHAT, [], CHAT], "row 1 holds list: '[]'"),
    ([CHAT, CHAT + [None]], "row 1 holds list:"),
    ([3, 4], "row 0 holds int: '3'"),
])
def test_the_first_bad_row_is_named(tokenizer, prompts, message):
    with pytest.raises(ValueError) as error:
        check_dataset(Dataset.from_dict({"prompt": prompts}), "train_dataset", tokenizer)
    assert message in str(error.value)


def test_rows_are_numbered_as_the_user_sees_them_after_a_shuffle(tokenizer):
    dataset = Dataset.from_dict({"prompt": ["a", "b", None, "d", "e"]}).shuffle(seed=0)
    row = [p for p in dataset["prompt"]].index(None)
    with pytest.raises(ValueError, match=f"train_dataset row {row} has no prompt"):
        check_dataset(dataset, "train_dataset", tokenizer)


def test_a_large_dataset_is_checked_without_a_python_object_per_row(tokenizer):
    dataset = Dataset.from_dict({"prompt": [f"copy {i}:" for i in range(200_000)]})
    dataset = dataset.map(lambda row, i: {"prompt": None if i == 150_000 else row["prompt"]}, with_indices=True)
    with mock.patch.object(PythonFormatter, "format_row", autospec=True,
                           side_effect=PythonFormatter.format_row) as rows_built:
        with pytest.raises(ValueError, match="train_dataset row 150000 has no prompt"):
            check_dataset(dataset, "train_dataset", tokenizer)
    assert rows_built.call_count == 1  # only the bad row, to show it


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a"}, {"prompt": None}], "train_dataset row 1 has no prompt"),
    ([{"prompt": "a"}, {"prompt": CHAT}], "mixes plain-text and conversational prompts (row 1 differs from row 0)"),
    ([], "train_dataset is empty"),
])
def test_other_map_style_datasets_are_checked_row_by_row(tokenizer, rows, message):
    with pytest.raises(ValueError) as error:
        check_dataset(rows, "train_dataset", tokenizer)
    assert message in str(error.value)


def test_a_stream_is_checked_by_its_first_row_only(tokenizer):
    def rows():
        yield {"prompt": "copy 1:"}
        raise AssertionError("the check read past the first row of a stream")

    check_dataset(IterableDataset.from_generator(rows), "train_dataset", tokenizer)


def test_a_dataset_smaller_than_one_generation_round_is_refused_with_the_sizes():
    dataset = Dataset.from_dict({"prompt": ["copy 1:"] * 3})
    check_enough_prompts(dataset, "train_dataset", generation_batch_size=6, num_generations=2)  # 3 prompts: enough
    with pytest.raises(ValueError) as error:
        check_enough_prompts(dataset, "train_dataset", generation_batch_size=8, num_generations=2)
    message = str(error.value)
    assert message.startswith("train_dataset has 3 prompts but one generation round needs 4 (generation_batch_size "
                              "8 / num_generations 2), so training would stop at step 0.")
    assert "lower per_device_train_batch_size or steps_per_generation" in message
    stream = Dataset.from_dict({"prompt": ["copy 1:"]}).to_iterable_dataset()
    check_enough_prompts(stream, "train_dataset", 8, 2)  # no length: nothing to check
