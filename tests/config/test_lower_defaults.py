"""Settings dataclasses below `config/` cannot disagree with `GRPOConfig` (issue 39): `config/settings.py` maps every
field, so a lower default is only what a test or a direct caller gets, and where a field shares a config field's
name and kind its default is the config's."""

import dataclasses
import importlib
import pkgutil

import grpo_trainer
from grpo_trainer import GRPOConfig

# Same name, another meaning: the default is not the config field's.
OTHER_MEANING = {
    ("EngineSettings", "seed"): "the engine's data-parallel rank (process index // tensor_parallel_size)",
}


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _lower_settings():
    """Every `...Settings` dataclass defined in the package outside `config/` (entry points, which run on import,
    left out)."""
    found = []
    for info in pkgutil.walk_packages(grpo_trainer.__path__, "grpo_trainer."):
        if info.name.startswith("grpo_trainer.config") or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [obj for name, obj in vars(module).items() if isinstance(obj, type) and name.endswith("Settings")
                  and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return found


def test_lower_defaults_equal_the_configs():
    config = {f.name: _default(f) for f in dataclasses.fields(GRPOConfig)}
    classes = _lower_settings()
    assert len(classes) > 10  # the walk found them (ForwardSettings, SamplingSettings, AsyncSettings, ...)
    disagree, compared = [], 0
    for cls in classes:
        for field in dataclasses.fields(cls):
            value = _default(field)
            if value is dataclasses.MISSING or field.name not in config or (cls.__name__, field.name) in OTHER_MEANING:
                continue
            # a field of another kind is the config's resolved (`routing_replay` 'auto' -> a bool,
            # `pad_to_multiple_of` 'auto' -> an int or None, `generation_kwargs` None -> {}): nothing to compare
            if type(value) is not type(config[field.name]):
                continue
            compared += 1
            if value != config[field.name]:
                disagree.append(f"{cls.__module__}.{cls.__name__}.{field.name} = {value!r}, GRPOConfig: "
                                f"{config[field.name]!r}")
    assert compared > 20
    assert not disagree, "\n".join(disagree)


def test_settings_without_a_default_of_their_own():
    """What the config alone decides has no lower default: the packed forward and an asynchronous source's fields."""
    from grpo_trainer.modeling.forwards import ForwardSettings
    from grpo_trainer.trainer.producer import AsyncSettings

    for cls, names in ((ForwardSettings, {"padding_free"}), (AsyncSettings, {"rounds_ahead", "seed", "timeout"})):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert all(_default(fields[name]) is dataclasses.MISSING for name in names), cls
