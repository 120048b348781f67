"""A separately started vLLM server (`vllm_mode='server'`): generation over HTTP and the weight transfer to it.

Decisions:

1. Only the main process talks to the server. It waits for `/health` up to `vllm_server_timeout` seconds, then
   raises a ConnectionError naming the URL; it reads the served model from `/v1/models` and the server's config
   from `/server_info`, a development route (`VLLM_SERVER_DEV_MODE=1`, which `grpo-train vllm-serve` sets): without
   it the weights could not be updated, so that is an error too. A server whose log-probs are not
   `processed_logprobs` gets TRL's warning (the importance-sampling correction would be biased).
2. Generation is one `/v1/completions` request per group size `n` (normally one request per round): token-id
   prompts, `n` completions each, the sampled tokens' log-probs, completions back in prompt order.
3. Two weight transfers, chosen from what the server offers:
   - `nccl` (CUDA, a server started with `--weight-transfer-config '{"backend": "nccl"}'`, as `vllm-serve` does
     on a GPU): vLLM's own trainer-side NCCL engine broadcasts each gathered tensor to the server's workers.
   - `file` (everywhere else, e.g. vLLM's CPU build, where the NCCL engine cannot run): the main process writes
     the weights as safetensors shards into a folder the server can read (same machine or shared file system:
     `/dev/shm` when available), then asks the server to reload from it through `/collective_rpc`
     (`reload_weights`); the shards are deleted afterwards. The trainer holds at most one shard (`SHARD_BYTES`).
   Either way every process iterates the weights (gathering is a collective), and the prefix cache is reset.
4. A server started by `grpo-train vllm-serve` carries `inspection.WorkerInspection` in its workers (reached through
   `/collective_rpc`): a file push then reports the engine parameters it did not reach, and the weight-sync check
   can read the weights back. Any other vLLM server still trains; only those two things are unavailable.
5. Prompts with images go one request each to `/inference/v1/generate` (vLLM's token-in route, `--enable-scale-out`),
   as token ids with their images as PNG data URLs: the server expands and processes them as a colocated engine
   does, and returns the prompt it expanded (checked by the backend). Text prompts use `/v1/completions`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling.export import inference_weight_metadata, inference_weights
from grpo_trainer.rollout.vllm.sampling import Completion, Request

__all__ = ["SHARD_BYTES", "ServerClient", "ServerWeights", "server_url", "wait_for_server"]

logger = logging.getLogger(__name__)

SHARD_BYTES = 512 * 2**20  # the largest weights file the `file` transfer writes at once


def server_url(base_url: str | None, host: str, port: int) -> str:
    """`vllm_server_base_url` if set, else http://host:port."""
    return (base_url or f"http://{host}:{port}").rstrip("/")


def wait_for_server(url: str, timeout: float, interval: float = 1.0) -> None:
    """Return once `url/health` answers 200; ConnectionError naming the URL after `timeout` seconds."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{url}/health", timeout=max(1.0, min(10.0, timeout))).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"The vLLM server at {url} did not answer within vllm_server_timeout={timeout:g} s (GET {url}/health). "
                "Start it first, e.g. `grpo-train vllm-serve --model <model>`, and check vllm_server_base_url (or "
                "vllm_server_host and vllm_server_port).")
        time.sleep(interval)


class ServerClient:
    """The main process's connection to a vLLM server (decision 1)."""

    def __init__(self, url: str, timeout: float, group_port: int) -> None:
        import requests

        self.url, self.group_port = url, group_port
        self.session = requests.Session()
        wait_for_server(url, timeout)
        self.model = self._get("/v1/models")["data"][0]["id"]
        response = self.session.get(f"{url}/server_info", params={"config_format": "json"})
        if response.status_code == 404:
            raise RuntimeError(f"The vLLM server at {url} does not expose its development routes, which the weight "
                               "updates use. Restart it with VLLM_SERVER_DEV_MODE=1 in its environment (`grpo-train "
                               "vllm-serve` sets it).")
        self.config = self._checked(response)["vllm_config"]
        self.nccl = None
        self.inspection = self._rpc_status("grpo_inspection_version") == 200  # decision 4

    def _checked(self, response: Any) -> Any:
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server at {self.url} answered {response.status_code} to "
                               f"{response.request.method} {response.request.path_url}: {response.text[:2000]}")
        return response.json() if response.content else None

    def _get(self, path: str) -> Any:
        return self._checked(self.session.get(f"{self.url}{path}"))

    def _post(self, path: str, json: Any = None) -> Any:
        return self._checked(self.session.post(f"{self.url}{path}", json=json))

    @property
    def logprobs_mode(self) -> str | None:
        return (self.config.get("model_config") or {}).get("logprobs_mode")

    @property
    def device(self) -> str | None:
        """The server's device type ('cpu', 'cuda', ...)."""
        return str((self.config.get("device_config") or {}).get("device") or "") or None

    @property
    def transfer(self) -> str:
        """'nccl' or 'file' (decision 3)."""
        backend = (self.config.get("weight_transfer_config") or {}).get("backend")
        return "nccl" if backend == "nccl" and torch.cuda.is_available() else "file"

    def _rpc_status(self, method: str) -> int:
        return self.session.post(f"{self.url}/collective_rpc", json={"method": method}).status_code

    def inspect(self, method: str, *args: str) -> object:
        """The first worker's answer to a `WorkerInspection` method (decision 4)."""
        return self._post("/collective_rpc", {"method": method, "args": list(args)})["results"][0]

    def score(self, requests: Sequence[Request]) -> list[list[float | None]]:
        """The server's log-prob of each token after the first of each request's prompt, as the server expanded it
        (raw, temperature 1)."""
        params = {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        out = []
        for with_images, group in groupby(requests, key=lambda r: bool(r.images)):
            group = list(group)
            if with_images:
                for request in group:
                    answer = self._generate_with_images(request, params)
                    out.append(_prompt_logprobs(answer["prompt_logprobs"], answer["prompt_token_ids"]))
                continue
            payload = {"model": self.model, "prompt": [r.ids for r in group], "return_token_ids": True, **params}
            for request, choice in zip(group, self._post("/v1/completions", payload)["choices"]):
                out.append(_prompt_logprobs(choice["prompt_logprobs"], request.ids))
        return out

    def _generate_with_images(self, request: Request, params: dict[str, Any]) -> dict:
        """`/inference/v1/generate` (`--enable-scale-out`, which `grpo-train vllm-serve` passes): token ids with their
        images, which the server expands and processes as the colocated engine does (decision 5)."""
        payload = {"model": self.model, "token_ids": request.ids, "return_token_ids": True,
                   "content_parts": [{"type": "image_url", "url": _data_url(image)} for image in request.images],
                   # FINAL_ONLY: the default output kind drops all but the last-finished sequence when n > 1
                   "sampling_params": {**params, "output_kind": 2}}
        response = self.session.post(f"{self.url}/inference/v1/generate", json=payload)
        if response.status_code in (403, 404):  # 403: vLLM's answer while the route is disabled
            raise RuntimeError(f"The vLLM server at {self.url} does not serve /inference/v1/generate, which prompts "
                               "with images use. Restart it with --enable-scale-out (`grpo-train vllm-serve` passes "
                               "it).")
        return self._checked(response)

    def generate(self, requests: Sequence[Request], settings: dict[str, Any]
                 ) -> tuple[list[Completion], list[list[int] | None]]:
        """One completion per row, in row order, for `requests` (each `n` rows; decision 2), and each request's prompt
        as the server expanded it (None where it did not say)."""
        completions: list[Completion] = []
        seen: list[list[int] | None] = []
        for (n, with_images), group in groupby(requests, key=lambda r: (r.n, bool(r.images))):
            group = list(group)
            if with_images:
                for request in group:
                    answer = self._generate_with_images(request, {**settings, "n": n})
                    seen.append(answer.get("prompt_token_ids"))
                    for choice in answer["choices"]:
                        content = (choice.get("logprobs") or {}).get("content")
                        tokens = choice["token_ids"]
                        completions.append((tokens, [c["logprob"] for c in content] if content is not None
                                            else [None] * len(tokens)))
                continue
            payload = {"model": self.model, "prompt": [r.ids for r in group], "n": n, "return_token_ids": True,
                       **settings}
            choices = self._post("/v1/completions", payload)["choices"]  # prompt-major, n per prompt
            seen += [choice.get("prompt_token_ids") for choice in choices[::n]]
            for choice in choices:
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
                tokens = choice["token_ids"]
                completions.append((tokens, logprobs if logprobs is not None else [None] * len(tokens)))
        return completions, seen


class ServerWeights:
    """One process's side of the weight transfer (decision 3): `client` on the main process, None elsewhere;
    `transfer` as the main process chose it (`ServerClient.transfer`)."""

    def __init__(self, client: ServerClient | None, transfer: str) -> None:
        self.client, self.transfer = client, transfer
        self.nccl: Any = None

    def _open_nccl(self, model: nn.Module) -> Any:
        """vLLM's trainer-side NCCL engine; the main process opens the group with the server's workers."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        source = _policy_source(model)
        if self.client is None:  # iterates the weights to take part in the gathers, sends nothing
            return NCCLTrainerWeightTransferEngine(client=None, source=source, is_sender=False)
        from vllm.utils.network_utils import get_ip

        world = self.client._get("/get_world_size")["world_size"] + 1  # the trainer is rank 0, the workers follow
        info = NCCLTrainerInitInfo(master_address=get_ip(), master_port=self.client.group_port, world_size=world,
                                   rank=0)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(self.client.url),
                                                            source=source)

    def push(self, model: nn.Module) -> list[str] | None:
        """Send the weights of `model` (the unwrapped policy); every process calls it. The main process returns the
        engine parameters the push did not reach, when the server can tell (the file transfer to a server with
        `inspection.WorkerInspection`), else None."""
        unreached = None
        if self.transfer == "nccl":
            if self.nccl is None:
                self.nccl = self._open_nccl(model)
            self.nccl.send_weights()
        elif self.client is None:
            for _ in inference_weights(model):  # take part in the gathers
                pass
        else:
            folder = _write_shards(inference_weights(model))
            method = "grpo_reload_weights" if self.client.inspection else "reload_weights"
            try:
                answer = self.client._post("/collective_rpc", {"method": method, "kwargs": {"weights_path": folder}})
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if self.client.inspection and answer is not None:
                unreached = answer["results"][0]
        if self.client is not None:
            self.client._post("/reset_prefix_cache")
            # image embeddings cached under the old weights are stale; vLLM 0.32's reload also empties the worker's
            # encoder cache but not the scheduler's record of it, so a repeated image then fails the whole engine
            # ("Encoder cache miss"): reset both (the matrix's DDP server row with image prompts found it)
            self.client._post("/reset_encoder_cache")
        return unreached


def _prompt_logprobs(entries: list[dict | None], ids: Sequence[int]) -> list[float | None]:
    """The log-prob of each token after the first of `ids`, from a vLLM server's prompt log-probs (one entry per
    token, {token id: {"logprob": ...}} with the keys as strings)."""
    out = []
    for entry, token in zip(entries[1:], ids[1:]):
        value = None if entry is None else entry.get(str(token), entry.get(f"token_id:{token}"))
        out.append(None if value is None else value["logprob"])
    return out


def _data_url(image: Any) -> str:
    """An image as a PNG data URL (lossless: the server decodes the same pixels)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _write_shards(weights: Iterator[tuple[str, Tensor]]) -> str:
    """Write `weights` as safetensors shards of at most `SHARD_BYTES` into a new folder; return it."""
    from safetensors.torch import save_file

    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="grpo-vllm-weights-", dir=root)
    shard: dict[str, Tensor] = {}
    size = index = 0
    for name, tensor in weights:
        # a copy: tied tensors share storage, which one safetensors file refuses; it also ends the gather
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += shard[name].nbytes
        if size >= SHARD_BYTES:
            save_file(shard, os.path.join(folder, f"weights-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, os.path.join(folder, f"weights-{index:05d}.safetensors"))
    return folder


def _policy_source_class() -> type:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PolicySource(WeightSource):
        """vLLM's weight source over `inference_weights` (checkpoint names, LoRA merged, gathered one by one)."""

        def __init__(self, model: nn.Module) -> None:
            self.model = model

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in inference_weight_metadata(self.model)]

        def __iter__(self) -> Iterator[tuple[str, Tensor]]:
            device = torch.device("cuda", torch.cuda.current_device())
            for name, tensor in inference_weights(self.model):
                yield name, tensor.to(device)

    return PolicySource


def _policy_source(model: nn.Module) -> Any:
    return _policy_source_class()(model)  # the class is built on first use: vllm is optional
