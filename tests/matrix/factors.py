"""The factors of the combination matrix (issue 38; issue 50 added the tiled MLP, the recomputed attention, routing
replay on a Mixture-of-Experts model, sequence parallelism and ZeRO-3), which combinations grpo_trainer refuses, and
the rows: every pair of levels that is neither refused nor unbuilt, covered pairwise by `covering.covering_rows`.

A level is a string; `cell_run.settings_of` turns a row into the run's GRPOConfig fields, `launch_of` into its launch
(`runtime.distributed.Launch`). What the package refuses is not written down here: `refusal(row)` asks the package's
own tables (`config.checks.COMBINATIONS`, `trainer.sequence_group.REFUSALS`, `trainer.producer.REFUSALS`), in the order
the package checks them, about the settings the row maps to (a field no factor varies keeps the matrix's fixed base
value), and a refusal cell's error must hold that refusal's own message. `READS` says which factors decide each name a
refusal reads (`Refusal.reads`), so that a partial row of the covering array asks only the refusals it can decide. A
refusal of the config table is raised when GRPOConfig is built (`where` "config"), the others when GRPOTrainer is
constructed, before any model loads ("trainer").

`UNBUILT` holds the matrix's own exclusions, which are not refusals: level pairs it has no run for (a Mixture-of-Experts
model with image prompts or with vLLM's CPU build), and one the package refuses only once the model has loaded
(`UlyssesGroup.check_model`, in no table). The matrix's rows hold no refused or unbuilt combination; each refusal the
factors can reach gets one cell of its own (`refusal_cells`): a row of the matrix with the refusal's levels put in,
and other levels changed where needed, so that this refusal is the only one that applies.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from types import SimpleNamespace
from typing import Any

from tests.matrix.covering import Row, covering_rows

# The constrained factors first: in this order the greedy generator needs 26 rows (16 CPU, 10 vLLM), the fewest of
# the orders of these five tried; with routing_replay and sp_size after the older factors, 32 (19 CPU, 13 vLLM).
FACTORS: dict[str, list[str]] = {
    "backend": ["fast", "generate", "vllm_colocate", "vllm_server"],
    # "dense": the dense model (routing_replay at its default 'auto', which is off for it); "on" / "off": the tiny
    # Mixture-of-Experts model (cell_run.make_tiny_moe) with routing replay on / off. ('auto' is 'on' for it wherever
    # the matrix can build a MoE row, in-process backends: the same run; tests/trainer/test_routing_replay.py checks
    # what 'auto' resolves to.)
    "routing_replay": ["dense", "on", "off"],
    "processes": ["1", "ddp", "zero2", "zero3", "fsdp2"],
    "sp_size": ["1", "2"],  # parallelism_config's sp_size: 2 shards each row's positions over the 2 processes
    "prompts": ["text", "image"],
    "zero_variance_groups": ["train", "skip", "resample"],
    "async_rollouts": ["0", "1"],
    "padding_free": ["on", "off"],
    "adapter": ["full", "lora"],
    "beta": ["0", "0.04"],
    "resume": ["none", "save"],
    "memory_check": ["error", "off"],
    "mlp_tile_tokens": ["0", "4"],  # 4: fewer tokens than any row holds (a prompt of 7+ tokens and up to 6 more)
    "recompute_attention": ["off", "on"],
    "speculative_rollouts": ["off", "on"],  # drafts verified by the fast decoder (refused with vLLM and 'generate')
}
VLLM_BACKENDS = ("vllm_colocate", "vllm_server")
SHARDED = ("zero3", "fsdp2")  # the weights sharded across processes
MOE = ("on", "off")  # the routing_replay levels that train the Mixture-of-Experts model

# Which factors decide each name a table's refusals read (`Refusal.reads`); () for a name no factor varies (its value
# is the matrix's fixed base). test_covering.py checks that every name the tables read is here, and that changing a
# factor's level changes only the names listed with that factor.
READS: dict[str, dict[str, tuple[str, ...]]] = {
    "config": {  # GRPOConfig's fields
        "zero_variance_groups": ("zero_variance_groups",), "beta": ("beta",), "entropy_coef": (),
        "use_adaptive_entropy": (), "top_entropy_quantile": (), "async_rollouts": ("async_rollouts",),
        "routing_replay": ("routing_replay",), "use_vllm": ("backend",), "use_transformers_continuous_batching": (),
        "speculative_rollouts": ("speculative_rollouts",), "generation_backend": ("backend",),
        # partial rollouts: no factor (its refusals apply to none of the matrix's rows; test_partial_rollouts.py)
        "partial_rollouts": (), "partial_rollout_stale_tokens": (), "vllm_importance_sampling_correction": (),
        "top_k": (), "top_p": (), "min_p": (), "sampling_mismatch_report": (),
    },
    "sequence": {  # ShardingSettings
        "size": ("sp_size",), "processes": ("processes",), "engine": ("processes",), "loss_type": (),
        "top_entropy_quantile": (), "padding_free": ("padding_free",), "use_vllm": ("backend",), "truncated": (),
        "routing_replay": ("routing_replay",), "async_rollouts": ("async_rollouts",), "activation_offloading": (),
        "recompute_attention": ("recompute_attention",), "multi_turn": (), "vision": ("prompts",),
    },
    "producer": {  # AsyncFacts, its SourceSettings and their Launch
        "rounds_ahead": ("async_rollouts",), "rollout_func": (), "streamed": (), "backend": ("backend",),
        "own_weights": ("backend",), "vllm_mode": ("backend",), "processes": ("processes",),
        "vllm_tensor_parallel_size": (), "sharded_weights": ("processes",), "mismatch_report": (),
    },
}


@dataclass(frozen=True)
class Table:
    name: str  # a key of READS
    where: str  # "config": raised by GRPOConfig's check; "trainer": by GRPOTrainer's construction, before the model
    refusals: tuple  # the package's table: a tuple of `config.refusals.Refusal`
    settings: Callable[[Row], Any]  # the row's settings object of that table


@dataclass(frozen=True)
class Refused:
    """A package refusal that applies to a row, with its message on the row's settings."""

    table: str
    name: str
    where: str
    message: str


@dataclass(frozen=True)
class Unbuilt:
    """A combination the matrix builds no run for (not a refusal), decided once all of `factors` are set."""

    name: str
    factors: tuple[str, ...]
    applies: Callable[[Row], bool]
    why: str


UNBUILT: tuple[Unbuilt, ...] = (
    Unbuilt("moe_images", ("routing_replay", "prompts"),
            lambda r: r["routing_replay"] in MOE and r["prompts"] == "image",
            "the Mixture-of-Experts model is a text model (no tiny vision-language MoE of a family routing replay "
            "serves)"),
    Unbuilt("moe_vllm", ("routing_replay", "backend"),
            lambda r: r["routing_replay"] == "off" and r["backend"] in VLLM_BACKENDS,
            "vLLM's CPU build reloads a MoE model's expert weights wrong, and the weight-sync check stops such a run "
            "at its first push (tests/vllm_integration/test_vllm_routing.py, docs/MOE.md); the servers serve the "
            "dense model; 'on' is refused (config.checks, routing_replay_engine)"),
    Unbuilt("moe_sequence_parallel", ("routing_replay", "sp_size"),
            lambda r: r["routing_replay"] == "off" and r["sp_size"] == "2",
            "refused by name once the model has loaded (UlyssesGroup.check_model: it needs the model to know it is "
            "one), in no table, so not before the model loads; 'on' is refused by the table (routing_replay)"),
)


def launch_of(row: Row):
    """The launch facts a row's process layout gives the trainer (`runtime.distributed.Launch`; `cell_run` records
    the trainer's own and `checks.check_trained` compares them)."""
    from grpo_trainer.runtime.distributed import Launch

    layout = row.get("processes", FACTORS["processes"][0])
    processes = 1 if layout == "1" else 2
    stage = {"zero2": 2, "zero3": 3}.get(layout, 0)
    return Launch(processes=processes, processes_per_node=processes, zero_stage=stage, deepspeed=stage > 0,
                  fsdp=layout == "fsdp2", sequence_parallel=int(row.get("sp_size", "1")))


@functools.cache
def _base_config() -> dict:
    """The fixed base: a GRPOConfig of `tests.helpers.TRAINER_DEFAULTS` (every field the factors leave alone)."""
    from tests.helpers import make_args

    return dict(vars(make_args("matrix-base-settings")))


def _full(row: Row) -> Row:
    """`row` with each unassigned factor at its first level (its names are not `known`: only their value is needed)."""
    return {name: row.get(name, levels[0]) for name, levels in FACTORS.items()}


def config_of(row: Row) -> SimpleNamespace:
    """The GRPOConfig fields of `row`'s run, over the fixed base (`cell_run.settings_of`), as the config table reads
    them (the config itself is never built: a refused row's would raise)."""
    from tests.matrix import cell_run

    return SimpleNamespace(**{**_base_config(), **cell_run.settings_of(_full(row), {})})


@functools.cache
def _processing_class(prompts: str):
    """What `cell_run.build` passes as processing_class, for what the tables read of it (a processor or not)."""
    if prompts == "image":
        from tests.matrix.cell_run import VLM_FAMILY
        from tests.toy_vlm import VLM_FAMILIES

        return VLM_FAMILIES[VLM_FAMILY]()[1]
    from grpo_trainer.cli.toy import make_tokenizer

    return make_tokenizer()


def _sharding(row: Row):
    from grpo_trainer.trainer import parts

    full = _full(row)
    return parts.sharding_settings(config_of(row), launch_of(full), _processing_class(full["prompts"]),
                                   multi_turn=False)


def _async_facts(row: Row):
    """`AsyncRounds.check`'s facts: the matrix trains a map-style dataset without a rollout_func."""
    from grpo_trainer.config import settings as typed
    from grpo_trainer.rollout.backend import chosen
    from grpo_trainer.trainer import parts
    from grpo_trainer.trainer.producer import AsyncFacts

    args = config_of(row)
    backend = chosen(typed.backend_choice(args))
    return AsyncFacts(parts.source_settings(args, launch_of(_full(row))), backend.name,
                      backend.capabilities.own_weights, streamed=False, rollout_func=False)


@functools.cache
def tables() -> tuple[Table, ...]:
    """The package's refusal tables in the order it checks them: GRPOConfig's (`check_config`), then in
    GRPOTrainer.__init__ the sequence-parallel group's (`self.sequence.check`) before the round source's
    (`source_type.check`)."""
    from grpo_trainer.config.checks import COMBINATIONS
    from grpo_trainer.trainer import producer, sequence_group

    return (Table("config", "config", COMBINATIONS, config_of),
            Table("sequence", "trainer", sequence_group.REFUSALS, _sharding),
            Table("producer", "trainer", producer.REFUSALS, _async_facts))


def _decided(table: str, row: Row) -> Callable[[str], bool]:
    """Whether `row` sets every factor that decides a read name of `table`."""
    def decided(name: str) -> bool:
        if name not in READS[table]:
            raise KeyError(f"a {table} refusal reads {name!r}: say in tests/matrix/factors.py READS which factors "
                           "decide it (() for none)")
        return all(factor in row for factor in READS[table][name])

    return decided


def applicable(row: Row) -> list[Refused]:
    """Every package refusal that applies to (partial) `row` among those it decides, in the package's order."""
    out = []
    for table in tables():
        decided, settings = _decided(table.name, row), table.settings(row)
        out += [Refused(table.name, rule.name, table.where, rule.message(settings)) for rule in table.refusals
                if all(map(decided, rule.reads)) and rule.applies(settings)]
    return out


def refusal(row: Row) -> Refused | None:
    """The refusal the package raises for `row` (None: it must train): the first table's first that applies
    (`config.refusals.first`); on a partial row, among those whose read factors are all set (its `known`)."""
    from grpo_trainer.config.refusals import first

    for table in tables():
        settings = table.settings(row)
        found = first(table.refusals, settings, known=_decided(table.name, row))
        if found is not None:
            return Refused(table.name, found.name, table.where, found.message(settings))
    return None


def unbuilt(row: Row) -> Unbuilt | None:
    return next((u for u in UNBUILT if all(f in row for f in u.factors) and u.applies(row)), None)


def allowed(row: Row) -> bool:
    """The covering array's rule: nothing refused, nothing unbuilt (each decided by a partial row once its factors
    are all set)."""
    return unbuilt(row) is None and refusal(row) is None


@functools.cache
def _rows() -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple(tuple(row.items()) for row in covering_rows(FACTORS, allowed))


def rows() -> list[Row]:
    """The matrix: every pair of levels neither refused nor unbuilt together, each in some row."""
    return [dict(row) for row in _rows()]


def reads_factors(table: str, rule) -> tuple[str, ...]:
    """The factors that decide `rule` (a refusal of `table`), in factor order."""
    decide = {factor for name in rule.reads for factor in READS[table][name]}
    return tuple(name for name in FACTORS if name in decide)


def _alone(table: str, rule, base: Row) -> Row | None:
    """A full row where `rule` is the only refusal that applies (and nothing is unbuilt): the rule's factors at the
    first levels that make it apply, every other factor at `base`'s level where it can be, else at the first level
    that keeps every other refusal out (depth first, in factor order)."""
    own = reads_factors(table, rule)
    names = list(FACTORS)

    def fits(row: Row) -> bool:
        return unbuilt(row) is None and all((r.table, r.name) == (table, rule.name) for r in applicable(row))

    def fill(row: Row) -> Row | None:
        todo = [n for n in names if n not in row]
        if not todo:
            found = refusal(row)
            return row if found is not None and (found.table, found.name) == (table, rule.name) else None
        levels = sorted(FACTORS[todo[0]], key=lambda level: level != base[todo[0]])
        for level in levels:
            candidate = {**row, todo[0]: level}
            if fits(candidate):
                done = fill(candidate)
                if done is not None:
                    return {n: done[n] for n in names}
        return None

    for levels in itertools.product(*(FACTORS[n] for n in own)):
        start = dict(zip(own, levels))
        settings = next(t for t in tables() if t.name == table).settings(start)
        if rule.applies(settings):
            found = fill(start)
            if found is not None:
                return found
    return None


@functools.cache
def _refusal_cells() -> tuple[tuple[str, str, tuple[tuple[str, str], ...] | None], ...]:
    """(table, refusal name, its cell or None where no row of the factors reaches it), for every package refusal:
    a CPU row of the matrix as the base where one serves, else a vLLM row."""
    matrix = sorted(rows(), key=uses_vllm)
    out = []
    for table in tables():
        for rule in table.refusals:
            cell = next((c for c in (_alone(table.name, rule, base) for base in matrix) if c is not None), None)
            out.append((table.name, rule.name, None if cell is None else tuple(cell.items())))
    return tuple(out)


def refusal_cells() -> list[Row]:
    """One row per package refusal the factors reach (`_refusal_cells`), in the tables' order."""
    return [dict(cell) for _, _, cell in _refusal_cells() if cell is not None]


def unreached() -> set[tuple[str, str]]:
    """The package refusals no row of the factors reaches: (table, name), each reading a setting the matrix holds
    fixed (`READS`: ())."""
    return {(table, name) for table, name, cell in _refusal_cells() if cell is None}


def value(settings: Any, name: str) -> Any:
    """The value a refusal reads as `name` from a table's settings object: the attribute, else that of a dataclass
    it holds (AsyncFacts' SourceSettings and its Launch; for test_covering's dependence check)."""
    if hasattr(settings, name):
        return getattr(settings, name)
    for field in fields(settings) if is_dataclass(settings) else ():
        inner = getattr(settings, field.name)
        if is_dataclass(inner):
            found = value(inner, name)
            if found is not _MISSING:
                return found
    return _MISSING


_MISSING = object()


def uses_vllm(row: Row) -> bool:
    return row["backend"] in VLLM_BACKENDS


def name(row: Row) -> str:
    """A cell's test id: its levels, in factor order."""
    return "-".join(f"{SHORT[k]}={v}" for k, v in row.items())


SHORT = {"backend": "gen", "processes": "proc", "zero_variance_groups": "zvg", "async_rollouts": "async",
         "padding_free": "packed", "adapter": "adapter", "beta": "beta", "resume": "resume", "prompts": "prompts",
         "memory_check": "memcheck", "mlp_tile_tokens": "tile", "recompute_attention": "recompute",
         "routing_replay": "replay", "sp_size": "sp", "speculative_rollouts": "spec"}
