"""Pushing completion files to a Hub dataset repo (`log_completions_hub_repo`), against a local stand-in of the Hub's
HTTP API (tests/reporting/hub_stand_in.py): never the network."""

import warnings

import pandas as pd
import pytest
from huggingface_hub import constants

from grpo_trainer.reporting.completions_hub import start_upload
from tests.helpers import make_trainer
from tests.reporting.hub_stand_in import READ_TOKEN, WRITE_TOKEN, HubStandIn


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubStandIn() as stand_in:
        monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)  # what HF_ENDPOINT sets when huggingface_hub loads
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite is offline; the stand-in is local
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
        uploads = []
        stand_in.started = uploads  # each test's uploads are stopped before the stand-in goes away
        yield stand_in
        for upload in uploads:
            upload.stop()  # a last push (nothing new by then), then no more


def write_step(folder, step):
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"step": [step], "prompt": ["p"], "completion": ["c"], "advantage": [0.0]}).to_parquet(
        folder / f"completions_{step:05d}.parquet")
    (folder / f"completions_{step:05d}.jsonl").write_text("{}\n")


def start(hub, *args, **kwargs):
    upload = start_upload(*args, **kwargs)
    if upload is not None:
        hub.started.append(upload)
    return upload


def test_creates_a_private_dataset_repo_pushes_its_card_then_the_parquet_files(hub, tmp_path):
    folder = tmp_path / "completions"
    write_step(folder, 1)
    upload = start(hub, "org/logs", str(folder), private=True, token=WRITE_TOKEN, hub_model_id="org/model")
    upload.push_now()
    repo = hub.repo("org/logs")
    assert repo is not None and repo["private"] is True
    assert "org/model" in repo["files"]["README.md"].decode()
    assert sorted(repo["files"]) == ["README.md", "completions_00001.parquet"]  # the JSONL copies stay local
    assert repo["files"]["completions_00001.parquet"] == (folder / "completions_00001.parquet").read_bytes()
    commits = len(hub.commits)
    upload.push_now()  # nothing new: no commit
    assert len(hub.commits) == commits
    write_step(folder, 2)
    upload.push_now()
    assert hub.commits[-1]["files"] == ["completions_00002.parquet"]  # only what changed since the last push
    writes = [(path, token) for _, path, token in hub.requests if path.endswith(("/create", "/main"))]
    assert writes and all(token == WRITE_TOKEN for _, token in writes), writes


def test_a_repo_name_without_namespace_goes_to_the_users_namespace(hub, tmp_path):
    upload = start(hub, "logs", str(tmp_path), private=None, token=WRITE_TOKEN)
    assert upload.repo_id == "me/logs" and hub.repo("me/logs")["private"] is False


def test_the_token_found_by_huggingface_hub_is_used(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    assert start(hub, "org/logs", str(tmp_path), private=None) is not None


def test_no_token_warns_and_contacts_nothing(hub, tmp_path):
    with pytest.warns(UserWarning, match=r"log_completions_hub_repo='org/logs' is set but no Hugging Face token was "
                                         r"found.*hf auth login"):
        assert start(hub, "org/logs", str(tmp_path), private=None) is None
    assert hub.requests == []


def test_a_token_that_cannot_create_the_repo_warns(hub, tmp_path):
    with pytest.warns(UserWarning, match=r"'org/logs': creating the dataset repo or pushing its card failed; the Hub "
                                         r"refused the token \(HTTP 403\).*Training goes on"):
        assert start(hub, "org/logs", str(tmp_path), private=None, token=READ_TOKEN) is None


def test_a_token_that_cannot_write_to_an_existing_repo_warns(hub, tmp_path):
    start(hub, "org/logs", str(tmp_path), private=None, token=WRITE_TOKEN)  # someone else's repo, readable
    with pytest.warns(UserWarning, match=r"the Hub refused the token \(HTTP 403\): it may not create or write"):
        assert start(hub, "org/logs", str(tmp_path), private=None, token=READ_TOKEN) is None


def test_a_failed_periodic_push_warns_and_is_tried_again(hub, tmp_path):
    folder = tmp_path / "completions"
    upload = start(hub, "org/logs", str(folder), private=None, token=WRITE_TOKEN)
    hub.revoked = True
    write_step(folder, 1)
    with pytest.warns(UserWarning, match=r"'org/logs': uploading the completion files failed; the Hub refused"):
        upload.push_now()  # returns: a failed upload never raises into training
    hub.revoked = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upload.push_now()
    assert "completions_00001.parquet" in hub.repo("org/logs")["files"]


def train_with_hub(tmp_path, tiny_model, tokenizer, toy_dataset, **overrides):
    trainer = make_trainer(tmp_path / "run", tokenizer, toy_dataset, model=tiny_model, max_completion_length=4,
                           log_completions=True, num_completions_to_print=0, log_completions_hub_repo="me/run-logs",
                           **overrides)
    trainer.train()
    return trainer


def test_training_pushes_every_log_steps_file_to_a_private_repo(hub, tmp_path, tiny_model, tokenizer, toy_dataset):
    trainer = train_with_hub(tmp_path, tiny_model, tokenizer, toy_dataset, hub_private_repo=True,
                             hub_token=WRITE_TOKEN)
    hub.started.append(trainer._completions_upload)
    repo = hub.repo("me/run-logs")
    assert repo["private"] is True
    assert sorted(repo["files"]) == ["README.md", "completions_00001.parquet", "completions_00002.parquet"]
    local = tmp_path / "run" / "completions" / "completions_00002.parquet"
    assert repo["files"]["completions_00002.parquet"] == local.read_bytes()  # pushed when train() returned


def test_training_without_a_token_warns_and_keeps_the_files(hub, tmp_path, tiny_model, tokenizer, toy_dataset):
    with pytest.warns(UserWarning, match="no Hugging Face token was found"):
        trainer = train_with_hub(tmp_path, tiny_model, tokenizer, toy_dataset)
    assert trainer.state.global_step == 2 and hub.requests == []
    assert (tmp_path / "run" / "completions" / "completions_00002.parquet").exists()


def test_training_with_a_read_only_token_warns_and_goes_on(hub, tmp_path, tiny_model, tokenizer, toy_dataset):
    with pytest.warns(UserWarning, match=r"refused the token \(HTTP 403\)"):
        trainer = train_with_hub(tmp_path, tiny_model, tokenizer, toy_dataset, hub_token=READ_TOKEN)
    assert trainer.state.global_step == 2 and hub.repo("me/run-logs") is None
