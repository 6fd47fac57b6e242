#!/usr/bin/env bash
# One H200 call: the data-path tests on CUDA, then one bench run on four RAM drives of the
# striped cold load against its cycling ceiling, the engine group (native units) and the
# metric-collection cost, then the engine group's 75% cases on the Python path. Carry .whl.
set -u -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 140 python3 -m pytest -m cuda -q -p no:cacheprovider > "$OUT/cuda.log" 2>&1; echo "cuda tests rc=$?: $(tail -1 "$OUT/cuda.log")"
common=(--make-array 4 --array-gib 6 --layouts llama --gib 2 --engine-seconds 0.7 --engine-max-repeats 4 --json)
timeout 300 python3 -m kvoffload.bench "${common[@]}" --only stripe,engine,metrics --modes direct --seals aes-gcm \
  --engine-shares 0.25,0.75 --engine-paths gpu,tier --metrics-pairs 5 --case-seconds 1.5 > "$OUT/bench.json" 2> "$OUT/bench.log"
echo "bench rc=$?"
KVOFFLOAD_NATIVE_IO=off timeout 110 python3 -m kvoffload.bench "${common[@]}" --only engine --engine-shares 0.75 \
  --engine-paths gpu,tier > "$OUT/engine_python.json" 2> "$OUT/engine_python.log"; echo "python path rc=$?"
python3 scripts/engine_summary.py "$OUT/bench.json" "$OUT/engine_python.json"
