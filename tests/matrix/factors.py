"""The factors of the combination matrix (issue 38), the combinations grpo_trainer refuses by name, and the rows:
every pair of levels that is not refused, covered pairwise by `covering.covering_rows`.

A level is a string; `cell_run.config_of` turns a row into the run's settings. A refusal names the levels that
together break one of grpo_trainer's rules, where that rule lives (`config`: GRPOConfig's own check, raised when the
config is built; `trainer`: the trainer's construction, before any model loads), and the text the error must hold:
both settings by name and what to use instead. The matrix's rows never hold a refused combination; each refusal
gets one cell of its own (`refusal_cells`), the first row with the refused levels put in.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.matrix.covering import Row, covering_rows

FACTORS: dict[str, list[str]] = {
    "backend": ["fast", "generate", "vllm_colocate", "vllm_server"],
    "processes": ["1", "ddp", "zero2", "fsdp2"],
    "zero_variance_groups": ["train", "skip", "resample"],
    "async_rollouts": ["0", "1"],
    "padding_free": ["on", "off"],
    "adapter": ["full", "lora"],
    "beta": ["0", "0.04"],
    "resume": ["none", "save"],
    "prompts": ["text", "image"],
    "memory_check": ["error", "off"],
}
VLLM_BACKENDS = ("vllm_colocate", "vllm_server")
SHARDED = ("fsdp2",)  # weights sharded across processes (ZeRO-3 would be too; the matrix's ZeRO level is 2)
MULTI = ("ddp", "zero2", "fsdp2")


@dataclass(frozen=True)
class Refusal:
    levels: tuple[tuple[str, tuple[str, ...]], ...]  # (factor, the levels of it that take part)
    where: str  # "config" (GRPOConfig's check) or "trainer" (GRPOTrainer's construction, before the model loads)
    message: str  # a regular expression the error must match: both settings named, and what to use instead

    def applies(self, row: Row) -> bool:
        """True when every factor of the rule is in `row` with one of its levels (a partial row: not yet)."""
        return all(row.get(name) in levels for name, levels in self.levels)


REFUSALS: tuple[Refusal, ...] = (
    Refusal((("zero_variance_groups", ("resample",)), ("async_rollouts", ("1",))), "config",
            r"zero_variance_groups='resample'.*async_rollouts=1.*use async_rollouts=0, or zero_variance_groups="),
    Refusal((("zero_variance_groups", ("skip",)), ("beta", ("0.04",))), "config",
            r"zero_variance_groups='skip'.*beta=0.04.*use 'train'"),
    Refusal((("async_rollouts", ("1",)), ("backend", ("fast", "generate")), ("processes", SHARDED)), "trainer",
            r"async_rollouts=1 is not supported here: an in-process backend .* shards .* use a vLLM server"),
    Refusal((("async_rollouts", ("1",)), ("backend", ("vllm_server",)), ("processes", MULTI)), "trainer",
            r"async_rollouts=1 is not supported here: with several training processes .* use vllm_mode='colocate'"),
)


def refusal(row: Row) -> Refusal | None:
    """The rule `row` breaks (None: it must train)."""
    return next((rule for rule in REFUSALS if rule.applies(row)), None)


def rows() -> list[Row]:
    """The matrix: every pair of levels not refused together, each in some row."""
    return covering_rows(FACTORS, lambda row: refusal(row) is None)


def refusal_cells() -> list[Row]:
    """One row per refusal: the first matrix row (of the rule's stage) with the rule's first levels put in."""
    out = []
    for rule in REFUSALS:
        vllm = any(name == "backend" and set(levels) <= set(VLLM_BACKENDS) for name, levels in rule.levels)
        base = next(r for r in rows() if (r["backend"] in VLLM_BACKENDS) == vllm)
        cell = {**base, **{name: levels[0] for name, levels in rule.levels}}
        if refusal(cell) is not rule:  # the base row's other levels break an earlier rule: take them out
            own = dict(rule.levels)
            cell.update({k: v for k, v in (("zero_variance_groups", "train"), ("beta", "0")) if k not in own})
        out.append(cell)
    return out


def uses_vllm(row: Row) -> bool:
    return row["backend"] in VLLM_BACKENDS


def name(row: Row) -> str:
    """A cell's test id: its levels, in factor order."""
    return "-".join(f"{SHORT[k]}={v}" for k, v in row.items())


SHORT = {"backend": "gen", "processes": "proc", "zero_variance_groups": "zvg", "async_rollouts": "async",
         "padding_free": "packed", "adapter": "adapter", "beta": "beta", "resume": "resume", "prompts": "prompts",
         "memory_check": "memcheck"}
