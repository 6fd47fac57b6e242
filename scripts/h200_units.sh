#!/usr/bin/env bash
# The engine group at 75% Python on one and four RAM drives, per IO unit size: which
# io_unit_bytes keeps the drives' bandwidth beside a busy engine thread. With CUDA_TESTS=1
# the carried wheel runs `pytest -m cuda` first. Carry .whl (the kvoffload wheel and its
# dependencies; COMMIT).
#   OUT=/dir VARIANTS="unit16:--engine-paths gpu --io-unit-mib 16|default:--engine-paths gpu,tier,raw" \
#     bash scripts/h200_units.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
. scripts/h200_wheel.sh
wheel_only
export PYTHONPATH=/tmp/site
if [ "${CUDA_TESTS:-0}" = 1 ]; then
  KVOFFLOAD_REQUIRE_NATIVE=1 timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider -x > "$OUT/cuda_wheel.log" 2>&1
  echo "cuda tests, the wheel: rc=$? $(tail -1 "$OUT/cuda_wheel.log")"
fi
common="--make-array 4 --array-gib 6 --layouts llama --gib 2 --engine-seconds 0.8 --engine-max-repeats ${REPEATS:-5} --engine-shares 0.75 --only engine --json"
IFS='|' read -ra variants <<< "${VARIANTS:-base:--engine-paths gpu,tier,raw}"
for v in "${variants[@]}"; do
  name=${v%%:*}; args=${v#*:}
  timeout 240 python3 -m kvoffload.bench $common $args > "$OUT/engine_$name.json" 2> "$OUT/engine_$name.err"
  echo "$name rc=$?"
done
python3 scripts/engine_summary.py "$OUT"/engine_*.json
