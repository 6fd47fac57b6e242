#!/usr/bin/env bash
# One H200 call for the engine issue's GIL round (cuda_driver.py: launches keep the GIL, a
# store's copy wait inside its native call, a load's settle queries first): the data-path
# tests on CUDA, how long a launch holds the GIL, then the engine group on four RAM drives
# (and one), GPU path and tier at 25% and 75% Python, and the tier's 75% cases with 16 MiB
# units beside its 4 MiB default. Carry .whl (the cryptography wheels).
set -u -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "commit $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain | wc -l) changed files; $(nproc) cores"
timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider > "$OUT/cuda.log" 2>&1; echo "cuda tests rc=$?: $(tail -1 "$OUT/cuda.log")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda.log" | head -5
timeout 40 python3 scripts/probe_gil_held_launch.py > "$OUT/launch.txt" 2> "$OUT/launch.log"; echo "launch probe rc=$?"
common=(--make-array 4 --array-gib 6 --layouts llama --gib 2 --engine-seconds 0.7 --engine-max-repeats 4 --json
        --modes direct --seals aes-gcm --only engine)
timeout 250 python3 -m kvoffload.bench "${common[@]}" --engine-shares 0.25,0.75 --engine-paths gpu,tier \
  > "$OUT/engine.json" 2> "$OUT/engine.log"; echo "engine rc=$?"
timeout 80 python3 -m kvoffload.bench "${common[@]}" --engine-shares 0.75 --engine-paths tier --engine-tier-unit-mib 16 \
  > "$OUT/engine_tier16.json" 2> "$OUT/engine_tier16.log"; echo "tier 16 MiB rc=$?"
cat "$OUT/launch.txt"
python3 scripts/engine_summary.py "$OUT/engine.json" "$OUT/engine_tier16.json"
