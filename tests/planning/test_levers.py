"""The one table of optional paths and levers (`planning.levers`): the rule that on CUDA nothing is on by default, or
proposed by the planner, unless it ran on a GPU at its current code; the launches a lever is proposed under; the
defaults, the help texts and the note that read it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from grpo_trainer import GRPOConfig
from grpo_trainer.config import settings as typed
from grpo_trainer.planning import DeviceMemory, fitting, levers, longer_settings
from grpo_trainer.trainer import setup
from tests.distributed.conftest import EXTRA_MODES, MODES
from tests.planning.gpu_evidence import ran_on_gpu_now
from tests.planning.shapes import SETTINGS, SHAPE

ROOT = Path(__file__).resolve().parents[2]
# the held-back options' fields: what a lever of the planner changes
LEVER_FIELDS = {"mlp_tile_tokens", "recompute_attention", "activation_offloading"}


def _args(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


def test_every_option_names_files_that_exist_and_its_evidence_is_committed():
    for option in levers.OPTIONS.values():
        assert option.sources and all((levers.PACKAGE / path).is_file() for path in option.sources), option.field
        assert "planning/levers.py" not in option.sources  # its own evidence would change its fingerprint
        if option.evidence is not None:
            assert all((ROOT / raw).is_file() for raw in option.evidence.raw), option.evidence.raw
            assert all(raw.startswith("benchmarks/results/") for raw in option.evidence.raw)


def test_evidence_counts_only_at_the_current_code(monkeypatch):
    """An option with evidence at today's fingerprints has run on a GPU; once one of its files changes (a stale
    fingerprint) or the evidence names other files, it has not."""
    option = ran_on_gpu_now(levers.OPTIONS["tied_embedding_lookup"])
    assert option.ran_on_gpu()
    (path, _), = option.evidence.sources
    stale = dataclasses.replace(option.evidence, sources=((path, "0" * 64),))
    assert not dataclasses.replace(option, evidence=stale).ran_on_gpu()
    other = dataclasses.replace(option.evidence, sources=(("modeling/tiling.py", levers.fingerprint(
        "modeling/tiling.py")),))
    assert not dataclasses.replace(option, evidence=other).ran_on_gpu()
    assert not dataclasses.replace(option, evidence=None).ran_on_gpu()


def test_the_resolved_defaults_on_cuda_hold_back_what_has_not_run_there(tmp_path):
    """The acceptance check: for `device='cuda'` settings no unmeasured path is on by default; on CPU the defaults
    are as before; a value set by the user is kept on either device."""
    args = _args(tmp_path)
    cpu, cuda = typed.forward_settings(args, "cpu"), typed.forward_settings(args, "cuda")
    assert (cpu.padding_free, cpu.tied_lookup, typed.memory_verdict(args, "cpu")) == (True, True, "error")
    assert (cuda.padding_free, cuda.tied_lookup, typed.memory_verdict(args, "cuda")) == (False, False, "warn")
    assert (cuda.mlp_tile_tokens, cuda.recompute_attention, cuda.activation_offloading) == (0, False, False)
    assert all(not o.ran_on_gpu() for o in levers.held_back("cuda")) and levers.held_back("cpu") == []
    chosen = _args(tmp_path, padding_free=True, tied_embedding_lookup=True, memory_check="error")
    assert typed.forward_settings(chosen, "cuda").padding_free and typed.forward_settings(chosen, "cuda").tied_lookup
    assert typed.memory_verdict(chosen, "cuda") == "error"
    off = _args(tmp_path, padding_free=False, tied_embedding_lookup=False)
    assert not typed.forward_settings(off, "cpu").padding_free and not typed.forward_settings(off, "cpu").tied_lookup


def test_a_default_with_gpu_evidence_is_on_on_cuda(tmp_path, monkeypatch):
    tied = levers.OPTIONS["tied_embedding_lookup"]
    monkeypatch.setitem(levers.OPTIONS, "tied_embedding_lookup", ran_on_gpu_now(tied))
    cuda = typed.forward_settings(_args(tmp_path), "cuda")
    assert cuda.tied_lookup and not cuda.padding_free  # packing still held back


def _cuda(**fields):
    return dataclasses.replace(SETTINGS, device="cuda", checkpointing=False, completion_length=4_000, **fields)


def test_the_planner_proposes_no_held_back_lever_on_cuda(monkeypatch):
    """With room for nothing but everything, fits and longer settings on CUDA never pull the tiled MLP, the
    recomputed attention or offloading; once each has GPU evidence at its current code, they do."""
    budget = DeviceMemory("cuda", 1 << 50, "test")
    everything = fitting(_cuda(), SHAPE, budget, split_exact=True, limit=1000)
    assert everything and not any(LEVER_FIELDS & set(f.changes) for f in everything)
    assert not any(LEVER_FIELDS & set(f.changes) for f in longer_settings(_cuda(), SHAPE, DeviceMemory(
        "cuda", 64 << 20, "test"), split_exact=True))
    for field in LEVER_FIELDS:
        monkeypatch.setitem(levers.OPTIONS, field, ran_on_gpu_now(levers.OPTIONS[field]))
    proposed = {name for f in fitting(_cuda(), SHAPE, budget, split_exact=True, limit=1000) for name in f.changes}
    assert LEVER_FIELDS <= proposed


def test_on_cpu_a_lever_is_proposed_only_under_the_launches_a_launched_test_trains_it_under():
    """One process: every lever; a launch: only where `Option.launched` names it."""
    budget = DeviceMemory("cpu", 1 << 50, "test")

    def proposed(**launch):
        settings = dataclasses.replace(SETTINGS, micro_batch=1, completion_length=4_000, **launch)
        return {name for f in fitting(settings, SHAPE, budget, split_exact=True, limit=1000) for name in f.changes}

    assert {"mlp_tile_tokens", "recompute_attention"} <= proposed()
    launches = {"ddp": {"processes": 2}, "zero2": {"processes": 2, "zero_stage": 2},
                "zero3": {"processes": 2, "zero_stage": 3}, "fsdp2": {"processes": 2, "fsdp": True}}
    assert set(launches) == set(levers.LAUNCHES)
    for launch, fields in launches.items():
        found = proposed(**fields)
        for field in ("mlp_tile_tokens", "recompute_attention"):
            assert (field in found) == (launch in levers.OPTIONS[field].launched), (launch, field)


# The harness flag a launched mode turns each lever on with (tests/distributed/harness.py), and the launch each
# accelerate config is.
HARNESS_FLAGS = {"mlp_tile_tokens": "--mlp-tile-tokens", "recompute_attention": "--recompute-attention"}
CONFIG_LAUNCH = {"ddp.yaml": "ddp", "deepspeed_zero2.yaml": "zero2", "deepspeed_zero3.yaml": "zero3",
                 "fsdp2.yaml": "fsdp2"}


def test_each_launch_a_lever_is_proposed_under_has_a_launched_mode_that_trains_it():
    modes = {**MODES, **EXTRA_MODES}
    for field, flag in HARNESS_FLAGS.items():
        launched = {CONFIG_LAUNCH.get(mode.config) for mode in modes.values() if flag in mode.args}
        assert set(levers.OPTIONS[field].launched) <= launched, (field, launched)
    assert levers.OPTIONS["activation_offloading"].launched == ()  # refused on CPU: no launched CPU test can run it


def test_the_help_texts_say_what_has_not_run_on_a_gpu():
    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig)}
    for option in levers.OPTIONS.values():
        assert "Not yet run on a GPU at its current code" in fields[option.field], option.field


def test_the_run_log_names_the_held_back_defaults_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(setup, "device_of", lambda args: "cuda")
    monkeypatch.setattr(setup, "_NOTED", set())
    args = _args(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        setup.note_held_back(args)
        setup.note_held_back(args)
    notes = [r.getMessage() for r in caplog.records if "held back" in r.getMessage()]
    assert len(notes) == 1
    for option in levers.OPTIONS.values():
        assert option.field in notes[0]
    monkeypatch.setattr(setup, "device_of", lambda args: "cpu")
    caplog.clear()
    setup.note_held_back(args)
    assert not caplog.records


def test_the_fingerprint_command_prints_every_option(capsys):
    import json
    import sys

    monkeypatched = sys.argv
    sys.argv = ["levers"]
    try:
        levers._main()
    finally:
        sys.argv = monkeypatched
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == set(levers.OPTIONS)
    assert printed["tied_embedding_lookup"]["sources"]["modeling/tied_embedding.py"] == levers.fingerprint(
        "modeling/tied_embedding.py")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_lever_texts_come_from_the_table(device):
    from grpo_trainer.config.checks import LONG_COMPLETION_LEVERS

    assert all(lever.label in LONG_COMPLETION_LEVERS for lever in levers.LEVERS if lever.longest)
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig)}["memory_check"]
    assert all(lever.label in help_text for lever in levers.LEVERS if lever.fits)


def test_the_planner_and_the_scorer_hold_the_runtimes_one_forward_options_object(tmp_path, tokenizer, toy_dataset,
                                                                                  monkeypatch):
    """`config.settings.forward_settings` builds the training forward's options once per use; the trainer's scorer
    and the memory plan both take theirs from it (a marker object returned by it reaches both)."""
    from grpo_trainer.modeling.forwards import ForwardSettings
    from grpo_trainer.trainer import memory
    from tests.helpers import make_trainer

    built = []
    original = typed.forward_settings

    def recording(args, device=None):
        options = dataclasses.replace(original(args, device), chunk_size=777)  # a value no default has
        built.append(options)
        return options

    monkeypatch.setattr(typed, "forward_settings", recording)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, mlp_tile_tokens=16)
    plan = memory.plan_settings(trainer.args, prompt_length=8)
    assert any(trainer.scorer.forward is options for options in built) and plan.forward is built[-1]
    assert trainer.scorer.forward == plan.forward and isinstance(plan.forward, ForwardSettings)
    assert plan.forward.chunk_size == 777 and plan.forward.mlp_tile_tokens == 16


def test_the_memory_page_lists_every_option_and_lever():
    """docs/MEMORY.md's table names every option of the table and its CUDA state, and every lever is described."""
    page = (ROOT / "docs" / "MEMORY.md").read_text()
    section = page[page.index("## The levers, and what is held back on CUDA"):]
    section = section[:section.index("\n## ", 3)]
    for option in levers.OPTIONS.values():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{option.field}` |"))
        assert ("not proposed" in row or "off unless set" in row or "'warn'" in row) != option.ran_on_gpu(), row
        assert all(source in row for source in option.sources) or option.field == "memory_check", row
    assert "Evidence recorded today: none" in section or any(o.ran_on_gpu() for o in levers.OPTIONS.values())
