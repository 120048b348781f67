"""Pushing the completion files to a Hugging Face Hub dataset repo while training runs (`log_completions_hub_repo`).

Decisions:

1. As TRL does: the dataset repo is created if needed (private when `hub_private_repo` is set), a dataset card is
   pushed once, and a `huggingface_hub.CommitScheduler` uploads the new or changed `*.parquet` files of
   `output_dir/completions` from a background thread every `PUSH_EVERY_MINUTES`, and once more at interpreter exit.
   The trainer also pushes when `train()` returns, so the last steps' files do not wait for either.
2. Uploading never stops training. No token, a repo the token may not write, an unreachable Hub or a failed commit
   is reported by a warning that names the repo, the cause and the fix; the files stay on disk.
3. The token is `hub_token` when set, else the one huggingface_hub finds (`HF_TOKEN`, `hf auth login`). The Hub is
   the one `HF_ENDPOINT` names, as for every huggingface_hub call.
"""

from __future__ import annotations

import warnings
from typing import Any

from huggingface_hub import CommitScheduler, HfApi, get_token

__all__ = ["PUSH_EVERY_MINUTES", "CompletionsUpload", "dataset_card", "start_upload"]

PUSH_EVERY_MINUTES = 2  # TRL's interval


def dataset_card(repo_id: str, hub_model_id: str | None) -> str:
    """README.md of the completions dataset: what the files hold and how to load them."""
    model = f"\nThe model being trained: https://huggingface.co/{hub_model_id}\n" if hub_model_id else ""
    return f"""---
pretty_name: GRPO completion logs
tags:
- grpo_trainer
- trl-logs
- completions
---

# Completions sampled during GRPO training

Written by grpo_trainer while training with `log_completions=True`.
{model}
Each `completions_<step>.parquet` file holds the latest generation round at that logging step, one row per
completion, with the columns `step`, `prompt`, `completion`, one column per reward function (its score; missing when
the function returned None), the columns reward functions added with `log_extra`, and `advantage`.

```python
from datasets import load_dataset

completions = load_dataset("{repo_id}", split="train")
```
"""


class _Scheduler(CommitScheduler):
    """A CommitScheduler whose failed pushes warn (and are tried again at the next tick) instead of failing
    silently in a background future."""

    def __init__(self, **kwargs: Any) -> None:
        # huggingface_hub < 2 (what transformers < 5.19 installs) starts the scheduler's thread, whose first push
        # reads this flag, before setting it: set it first.
        self._CommitScheduler__stopped = False
        super().__init__(**kwargs)

    def _push_to_hub(self) -> Any:
        try:
            return super()._push_to_hub()
        except Exception as exc:  # noqa: BLE001 - any failure of an upload must leave training running
            warnings.warn(failure_message(self.repo_id, "uploading the completion files", exc, str(self.folder_path)),
                          stacklevel=2)
            return None


class CompletionsUpload:
    """The running upload of one completions folder to one dataset repo."""

    def __init__(self, scheduler: CommitScheduler) -> None:
        self.scheduler = scheduler
        self.repo_id = scheduler.repo_id

    def push_now(self) -> None:
        """Upload the files written since the last push, and wait for it (a failure warns)."""
        self.scheduler.trigger().result()

    def stop(self) -> None:
        """Push what is left, then stop the background thread's pushes."""
        self.push_now()
        self.scheduler.stop()


def failure_message(repo_id: str, action: str, error: BaseException, folder: str) -> str:
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        cause = (f"the Hub refused the token (HTTP {status}): it may not create or write to this repo. Use a token "
                 "with write access to that namespace (`hf auth login`, HF_TOKEN or hub_token), or choose a repo "
                 "you own")
    else:
        cause = f"{type(error).__name__}: {error}"
    return (f"log_completions_hub_repo={repo_id!r}: {action} failed; {cause}. Training goes on and the completions "
            f"stay in {folder}.")


def start_upload(repo_id: str, folder: str, private: bool | None, token: str | None = None,
                 hub_model_id: str | None = None,
                 every_minutes: float = PUSH_EVERY_MINUTES) -> CompletionsUpload | None:
    """Create the dataset repo, push its card and start the periodic upload of `folder`'s parquet files. Returns
    None, after a warning saying why, when the repo cannot be used."""
    token = token or get_token()
    if token is None:
        warnings.warn(f"log_completions_hub_repo={repo_id!r} is set but no Hugging Face token was found, so the "
                      f"completions are not pushed (they stay in {folder}). Log in with `hf auth login`, or set "
                      "HF_TOKEN or hub_token.", stacklevel=2)
        return None
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True).repo_id
        api.upload_file(path_or_fileobj=dataset_card(repo_id, hub_model_id).encode(), path_in_repo="README.md",
                        repo_id=repo_id, repo_type="dataset", commit_message="Dataset card of the completion logs")
        scheduler = _Scheduler(repo_id=repo_id, repo_type="dataset", folder_path=folder, every=every_minutes,
                               private=private, allow_patterns=["*.parquet"], hf_api=api)
    except Exception as exc:  # noqa: BLE001 - see decision 2
        warnings.warn(failure_message(repo_id, "creating the dataset repo or pushing its card", exc, folder),
                      stacklevel=2)
        return None
    return CompletionsUpload(scheduler)
