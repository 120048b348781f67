#!/usr/bin/env bash
# The project's test command (README "Two commands"; CI runs it through .ci/run on a clean checkout):
#   1. .venv: torch 2.13.0 (CPU) first, then this project with its [test,deepspeed] extras at the newest releases
#      pip resolves, and the suite;
#   2. .venv-floor: the suite again at the lowest transformers release setup.cfg admits (scripts/test_floor.sh);
#   3. .venv-vllm: vLLM's CPU build, and every test that runs real vLLM (scripts/test_vllm.sh). A failure to build
#      that environment fails the run: nothing is skipped for want of vLLM.
# Stages 2 and 3 run at the same time, after 1. All three always run; the exit status is the first failure's. A suite
# that collects no test (pytest's exit 5) fails: a test command that runs nothing must not pass.
#
#   bash scripts/test.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

pytest_status() {  # pytest's exit status; 5 ("no tests collected") is a failure, said so
    if [ "$1" -eq 5 ]; then
        echo "pytest collected no tests (exit 5): a suite that runs nothing fails the run" >&2
    fi
    return "$1"
}

# The first two suites run in pytest-xdist workers, one per core (every test runs one torch thread: tests/conftest.py);
# measured on the loaded 2-core machine, 2 workers ran the first suite in 19.5 min against 28 serially. The vLLM stage
# stays serial (its tests share one session-wide vLLM server, which each worker would start again) and runs beside
# the floor stage: alone it kept 1.1 of the 2 cores busy (838 CPU s in 762 s: benchmarks/results/
# vllm_stage_alone_2026-11-28.log), so the two stages share the cores instead of taking turns (the whole command: 3093 s
# in turn, 2614 s side by side, ci_clean_clone_2026-11-28{,b}.log there). Each stage's output is printed whole, in
# turn, after it ends.
export GRPO_TRAINER_TEST_WORKERS="${GRPO_TRAINER_TEST_WORKERS:-2}"
WORKERS="$GRPO_TRAINER_TEST_WORKERS"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
start=$(date +%s)
# pip runs on one core: vLLM's environment (the longest build, ~330 s) is built beside .venv from the start, the floor's
# beside the first suite. With all three pip runs at once the first stage took 322 s more than its tests
# (2026-11-28). Each stage below runs its build script again, which then only checks what is installed (and reports a
# failed build).
bash scripts/vllm_cpu_env.sh >"$logs/vllm_build.log" 2>&1 &
vllm_build=$!
echo "== newest releases (.venv)"
if python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 \
        && DS_BUILD_OPS=0 .venv/bin/pip install -q -e '.[test,deepspeed]'; then
    bash scripts/test_floor.sh --build-only >"$logs/floor_build.log" 2>&1 &
    floor_build=$!
    # -p tests.skip_budget: a skip that tests/allowed_skips.txt does not list fails the stage (a skip cannot hide a
    # failure)
    .venv/bin/python -m pytest -q -n "$WORKERS" -p tests.skip_budget
    pytest_status $?
    newest=$?
    wait "$floor_build"
    echo "== the floor's environment, built in the background"
    cat "$logs/floor_build.log"
else
    echo "test.sh: building .venv failed" >&2
    newest=1
fi
newest_done=$(date +%s)

wait "$vllm_build"
bash scripts/test_vllm.sh >"$logs/vllm.log" 2>&1 &
vllm_stage=$!
echo "== transformers floor (.venv-floor), beside the real-vLLM stage"
bash scripts/test_floor.sh
floor=$?
floor_done=$(date +%s)
wait "$vllm_stage"
vllm=$?
vllm_done=$(date +%s)
echo "== real vLLM (.venv-vllm, vLLM's CPU build): its environment, built in the background, and its stage"
cat "$logs/vllm_build.log" "$logs/vllm.log"

echo "== newest releases: exit $newest ($(( newest_done - start )) s); transformers floor: exit $floor" \
     "($(( floor_done - newest_done )) s); real vLLM: exit $vllm ($(( vllm_done - newest_done )) s, beside the" \
     "floor); total $(( $(date +%s) - start )) s"
for status in "$newest" "$floor" "$vllm"; do
    [ "$status" -ne 0 ] && exit "$status"
done
exit 0
