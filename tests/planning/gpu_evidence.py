"""Test-only: an option of `planning.levers` as it would be once a GPU session recorded it at the current code."""

import dataclasses

from grpo_trainer.planning import levers


def ran_on_gpu_now(option: levers.Option) -> levers.Option:
    """`option` with evidence naming its sources' current fingerprints (a raw file that the test never reads)."""
    evidence = levers.Evidence(raw=("benchmarks/results/a_gpu_session.log",), commit="0" * 7, date="today",
                               sources=tuple((path, levers.fingerprint(path)) for path in option.sources))
    return dataclasses.replace(option, evidence=evidence)
