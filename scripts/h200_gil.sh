#!/usr/bin/env bash
# One H200 call for the engine issue's GIL round: the data-path tests on CUDA, how long one
# cuMemcpyBatchAsync of a unit takes, then the engine group on four RAM drives (and one):
# the GPU path (copies made inside unit_io's call) at 25% and 75% Python, and the tier at
# 8 and 16 MiB units beside its 4 MiB default. Carry .whl (the cryptography wheels).
#   OUT=$OUT bash scripts/h200_gil.sh [gpu-only]
set -u -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "$(nproc) cores; $(python3 -c 'import torch; print(torch.__version__)')"
timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider > "$OUT/cuda.log" 2>&1; echo "cuda tests rc=$?: $(tail -1 "$OUT/cuda.log")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda.log" | head -5
timeout 40 python3 scripts/probe_batch_launch.py > "$OUT/launch.txt" 2> "$OUT/launch.log"; echo "launch probe rc=$?"
common=(--make-array 4 --array-gib 6 --layouts llama --gib 2 --engine-seconds 0.7 --engine-max-repeats 4 --json
        --modes direct --seals aes-gcm --only engine)
timeout 150 python3 -m kvoffload.bench "${common[@]}" --engine-shares 0.25,0.75 --engine-paths gpu \
  > "$OUT/engine_gpu.json" 2> "$OUT/engine_gpu.log"; echo "engine gpu rc=$?"
files=("$OUT/engine_gpu.json")
if [ "${1:-}" != gpu-only ]; then
  for mib in 8 16; do
    timeout 120 python3 -m kvoffload.bench "${common[@]}" --engine-shares 0.25,0.75 --engine-paths tier \
      --engine-tier-unit-mib $mib > "$OUT/engine_tier$mib.json" 2> "$OUT/engine_tier$mib.log"; echo "tier $mib MiB rc=$?"
    files+=("$OUT/engine_tier$mib.json")
  done
fi
cat "$OUT/launch.txt"
python3 scripts/engine_summary.py "${files[@]}"
