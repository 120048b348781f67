#!/usr/bin/env bash
# Run the test suite at the lowest transformers release setup.cfg admits (its `transformers>=` bound), in a venv of
# its own, .venv-floor in the repo root: torch 2.13.0 (CPU) first, then this project with its [test,deepspeed]
# extras and transformers pinned to the floor, the other dependencies at whatever pip resolves next to it.
#
#   bash scripts/test_floor.sh                 # builds or updates .venv-floor, then runs pytest -q
#   bash scripts/test_floor.sh tests/config    # extra arguments go to pytest
#   GRPO_TRAINER_TEST_WORKERS=1 bash scripts/test_floor.sh    # serially (default: 2 pytest-xdist workers)
#   bash scripts/test_floor.sh --build-only    # only builds or updates .venv-floor (scripts/test.sh, in the background)
#
# Idempotent: a re-run reuses the venv. Exits with pytest's status (5, no tests collected, is a failure).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv-floor"
cd "$REPO" || exit 1
FLOOR="$(sed -n 's/^ *transformers>=\([0-9.]*\).*/\1/p' setup.cfg)"
if [ -z "$FLOOR" ]; then
    echo "test_floor.sh: no 'transformers>=X' line in setup.cfg's install_requires" >&2
    exit 1
fi

echo "== transformers floor: $FLOOR ($VENV)"
python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install -q torch==2.13.0 \
    && DS_BUILD_OPS=0 "$VENV/bin/pip" install -q -e '.[test,deepspeed]' "transformers==$FLOOR" \
    || { echo "test_floor.sh: building $VENV failed" >&2; exit 1; }
installed="$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [ "$installed" != "$FLOOR" ]; then
    echo "test_floor.sh: $VENV has transformers $installed, not the floor $FLOOR" >&2
    exit 1
fi

[ "${1:-}" = "--build-only" ] && exit 0

# The combination matrix (tests/matrix, ~3.5 min) runs once, in the newest-releases stage: it tests how the
# features combine, which does not depend on the transformers release; here it would double its cost.
"$VENV/bin/python" -m pytest -q -n "${GRPO_TRAINER_TEST_WORKERS:-2}" --ignore=tests/matrix "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests (exit 5): a suite that runs nothing fails the run" >&2
fi
exit "$rc"
