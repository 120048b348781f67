#!/usr/bin/env bash
# The project's test command (README "Two commands"; CI runs it through .ci/run on a clean checkout):
#   1. .venv: torch 2.13.0 (CPU) first, then this project with its [test,deepspeed] extras at the newest releases
#      pip resolves, and the suite;
#   2. .venv-floor: the suite again at the lowest transformers release setup.cfg admits (scripts/test_floor.sh).
# Both always run; the exit status is the first failure's. pytest's 5 (no tests collected) is a failure: a suite
# that runs nothing has checked nothing.
#
#   bash scripts/test.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

pytest_status() {  # pytest's exit status; 5 ("no tests collected") is reported and stays a failure
    if [ "$1" -eq 5 ]; then
        echo "pytest collected no tests (exit 5): a failure" >&2
    fi
    return "$1"
}

echo "== newest releases (.venv)"
python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 \
    && DS_BUILD_OPS=0 .venv/bin/pip install -q -e '.[test,deepspeed]' && .venv/bin/python -m pytest -q
pytest_status $?
newest=$?

echo "== transformers floor (.venv-floor)"
bash scripts/test_floor.sh
floor=$?

echo "== newest releases: exit $newest; transformers floor: exit $floor"
[ "$newest" -ne 0 ] && exit "$newest"
exit "$floor"
