"""The one table of this project's optional paths and memory levers: which `GRPOConfig` field turns each on, its
default, where it has run, and what the planner may try with it. The defaults (`config.settings`), the planner's
fits (`planning.fit`, `auto_find_batch_size`) and longest-completion levers (`planning.longest`), the config's help
texts and the docs (docs/MEMORY.md, ARCHITECTURE.md) read it.

Decisions:

1. The rule: on CUDA (any device but the CPU) a path of this project is on by default, or proposed by the planner,
   only where a committed raw result under `benchmarks/results/` shows it ran on a GPU at its current code. "Its
   current code" is checked, not trusted: an option's `Evidence` records the sha256 of each source file that owns
   it at the measured commit, and `ran_on_gpu` compares them with the files this process imported. An edit to any
   of them holds the path back on CUDA again until a GPU session measures it (`benchmarks/gpu/session.sh` writes the
   fingerprints beside its results: `python -m grpo_trainer.planning.levers`). tests/planning/test_levers.py checks
   that every recorded raw file exists and what the CUDA defaults resolve to.
2. Held back means: its field's `None` / `'auto'` default resolves to the option's `off` value there (the CPU
   default is unchanged), its help text says it has not run on a GPU, the planner does not propose it, and the
   trainer logs once which defaults were held back and why (`held_back_note`). A user may still opt in by setting
   the field.
3. A lever the planner proposes under a launch (DDP, ZeRO-2/3, FSDP2) needs a launched CPU test under that launch
   (`Option.launched`; tests/planning/test_levers.py finds each in tests/distributed/conftest.py's modes). On one
   process no launch is needed.
4. Standard paths of transformers and the Trainer (activation checkpointing, smaller micro-batches with more
   accumulation, a lower vLLM memory fraction) and the smaller LM-head chunk of the head every run uses are
   proposed everywhere: they are not optional code of this project (`Lever.option` None). Nor is bookkeeping over
   values the step already computed, whatever its device (the health checks, `diagnosis`): it changes no tensor
   of the step and allocates none of a tensor's size.
5. Levers combine: a fit is one pull of any subset of levers (`planning.fit`, cost: the product of the pulls'
   costs), a longer completion the strongest pull of each alone and of all together (`planning.longest`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_trainer.planning.settings import PlanSettings

__all__ = ["LAUNCHES", "LEVERS", "LONGER_CHUNK_SIZE", "LONGER_MLP_TILE", "OPTIONS", "Evidence", "Lever", "Option",
           "FIELDS", "allowed", "apply", "config_changes", "fingerprint", "fit_levers_text", "held_back",
           "held_back_note", "help_note", "launch_of", "longer_levers_text", "resolve", "value_of"]

PACKAGE = Path(__file__).resolve().parents[1]  # grpo_trainer/: `Option.sources` are relative to it
LAUNCHES = ("ddp", "zero2", "zero3", "fsdp2")  # the multi-process launches a launched CPU test can run
LONGER_CHUNK_SIZE = 64  # the smaller LM-head chunk tried: 64 x 151,936 float32 logits are 37 MiB
LONGER_MLP_TILE = 1024  # the sequence-tiled MLP's tile tried: 1,024 x 3 x 4,864 float32 is 57 MiB


@dataclass(frozen=True)
class Evidence:
    """A committed raw result showing an option ran on a GPU (decision 1)."""

    raw: tuple[str, ...]  # files under benchmarks/results/, from the repository's root
    commit: str
    date: str
    sources: tuple[tuple[str, str], ...]  # (path under grpo_trainer/, its sha256 at `commit`)


@dataclass(frozen=True)
class Option:
    """An optional path of this project, behind one `GRPOConfig` field."""

    field: str
    summary: str  # what it does, in a few words (the held-back note, docs)
    sources: tuple[str, ...]  # the files under grpo_trainer/ whose text is its code (decision 1)
    on: Any  # its value on (what a default on resolves to; the value a lever tries)
    off: Any  # its value off (what a default held back resolves to)
    default_on: bool  # on by default where it has run (decision 2)
    evidence: Evidence | None = None  # its GPU run at its current code, where there is one
    launched: tuple[str, ...] = ()  # the launches a launched CPU test trains it under (decision 3)

    def ran_on_gpu(self) -> bool:
        """Decision 1: evidence recorded, for exactly these sources, and none of them changed since."""
        if self.evidence is None or {path for path, _ in self.evidence.sources} != set(self.sources):
            return False
        return all(fingerprint(path) == digest for path, digest in self.evidence.sources)


_PLANNER = ("planning/estimate.py", "planning/optimizers.py", "planning/shape.py", "planning/settings.py",
            "planning/device.py", "planning/static_decode.py", "trainer/memory.py")

# Field -> option. No entry has evidence yet: every GPU result under benchmarks/results/ (2026-11-25 H100,
# 2026-11-26 H200) predates the current text of these files (the packing self-check's slice, the tiled MLP, the
# recomputed attention, the tied lookup, the planner's rework all landed on 2026-11-27 or later).
OPTIONS: dict[str, Option] = {option.field: option for option in (
    Option("padding_free", "packed log-prob forwards", ("modeling/forwards.py", "modeling/packing.py"),
           on=True, off=False, default_on=True),
    Option("tied_embedding_lookup", "a tied embedding's lookup adds its rows into the LM head's gradient",
           ("modeling/tied_embedding.py",), on=True, off=False, default_on=True),
    Option("memory_check", "the memory plan's verdict stops a run that would not fit ('error')", _PLANNER,
           on="error", off="warn", default_on=True),
    Option("mlp_tile_tokens", "the sequence-tiled MLP and norms", ("modeling/tiling.py",),
           on=LONGER_MLP_TILE, off=0, default_on=False, launched=LAUNCHES),
    Option("recompute_attention", "each attention block under its own checkpoint, a row at a time",
           ("modeling/tiling.py",), on=True, off=False, default_on=False, launched=LAUNCHES),
    Option("speculative_rollouts", "rollout drafts verified by the fast decoder",
           ("rollout/speculative/loop.py", "rollout/speculative/drafts.py", "rollout/speculative/policy.py",
            "rollout/speculative/verify.py", "rollout/fast/decoder.py"), on=True, off=False, default_on=False),
    Option("partial_rollouts", "rounds that end once enough groups complete, the rest parked",
           ("rollout/partial/parking.py", "rollout/fast/loop.py", "trainer/off_policy.py"), on=0.5, off=0.0,
           default_on=False),
    Option("activation_offloading", "the step's saved tensors in host memory (TRL's manager)",
           ("modeling/recompute.py", "trainer/parts.py"), on=True, off=False, default_on=False),
)}


@functools.cache
def fingerprint(path: str) -> str:
    """sha256 of a file under grpo_trainer/ as this process sees it (read once)."""
    return hashlib.sha256((PACKAGE / path).read_bytes()).hexdigest()


def _gated(device: str) -> bool:
    return device != "cpu"


def resolve(field: str, value: Any, device: str) -> Any:
    """`value` of `field` as the run uses it on `device`: a `None` / `'auto'` default resolves to the option's `on`
    where it is on by default and has run there (decision 2), else to its `off`; a value set is kept."""
    if value is not None and value != "auto":
        return value
    option = OPTIONS[field]
    on = option.default_on and (not _gated(device) or option.ran_on_gpu())
    return option.on if on else option.off


def held_back(device: str) -> list[Option]:
    """The options decision 2 holds back on `device`: defaults resolved off there, or levers not proposed."""
    return [o for o in OPTIONS.values() if _gated(device) and not o.ran_on_gpu()]


def held_back_note(device: str) -> str | None:
    """The one log line of decision 2 (None: nothing held back on `device`)."""
    options = held_back(device)
    if not options:
        return None
    defaults = [f"{o.field} ({o.summary}: {o.off!r} unless set)" for o in options if o.default_on]
    levers = [o.field for o in options if not o.default_on]
    parts = [f"defaults held back: {'; '.join(defaults)}"] if defaults else []
    parts += [f"not proposed by the memory planner: {', '.join(levers)}"] if levers else []
    return (f"On {device}, {'. '.join(parts)}. None of these has run on a GPU at its current code (a committed raw "
            "result: grpo_trainer/planning/levers.py); set a field to opt in.")


def help_note(field: str) -> str:
    """The sentence a held-back option's help text ends with (decision 2)."""
    option = OPTIONS[field]
    if option.ran_on_gpu():
        return f" Ran on a GPU at its current code ({option.evidence.date}, {option.evidence.commit})."
    what = "on by default on CPU only; opt-in" if option.default_on else "not proposed by the memory planner"
    return f" Not yet run on a GPU at its current code: {what} on CUDA (planning/levers.py)."


def launch_of(settings: PlanSettings) -> str | None:
    """The launch a run's processes train under (None: one plain process; decision 3)."""
    if settings.fsdp:
        return "fsdp2"
    if settings.zero_stage:
        return f"zero{settings.zero_stage}"
    return "ddp" if settings.processes > 1 else None


# ------------------------------------------------------------------------------------------------ the levers

Pull = dict  # PlanSettings field (forward options as "forward.<name>") -> value


@dataclass(frozen=True)
class Lever:
    """A change of settings that trains the same objective with less memory (or, for LoRA, not: `planning.fit`)."""

    name: str
    label: str  # what it changes, in the config's words (help texts, error messages)
    pulls: Callable[[PlanSettings, bool], list[Pull]]  # (settings, split exact) -> its pulls, mildest first
    cost: Callable[[PlanSettings, Pull], float]  # a pull's step time relative to the settings as given
    when: str  # when it applies, in words
    option: str | None = None  # the `OPTIONS` entry whose rules it follows (decision 4: None)
    fits: bool = True  # tried by `planning.fit`
    longest: bool = True  # tried by `planning.longest` (its last pull)


def _split(settings: PlanSettings, split_exact: bool) -> list[Pull]:
    if not split_exact:
        return []
    return [{"micro_batch": settings.micro_batch // k, "accumulation_steps": settings.accumulation_steps * k,
             "steps_per_generation": settings.steps_per_generation * k}
            for k in range(2, settings.micro_batch + 1) if settings.micro_batch % k == 0]


def _lower_fractions(settings: PlanSettings, split_exact: bool) -> list[Pull]:
    """Smaller engine fractions, in steps of 0.05 down to 0.1 (an engine in the process, on a GPU only)."""
    if settings.rollout.cache != "engine" or settings.device != "cuda":
        return []
    steps = int(round(settings.vllm_memory_fraction * 20))
    return [{"vllm_memory_fraction": step / 20} for step in range(steps - 1, 1, -1)]


def _switch(name: str, value: Any, applies: Callable[[PlanSettings], bool] = lambda s: True
            ) -> Callable[[PlanSettings, bool], list[Pull]]:
    """One pull setting `name` (a PlanSettings path) to `value`, where it is not already set and `applies`."""
    def pulls(settings: PlanSettings, split_exact: bool) -> list[Pull]:
        return [{name: value}] if not value_of(settings, name) and applies(settings) else []
    return pulls


# The step-time costs only order the candidates (decision 5). Checkpointing: one more forward of every layer. The
# tiled MLP: 1.24x / 1.42x the layers' forward and backward at 2k / 4k tokens (benchmarks/RESULTS.md, "The
# sequence-tiled MLP's price"). The recomputed attention: one more attention forward per layer, where checkpointing
# runs 4 units of attention work (forward, recomputation, a backward of 2): at most +25% of the layers' time.
# Offloading: its copies run on a side stream beside the compute; not measured (no GPU yet). A split of k: k
# micro-steps for one. A lower vLLM fraction: a queued round, once.
LEVERS: tuple[Lever, ...] = (
    Lever("gradient_checkpointing", "gradient_checkpointing=True", _switch("checkpointing", True),
          lambda s, p: 1.33, "not already on"),
    Lever("split", "a smaller per_device_train_batch_size with more gradient_accumulation_steps", _split,
          lambda s, p: s.micro_batch / p["micro_batch"],
          "the loss sums its micro-batches (`fit.split_is_exact`: not bnpo, not top_entropy_quantile < 1)"),
    Lever("mlp_tile_tokens", "mlp_tile_tokens (the sequence-tiled MLP)",
          _switch("forward.mlp_tile_tokens", LONGER_MLP_TILE), lambda s, p: 1.4, "not already on",
          option="mlp_tile_tokens"),
    Lever("recompute_attention", "recompute_attention=True",
          _switch("forward.recompute_attention", True, lambda s: s.sequence_parallel == 1),
          lambda s, p: 1.25, "not with sequence parallelism", option="recompute_attention"),
    Lever("activation_offloading", "activation_offloading=True (on a GPU)",
          _switch("forward.activation_offloading", True, lambda s: s.device == "cuda"),
          lambda s, p: 1.5, "on an accelerator", option="activation_offloading"),
    Lever("vllm_gpu_memory_utilization", "a lower vllm_gpu_memory_utilization", _lower_fractions,
          lambda s, p: 1.5, "vLLM colocated on a GPU", longest=False),
    Lever("logprob_chunk_size", "a smaller logprob_chunk_size",
          lambda s, x: [{"forward.chunk_size": LONGER_CHUNK_SIZE}] if s.forward.chunk_size > LONGER_CHUNK_SIZE
          else [], lambda s, p: 1.05, f"chunks above {LONGER_CHUNK_SIZE} rows", fits=False),
)


def fit_levers_text() -> str:
    """The levers `planning.fit` tries, in the config's words (decision 5)."""
    return ", ".join(lever.label for lever in LEVERS if lever.fits)


def longer_levers_text() -> str:
    """The levers `planning.longest` tries, in the config's words, and the command that searches them."""
    return ", ".join(lever.label for lever in LEVERS if lever.longest) + \
        ", and `grpo-train plan` for the longest max_completion_length that fits"


# PlanSettings path -> the GRPOConfig field it is
FIELDS = {"micro_batch": "per_device_train_batch_size", "accumulation_steps": "gradient_accumulation_steps",
           "steps_per_generation": "steps_per_generation", "checkpointing": "gradient_checkpointing",
           "vllm_memory_fraction": "vllm_gpu_memory_utilization", "forward.mlp_tile_tokens": "mlp_tile_tokens",
           "forward.recompute_attention": "recompute_attention",
           "forward.activation_offloading": "activation_offloading", "forward.chunk_size": "logprob_chunk_size"}


def allowed(lever: Lever, settings: PlanSettings) -> bool:
    """Whether the planner may propose `lever` for `settings` (decisions 1, 3 and 4)."""
    if lever.option is None:
        return True
    option = OPTIONS[lever.option]
    if _gated(settings.device) and not option.ran_on_gpu():
        return False
    launch = launch_of(settings)
    return launch is None or launch in option.launched


def value_of(settings: PlanSettings, name: str) -> Any:
    """A PlanSettings field's value, a forward option's by "forward.<name>"."""
    owner, _, field = name.rpartition(".")
    return getattr(settings.forward if owner else settings, field)


def apply(settings: PlanSettings, pull: Pull) -> PlanSettings:
    """`settings` with `pull`'s fields set."""
    options = {k.removeprefix("forward."): v for k, v in pull.items() if k.startswith("forward.")}
    plain = {k: v for k, v in pull.items() if not k.startswith("forward.")}
    return dataclasses.replace(settings, **plain).with_forward(**options)


def config_changes(pull: Pull) -> dict:
    """The GRPOConfig fields and values of a pull."""
    return {FIELDS[name]: value for name, value in pull.items()}


def _main() -> None:
    parser = argparse.ArgumentParser(description="The options' fingerprints (decision 1): what a GPU session "
                                                 "records beside its raw results, and what each option's evidence "
                                                 "must name to count.")
    parser.parse_args()
    print(json.dumps({o.field: {"sources": {p: fingerprint(p) for p in o.sources}, "ran_on_gpu": o.ran_on_gpu()}
                      for o in OPTIONS.values()}, indent=2))


if __name__ == "__main__":
    _main()
