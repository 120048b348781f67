"""The completions table: TRL's parquet columns, the JSONL copy, the printed table, the W&B / Trackio tables."""

import json
import math
import sys
import types

import pandas as pd
import pytest
import torch

from grpo_trainer.reporting.completions import CompletionLog, format_messages, unique_prompt_rows

CHAT = [{"role": "user", "content": "copy 12:"}]


def make_log(tmp_path, **kwargs) -> CompletionLog:
    settings = {"num_to_print": None, "max_rows": 4}
    settings.update(kwargs)
    return CompletionLog(str(tmp_path), ["correct", "short"], **settings)


def add_round(log, offset=0.0):
    log.add(["p0", "p0", "p1", "p1"], ["a", "bb", "c", "dd"],
            torch.tensor([[1.0, 0.5], [0.0, math.nan], [1.0, 0.0], [0.0, 1.0]]) + offset,
            torch.tensor([0.7, -0.7, 0.5, -0.5]), {"source": ["x", "y", "z", "w"]})


def test_parquet_file_has_trls_columns_in_trls_order(tmp_path):
    log = make_log(tmp_path)
    add_round(log)
    path = log.flush(3)
    assert path == str(tmp_path / "completions" / "completions_00003.parquet")
    frame = pd.read_parquet(path)
    assert list(frame.columns) == ["step", "prompt", "completion", "correct", "short", "source", "advantage"]
    assert frame["step"].tolist() == [3] * 4 and frame["completion"].tolist() == ["a", "bb", "c", "dd"]
    assert frame["correct"].tolist() == [1.0, 0.0, 1.0, 0.0] and math.isnan(frame["short"][1])  # None -> NaN
    assert frame["source"].tolist() == ["x", "y", "z", "w"]
    assert frame["advantage"].tolist() == pytest.approx([0.7, -0.7, 0.5, -0.5], abs=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "completions" / "completions_00003.jsonl").open()]
    assert rows[1] == {"step": 3, "prompt": "p0", "completion": "bb", "correct": 0.0, "short": None,
                       "source": "y", "advantage": rows[1]["advantage"]}  # None is null in JSON


def test_the_log_keeps_the_latest_round_and_a_log_step_does_not_clear_it(tmp_path):
    log = make_log(tmp_path)  # max_rows = 4: one round
    assert log.flush(1) is None  # nothing sampled yet: no file
    add_round(log)
    add_round(log, offset=10.0)
    log.flush(2)
    log.flush(3)  # a log step inside the round shows it again
    for step in (2, 3):
        frame = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        assert frame["correct"].tolist() == [11.0, 10.0, 11.0, 10.0]


def test_trls_logs_layout_and_columns_some_rounds_lack(tmp_path):
    log = make_log(tmp_path, max_rows=8)
    add_round(log)
    add_round(log)
    log.rows[-1]["extra"] = {}  # a round in which no reward function logged the column
    logs = log.columns()
    assert set(logs) == {"prompt", "completion", "rewards", "advantages", "extra", "images"}
    assert logs["images"] == []  # text rounds log no images
    assert logs["extra"] == {"source": ["x", "y", "z", "w", "x", "y", "z", None]}
    assert logs["rewards"]["correct"] == [1.0, 0.0, 1.0, 0.0] * 2


def test_conversations_are_stored_as_messages(tmp_path):
    log = make_log(tmp_path)
    log.add([CHAT] * 2, [[{"role": "assistant", "content": "12"}]] * 2, torch.tensor([[1.0, 1.0]] * 2),
            torch.tensor([0.0, 0.0]))
    frame = pd.read_parquet(log.flush(1))
    assert list(frame["prompt"][1]) == CHAT and list(frame["completion"][1]) == [{"role": "assistant", "content": "12"}]
    assert json.loads((tmp_path / "completions" / "completions_00001.jsonl").open().readline())["prompt"] == CHAT


def test_values_parquet_cannot_store_name_the_problem(tmp_path):
    log = make_log(tmp_path)
    log.add(["p", "q"], ["a", "b"], torch.ones(2, 2), torch.zeros(2), {"mixed": [1, "one"]})
    with pytest.raises(ValueError, match="completions of step 4 could not be written as parquet"):
        log.flush(4)


def test_printed_table(tmp_path, capsys):
    log = make_log(tmp_path)
    add_round(log)
    log.flush(7)
    out = capsys.readouterr().out
    assert "Step 7" in out and "Advantage" in out and "source" in out and "0.70" in out


def test_num_completions_to_print_draws_rows_without_touching_the_global_rng(tmp_path, capsys):
    import random

    log = make_log(tmp_path, num_to_print=2)
    add_round(log)
    random.seed(0)
    expected_next = random.random()
    random.seed(0)
    log.flush(5)
    assert random.random() == expected_next
    out = capsys.readouterr().out
    assert sum(f" {c} " in out for c in ("a", "bb", "c", "dd")) == 2  # two of the four completions
    log = make_log(tmp_path, num_to_print=0)
    add_round(log)
    log.flush(6)
    assert "Step 6" not in capsys.readouterr().out
    assert (tmp_path / "completions" / "completions_00006.parquet").exists()  # printing none still writes


def test_unique_prompt_rows_keeps_each_prompts_first_row():
    frame = pd.DataFrame({"prompt": ["p0", "p0", "p1", "p1", "p0"], "completion": ["a", "b", "c", "d", "e"]})
    assert unique_prompt_rows(frame)["completion"].tolist() == ["a", "c"]
    chats = pd.DataFrame({"prompt": [CHAT, CHAT, [{"role": "user", "content": "other"}]], "completion": [1, 2, 3]})
    assert unique_prompt_rows(chats)["completion"].tolist() == [1, 3]


class FakeBackend(types.ModuleType):
    """A stand-in for the trackio / wandb module: records what the log sends it."""

    def __init__(self, name):
        super().__init__(name)
        self.logged, self.run = [], object()

    def Table(self, dataframe):  # noqa: N802 - the libraries' name
        return dataframe

    def Image(self, image):  # noqa: N802 - the libraries' name
        return ("image", image)

    def log(self, payload):
        self.logged.append(payload)


def test_tables_go_to_the_report_to_backends_with_unique_prompts(tmp_path, monkeypatch):
    trackio, wandb = FakeBackend("trackio"), FakeBackend("wandb")
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log = make_log(tmp_path, unique_prompts=True, report_to=["trackio"])
    add_round(log)
    log.flush(1)
    (payload,) = trackio.logged
    assert payload["completions"]["completion"].tolist() == ["a", "c"]  # one row per distinct prompt
    assert wandb.logged == []  # not in report_to
    wandb.run = None  # W&B without an active run: nothing is logged
    log.report_to = ["wandb"]
    log.flush(2)
    assert wandb.logged == []


def test_a_backend_that_is_not_installed_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import fails
    monkeypatch.setitem(sys.modules, "wandb", None)
    log = make_log(tmp_path, report_to=["wandb", "trackio"])
    add_round(log)
    assert log.flush(1)


def test_format_messages():
    assert format_messages("plain") == "plain"
    assert format_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == \
        "USER\nhi\n\nASSISTANT\nyo"
    assert format_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]) \
        == "USER\n[IMAGE]what?"


def test_multi_turn_completions_are_written_with_their_tool_calls_arguments_as_json(tmp_path):
    # Two tools with different arguments, one without any: as objects they fit no single parquet column.
    def call(name, arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]}

    completions = [[call("get", {}), {"role": "tool", "name": "get", "content": "42"},
                    {"role": "assistant", "content": "42"}],
                   [call("multiply", {"a": 3, "b": 4}), {"role": "tool", "name": "multiply", "content": "12"},
                    {"role": "assistant", "content": "12"}]]
    log = make_log(tmp_path, max_rows=2)
    log.add([CHAT, CHAT], completions, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, -1.0]))
    frame = pd.read_parquet(log.flush(1))
    calls = [row[0]["tool_calls"][0]["function"] for row in frame["completion"]]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get", {}), ("multiply", {"a": 3, "b": 4})]
    assert completions[1][0]["tool_calls"][0]["function"]["arguments"] == {"a": 3, "b": 4}  # the rewards' copy
    assert format_messages(log.columns()["completion"][1]) == \
        'ASSISTANT\n\n-> multiply({"a": 3, "b": 4})\n\nTOOL\n12\n\nASSISTANT\n12'


def test_prompt_images_go_to_the_backend_tables_not_the_files(tmp_path, monkeypatch):
    trackio = FakeBackend("trackio")
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    log = make_log(tmp_path, report_to=["trackio"])
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    log.add([prompt] * 4, ["a", "b", "c", "d"], torch.zeros(4, 2), torch.zeros(4),
            images=[["red"], ["red"], ["blue", "green"], []])  # stand-ins for the PIL images
    assert log.columns()["images"] == [["red"], ["red"], ["blue", "green"], []]
    frame = pd.read_parquet(log.flush(1))
    assert "image" not in frame.columns
    assert json.loads((tmp_path / "completions" / "completions_00001.jsonl").open().readline())["prompt"] == prompt
    (payload,) = trackio.logged
    assert payload["completions"]["image"].tolist() == [[("image", "red")], [("image", "red")],
                                                        [("image", "blue"), ("image", "green")], []]
