#!/usr/bin/env bash
# One lent GPU session's checks in priority order, each bounded so that the later ones still get time, results
# under $OUT (default benchmarks/results/gpu_session). Meant for the device tool's one short call:
#   bash benchmarks/gpu/session.sh             # BUDGET=540 seconds in all, by default (later steps skip past it)
# It installs the wheels this project was tested with into /tmp/site when `.whl/` holds them (the GPU image has no
# internet), then: tests/gpu (CUDA graphs, bf16, activation offloading); long_completions.py (issue 41: the
# longest completion each trainer trains at Qwen2.5-0.5B, T doubling, ours vs TRL with its fused LM head);
# decode_bench.py (generation tokens/s of generate, TRL's static cache and paged generation, our decoder eager/compact/graphs, the bandwidth bound);
# bench_gpu.py ours (graphs, default) vs TRL (generate, static cache, paged) at the Qwen2.5-0.5B shape with varied
# completion lengths;
# memory_grid.py (the planner against torch.cuda's peaks); packing_gpu.py (packed vs padded forward + backward);
# speculative_verify_cost.py (a verifying forward over Q positions against the plain step, Qwen2.5-0.5B, bf16);
# fingerprints.json: the sources each result measured (planning/levers.py: what an option's GPU evidence records).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
OUT="${OUT:-benchmarks/results/gpu_session}"
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - start) )); }
step() {  # step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (and what is left), log to $OUT/NAME.log
    local name="$1" limit="$2"; shift 2
    local remaining; remaining=$(left)
    (( remaining < limit )) && limit=$remaining
    if (( limit < 20 )); then echo "== $name: skipped, ${remaining}s left" | tee -a "$OUT/session.log"; return; fi
    local t0; t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$OUT/session.log"
    tail -5 "$OUT/$name.log"
}
if compgen -G ".whl/*.whl" > /dev/null; then
    step pip 90 python -m pip install -q --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 WANDB_DISABLED=true TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.csv" 2>&1
python -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" \
    >> "$OUT/device.csv" 2>&1
# the code these results measure: each optional path's sources' sha256 (grpo_trainer/planning/levers.py, decision 1);
# an option's Evidence names them, and counts only while its files still hash to them
python -m grpo_trainer.planning.levers > "$OUT/fingerprints.json" 2>&1
step gpu_tests 120 python -m pytest -q -p no:cacheprovider tests/gpu
step long_completions 150 python benchmarks/long_completions.py --device cuda --shape qwen2.5-0.5b --budget-gib 139 \
    --lengths 8192,16384,32768,65536 --steps 1 --mlp-tile-tokens 1024 --recompute-attention \
    --out "$OUT/long_completions.json"
step decode_bench 150 python benchmarks/gpu/decode_bench.py --shape qwen2.5-0.5b --rows 16 --length 256 \
    --length-spread 64,0.8 --timeout 40 --json-out "$OUT/decode_bench.json"
step bench_gpu 220 python benchmarks/gpu/bench_gpu.py --shapes qwen2.5-0.5b --lengths 256 \
    --runs ours/graphs,ours/fast,trl/generate,trl/static,trl/paged --steps 2 --warmup 1 --timeout 60 \
    --length-spread 64,0.8 \
    --json-out "$OUT/bench_gpu.json"
step memory_grid 110 python benchmarks/gpu/memory_grid.py --configs T256_full,T256_lora --phase-runs "" \
    --timeout 50 --json-out "$OUT/memory_grid.json"
step packing_gpu 60 python benchmarks/gpu/packing_gpu.py --no-trainer --repeats 3 --json-out "$OUT/packing_gpu.json"
step speculative_verify 45 python benchmarks/speculative_verify_cost.py --device cuda --dtype bfloat16 \
    --rows 1,16,64 --positions 1,2,5,9 --repeats 5 --out "$OUT/speculative_verify_cost.json"
echo "== total $(( $(date +%s) - start ))s" | tee -a "$OUT/session.log"
