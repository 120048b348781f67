"""The vLLM rows of the combination matrix (tests/matrix: factors, generator and checks), run in the real-vLLM stage
(scripts/test_vllm.sh, in .venv-vllm).

Each row trains 2 steps with vLLM colocated or against a server and shows what a CPU row shows
(`tests.matrix.checks.check_trained`): finite losses, moved weights, equal weights on every process, resume
equal to the straight run, the packed run equal to its padded twin, async staleness within its bound, resampling
that kept informative groups. The refusal cells of the vLLM rows (the package's own refusals, `factors.refusal`: a
server with several training processes and async_rollouts, routing_replay='on' with an engine, sp_size=2 with vLLM)
must stop with that refusal's message before the model loads. Text rows start from the tiny model the session's server
serves, and their server rows use that server, which gets the served weights back after the module (they push
trained weights to it); image rows start from the tiny Idefics3 (TRL's placeholder format), served by the session's
image server (conftest.py), which gets its weights back the same way. A server samples from one unseeded random
state, so a server row's resumed run and padded twin replay the straight run's rollouts (`cell_run._sampled`)."""

from __future__ import annotations

import time

import pytest

from tests.matrix import cell_run, factors
from tests.matrix.checks import check_refused, check_trained, launch

pytestmark = pytest.mark.matrix

ROWS = [row for row in factors.rows() if factors.uses_vllm(row)]
REFUSED = [row for row in factors.refusal_cells() if factors.uses_vllm(row)]
# As tests/matrix/test_matrix.py's: {cell name: the bug}, each xfail(strict=True) until fixed.
KNOWN_BUGS: dict[str, str] = {}


@pytest.fixture(scope="module")
def text_server(served_model, vllm_server):
    """The session's server. The rows push their trained weights to it, and a trainer takes the server to hold its
    starting weights until its first push: on leaving, the served model's own weights go back (float32 files, so
    exactly), and the real-vLLM tests after this module see the server they expect. (A server of its own cost a
    second start of vLLM, ~100-200 s of the stage on 2 cores.)"""
    yield vllm_server
    from transformers import AutoModelForCausalLM

    from grpo_trainer.rollout.vllm.server import ServerClient, ServerWeights
    from tests.vllm_integration.vllm_helpers import free_port

    client = ServerClient(vllm_server, timeout=60, group_port=free_port())
    ServerWeights(client, client.transfer).push(AutoModelForCausalLM.from_pretrained(served_model))


@pytest.fixture(scope="module")
def image_server(vlm_server):
    """The session's image server (tests/vllm_integration/conftest.py: the tiny Idefics3, TRL's placeholder format),
    holding its served weights again after the module."""
    return vlm_server[0]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """`launched(row)` -> its cell's record. The rows of one process layout run in one process or one launch, one
    after the other, as on CPU (tests/matrix/test_matrix.py); the servers start once, when a server row needs them."""
    cache: dict[str, list[dict] | str] = {}

    def urls() -> dict:
        kinds = {r["prompts"] for r in ROWS + REFUSED if r["backend"] == "vllm_server"}
        return {kind: request.getfixturevalue(f"{kind}_server") for kind in kinds}

    def result(row: dict) -> dict:
        layout = row["processes"]
        cells = [r for r in ROWS if r["processes"] == layout] + \
            [{**r, "refused": True} for r in REFUSED if r["processes"] == layout]
        if layout not in cache:
            out = tmp_path_factory.mktemp(f"matrix_vllm_{layout}")
            vllm = urls() if any(c["backend"] == "vllm_server" for c in cells) else {}
            start = time.perf_counter()
            cache[layout] = cell_run.run_all(cells, out, vllm) if layout == "1" else launch(layout, cells, out, vllm)
            print(f"\n[matrix vLLM] {layout}: {len(cells)} cells in {time.perf_counter() - start:.1f}s")
        if isinstance(cache[layout], str):
            pytest.fail(cache[layout])
        return cache[layout][cells.index(row)]

    return result


def _param(row: dict):
    name = factors.name(row)
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])] if name in KNOWN_BUGS else []
    return pytest.param(row, id=name, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_vllm_cell_trains(row, launched):
    check_trained(row, launched(row))


@pytest.mark.parametrize("row", [pytest.param(r, id=factors.name(r)) for r in REFUSED])
def test_vllm_refused_combination_is_named_before_the_model_loads(row, launched):
    check_refused(row, launched({**row, "refused": True}))
