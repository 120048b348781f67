"""The plan as text: the itemised table `grpo-train plan` prints, the verdict, and the over-budget error.

The table has one row per item and one column per instant of a step (`estimate.INSTANTS`); the instant whose total
is largest is the peak, marked with `*`. A dash: the item holds nothing then, or that instant does not occur in
this run (no scoring forward with beta 0 on-policy).
"""

from __future__ import annotations

from grpo_trainer.planning.estimate import INSTANTS, MemoryPlan
from grpo_trainer.planning.fit import Fit
from grpo_trainer.planning.longest import Longest
from grpo_trainer.planning.settings import DeviceMemory

__all__ = ["fit_advice", "format_longest", "format_plan", "over_budget_message", "verdict"]

_NAME_WIDTH, _COLUMN_WIDTH = 34, 10
_HEADERS = ("rollout", "scoring", "loss fwd", "bwd start", "bwd end", "opt step")


def _size(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def _cell(size: int, occurs: bool) -> str:
    return "-" if not occurs or size == 0 else f"{size / 2**30:.2f}"


def format_plan(plan: MemoryPlan, device: DeviceMemory | None = None, title: str = "") -> str:
    """The itemised table (GiB), the totals per instant, the notes and (with `device`) the verdict."""
    s, m = plan.settings, plan.shape
    peak = INSTANTS.index(plan.peak_instant)
    lines = [title] if title else []
    lines.append(f"{m.model_type}: {m.parameters / 1e6:.1f}M parameters"
                 + (f" + {m.adapter_parameters / 1e6:.2f}M adapter" if m.adapter_parameters else "")
                 + f", {m.layers} layers, hidden {m.hidden}, vocabulary {m.vocab}")
    lines.append(f"on {s.device}, {s.processes} process(es)" + (f", ZeRO-{s.zero_stage}" if s.zero_stage else "")
                 + (", FSDP" if s.fsdp else "") + f"; micro-batch {s.micro_batch} rows x {s.accumulation_steps} "
                 f"accumulation step(s), {s.round_rows} rows per round (G={s.num_generations}); prompt "
                 f"{s.prompt_length} + completion {s.completion_length} tokens; weights {s.weight_dtype}"
                 + (f", autocast {s.mixed_precision}" if s.mixed_precision else "")
                 + f", checkpointing {'on' if s.checkpointing else 'off'}; rollout: {s.rollout.describe()}"
                 + (f"; {s.rounds.ahead} round(s) sampled ahead" if s.rounds.ahead else "")
                 + (f"; packed ({'varlen attention' if s.varlen_attention else 'dense masks'})" if s.packs else "")
                 + (f"; up to {s.resample_rounds} resampled round(s)" if s.resample_rounds else ""))
    header = "".join(f"{h + ('*' if k == peak else ''):>{_COLUMN_WIDTH}}" for k, h in enumerate(_HEADERS))
    lines.append(f"{'GiB':<{_NAME_WIDTH}}{header}  note")
    for item in plan.items:
        cells = "".join(f"{_cell(b, plan.occurs[k]):>{_COLUMN_WIDTH}}" for k, b in enumerate(item.bytes))
        name = item.name + (" [host]" if item.host and s.device != "cpu" else "")
        lines.append(f"{name[:_NAME_WIDTH - 1]:<{_NAME_WIDTH}}{cells}  {item.note}")
    gpu = s.device != "cpu"
    totals = plan.totals(host=False if gpu else None)
    label = "total on the GPU (allocated)" if gpu else "total (resident memory)"
    lines.append(f"{label:<{_NAME_WIDTH}}" + "".join(f"{_cell(t, plan.occurs[k]):>{_COLUMN_WIDTH}}"
                                                      for k, t in enumerate(totals)))
    if gpu:
        lines.append(f"peak: {_size(plan.peak_bytes)} allocated, {_size(plan.reserved_bytes)} reserved, "
                     f"{_size(plan.device_bytes)} with the CUDA context, at {plan.peak_instant}; host memory "
                     f"{_size(plan.host_bytes)}")
    else:
        lines.append(f"peak: {_size(plan.peak_bytes)} resident at {plan.peak_instant}")
    lines += [f"note: {note}" for note in plan.notes]
    if device is not None:
        lines.append(verdict(plan, device))
    return "\n".join(lines)


def verdict(plan: MemoryPlan, device: DeviceMemory) -> str:
    """One line: fits or not, with the device's figure and where it comes from."""
    need, have = plan.device_bytes, device.total_bytes
    state = "fits" if need <= have else "DOES NOT FIT"
    return f"verdict: {state}: needs {_size(need)} of {_size(have)} ({device.source}), {need / max(have, 1):.0%}"


def fit_advice(plan: MemoryPlan, device: DeviceMemory, fits: list[Fit], global_batch: int) -> str:
    """Why the plan does not fit (its largest items at the peak) and the settings that do."""
    peak = INSTANTS.index(plan.peak_instant)
    largest = sorted(plan.items, key=lambda i: -i.bytes[peak])[:5]
    lines = [f"This run needs about {_size(plan.device_bytes)} per process and {device.device} has "
             f"{_size(device.total_bytes)} ({device.source}): it would run out of memory. Predicted peak at the "
             f"{plan.peak_instant}, largest items: " + ", ".join(f"{i.name} {_size(i.bytes[peak])}" for i in largest)
             + "."]
    same = [f for f in fits if f.same_objective]
    if same:
        lines.append(f"Settings that fit with the same global batch ({global_batch} completions per optimizer step) "
                     "and algorithm:")
        lines += [f"  {f.describe()}  ({_size(f.plan.device_bytes)})" for f in same]
        lines.append("auto_find_batch_size=True applies the first of these.")
    else:
        lines.append("No smaller micro-batch, activation checkpointing or vLLM memory fraction fits with the same "
                     "objective.")
    lines += [f"Also fits, training a LoRA adapter instead of every weight: {f.describe()} "
              f"({_size(f.plan.device_bytes)}; e.g. --use_peft --lora_r 16)" for f in fits if not f.same_objective]
    lines.append("Other ways: more processes with DeepSpeed ZeRO-3 or FSDP (docs/DISTRIBUTED.md), a shorter "
                 "max_completion_length, an 8-bit optimizer (optim='adamw_8bit'). memory_check='warn' trains anyway "
                 "(docs/MEMORY.md); `grpo-train plan` with the same arguments prints this plan.")
    return "\n".join(lines)


def over_budget_message(plan: MemoryPlan, device: DeviceMemory, fits: list[Fit], global_batch: int) -> str:
    """The error a run gets before its weights are loaded when its plan exceeds the device: the advice, then the
    itemised table."""
    return fit_advice(plan, device, fits, global_batch) + "\n" + format_plan(plan, device)


def _tokens(longest: Longest) -> str:
    return ("at least " if longest.at_least else "") + f"{longest.completion_length:,} tokens"


def format_longest(longest: Longest, longer: list[Longest], device: DeviceMemory, asked: int, prompt_length: int,
                   context: int | None = None) -> str:
    """How long a completion fits (`planning.longest`): the longest `max_completion_length` with these settings,
    the settings that reach longer, and the model's context where the answer passes it."""
    if longest.completion_length == 0:
        lines = [f"Longest max_completion_length that fits {_size(device.total_bytes)}: none (not one completion "
                 f"token with a prompt of {prompt_length} tokens)."]
    else:
        lines = [f"Longest max_completion_length that fits {_size(device.total_bytes)}: {_tokens(longest)} (prompt "
                 f"{prompt_length} tokens; this run asks {asked:,}; plan {_size(longest.plan.device_bytes)})."]
    if longer:
        lines.append("Longer with:")
        for f in longer:
            what = "same objective" if f.same_objective else \
                "LoRA r 16 on every linear layer: trains an adapter, not every weight"
            lines.append(f"  {f.describe()}: {_tokens(f)} ({what})")
    if context is not None and max([longest, *longer], key=lambda f: f.completion_length).completion_length \
            > context - prompt_length:
        lines.append(f"The model's context is {context:,} positions: at most {max(0, context - prompt_length):,} "
                     "completion tokens after this prompt, whatever the memory.")
    return "\n".join(lines)
