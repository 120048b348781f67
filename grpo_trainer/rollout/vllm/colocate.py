"""vLLM inside the training process (`vllm_mode='colocate'`): one engine per process, on the trainer's device.

Decisions:

1. The engine is built from the policy's config and tokenizer, written to a temporary folder, with placeholder
   weights (`load_format='dummy'`); the trainer pushes the real ones before the first rollout. So a model given as
   an object, trained or built from a config, is served as it is, and nothing is read from its checkpoint twice.
   Remote-code models are served from their own path instead (the folder would lack their code). The engine
   computes in the policy's dtype.
2. In-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the weights go to the worker by reference, so a
   push streams one gathered parameter at a time into vLLM's layerwise reload (`reload_weights` with an iterator;
   vLLM buffers a fused layer's shards until the layer is complete). Several processes each run their own engine
   through vLLM's external launcher, sharing the trainer's process group; `vllm_tensor_parallel_size` ranks form
   one engine, which all of them feed the same prompts and sampling seeds.
3. Building the engine has side effects this module undoes: vLLM re-seeds the global RNGs (restored) and its CPU
   worker replaces `torch.set_num_threads` with a no-op (restored). Sampling then draws from the process's torch
   RNG, which the trainer seeds, so a seeded run samples the same completions again.
4. On CPU the KV cache is always given a size (vLLM would otherwise reserve `gpu_memory_utilization` of the machine's
   RAM), and the model runs eagerly (compilation would cost minutes at start-up); `VLLM_CPU_KVCACHE_SPACE` (GiB),
   when set, takes precedence.
5. A weight push ends by resetting the prefix cache: its blocks were computed with the old weights.
6. Sleep mode (GPU only): the engine sleeps between rollouts with its weights discarded (level 2), so the next
   rollout pushes them again whether or not they changed.
7. The engine lives as long as the process: vLLM's shutdown destroys the default process group, which the trainer
   shares under the external launcher. At exit it is shut down while that group still exists; after the script
   ended it (`accelerator.end_training()`), vLLM's cleanup is skipped instead of failing on destroyed groups.
8. The engine's workers carry `inspection.WorkerInspection`: a push reports the engine parameters it did not
   reach, and the weight-sync check can read the weights back (`inspect`) and score token sequences (`score`).
"""

from __future__ import annotations

import atexit
import copy
import os
import random
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.multimodal import is_processor
from grpo_trainer.rollout.vllm.inspection import EXTENSION
from grpo_trainer.rollout.vllm.sampling import Completion, Request

__all__ = ["ColocateEngine", "EngineSettings", "kv_cache_bytes"]


@dataclass(frozen=True)
class EngineSettings:
    """How the in-process engine is built (GRPOConfig's `vllm_*` fields, resolved by the backend)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.3
    max_model_length: int | None = None
    max_num_seqs: int = 64
    enable_sleep_mode: bool = False
    model_impl: str = "vllm"
    trust_remote_code: bool = False
    seed: int = 0
    cpu: bool = False
    kv_cache_bytes: int | None = None  # CPU only (decision 4)


def kv_cache_bytes(config: Any, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of KV cache for `tokens` tokens of a model (keys and values of every layer), in whole 128-token
    blocks (vLLM's CPU block size)."""
    from grpo_trainer.rollout.vllm.checks import head_dim

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim(config) * dtype.itemsize
    return -(-tokens // 128) * 128 * per_token


def _model_folder(model: nn.Module, processing_class: Any, trust_remote_code: bool) -> tuple[str, str]:
    """(what vLLM loads, its load format) for the policy (decision 1)."""
    lm = causal_lm(model)
    path = getattr(lm.config, "_name_or_path", "")
    if trust_remote_code and path:
        return path, "auto"
    folder = tempfile.mkdtemp(prefix="grpo-vllm-model-")
    config = copy.deepcopy(lm.config)
    if not getattr(config, "architectures", None):  # a model built from a config: vLLM picks its class by this name
        config.architectures = [type(lm).__name__]
    config.save_pretrained(folder)
    # A vision-language model's processor (its image processor and chat template too): vLLM processes the images.
    owner = processing_class if is_processor(processing_class) else getattr(processing_class, "tokenizer",
                                                                               processing_class)
    if hasattr(owner, "save_pretrained"):
        owner.save_pretrained(folder)
    return folder, "dummy"


def _policy_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _shut_down(llm_ref: weakref.ref) -> None:
    """Shut an engine down at exit (decision 7)."""
    llm = llm_ref()
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is None:
        return
    if torch.distributed.is_initialized():
        client.shutdown()
    elif getattr(client, "_finalizer", None) is not None:
        client._finalizer.detach()


class ColocateEngine:
    """An in-process `vllm.LLM` serving the policy; every method is called by every process."""

    def __init__(self, model: nn.Module, processing_class: Any, settings: EngineSettings) -> None:
        from vllm import LLM

        self.settings = settings
        source, load_format = _model_folder(model, processing_class, settings.trust_remote_code)
        kwargs: dict[str, Any] = {
            "model": source, "load_format": load_format, "dtype": str(_policy_dtype(model)).removeprefix("torch."),
            "tensor_parallel_size": settings.tensor_parallel_size, "max_model_len": settings.max_model_length,
            "max_num_seqs": settings.max_num_seqs, "max_num_batched_tokens": 4096, "model_impl": settings.model_impl,
            "trust_remote_code": settings.trust_remote_code, "seed": settings.seed,
            "logprobs_mode": "processed_logprobs",  # the distribution sampled from, after temperature and filters
            "generation_config": "vllm",  # the checkpoint's sampling defaults never leak into a request
            "enable_sleep_mode": settings.enable_sleep_mode,
            "worker_extension_cls": EXTENSION,  # decision 8
        }
        if settings.cpu:
            kwargs["enforce_eager"] = True
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        from accelerate import PartialState

        self.tp_group = None
        if PartialState().num_processes > 1:  # the trainer's process group; vLLM's own otherwise
            kwargs["distributed_executor_backend"] = "external_launcher"
            self.tp_group = self._tensor_parallel_group(settings.tensor_parallel_size)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # decision 2
        set_num_threads = torch.set_num_threads
        python_state = random.getstate()
        with torch.random.fork_rng(devices=[]):  # decision 3
            try:
                self.llm = LLM(**kwargs)
            finally:
                torch.set_num_threads = set_num_threads
                random.setstate(python_state)
        atexit.register(_shut_down, weakref.ref(self.llm))  # decision 7
        self.weights_asleep = False
        if settings.enable_sleep_mode:
            self.llm.sleep(level=2)
            self.weights_asleep = True

    @staticmethod
    def _tensor_parallel_group(size: int) -> Any:
        """This process's group of `size` consecutive ranks (every process must create every group)."""
        world = torch.distributed.get_world_size()
        if world % size:
            raise ValueError(f"vllm_tensor_parallel_size ({size}) must divide the number of processes ({world}).")
        if size == 1:
            return None
        group, _ = torch.distributed.new_subgroups_by_enumeration(
            [list(range(i, i + size)) for i in range(0, world, size)])
        return group

    def load_weights(self, weights: Iterator[tuple[str, Tensor]]) -> list[str] | None:
        """Replace the engine's weights by `weights` (checkpoint names, every tensor of the model; decisions 2, 5);
        the engine parameters the push did not reach (decision 8)."""
        if self.settings.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        unreached = self.llm.collective_rpc("grpo_reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()  # image embeddings cached under the old weights are stale
        return unreached[0]

    def inspect(self, method: str, *args: str) -> object:
        """The first worker's answer to a `WorkerInspection` method (decision 8)."""
        return self.llm.collective_rpc(method, args=args)[0]

    def _group_requests(self, requests: Sequence[Request], extra: Any = None) -> tuple[list[Request], Any, slice]:
        """Every rank's requests when `vllm_tensor_parallel_size` ranks share one engine (they must all serve the same
        requests), rank 0's `extra`, and this rank's slice of them (decision 2)."""
        if self.tp_group is None:
            return list(requests), extra, slice(0, len(requests))
        group = [None] * torch.distributed.get_world_size(self.tp_group)
        torch.distributed.all_gather_object(group, (list(requests), extra), group=self.tp_group)
        offset = sum(len(r) for r, _ in group[:torch.distributed.get_rank(self.tp_group)])
        return [r for part, _ in group for r in part], group[0][1], slice(offset, offset + len(requests))

    @staticmethod
    def _prompt(request: Request) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=request.ids)
        if request.images:
            prompt["multi_modal_data"] = {"image": list(request.images)}
        return prompt

    def score(self, requests: Sequence[Request]) -> list[list[float | None]]:
        """The engine's log-prob of each token after the first of each request's prompt, as the engine expanded it
        (raw, temperature 1)."""
        from vllm import SamplingParams

        requests, _, mine = self._group_requests(requests)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([self._prompt(r) for r in requests], params, use_tqdm=False)[mine]
        return [[None if entry is None else entry[output.prompt_token_ids[i + 1]].logprob
                 for i, entry in enumerate(output.prompt_logprobs[1:])] for output in outputs]

    def generate(self, requests: Sequence[Request], settings: dict[str, Any]
                 ) -> tuple[list[Completion], list[list[int]]]:
        """One completion per row, in row order, for `requests` (each `n` rows), and each request's prompt as the
        engine expanded it."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        settings = dict(settings)
        if isinstance(settings.get("structured_outputs"), dict):
            settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
        seed = settings.pop("seed", None)
        if self.tp_group is not None and seed is None:  # one engine: the same seeds on every rank of the group
            seed = int(torch.randint(2**31 - 1, ()))
        requests, seed, mine = self._group_requests(requests, seed)
        params = [SamplingParams(n=r.n, seed=None if seed is None else (seed + i) % 2**31, **settings)
                  for i, r in enumerate(requests)]
        if self.settings.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([self._prompt(r) for r in requests], params, use_tqdm=False)[mine]
        if self.settings.enable_sleep_mode:
            self.llm.sleep(level=2)
            self.weights_asleep = True
        completions = [(list(c.token_ids), [None if c.logprobs is None else c.logprobs[i][t].logprob
                                            for i, t in enumerate(c.token_ids)])
                       for output in outputs for c in output.outputs]
        return completions, [list(output.prompt_token_ids) for output in outputs]
