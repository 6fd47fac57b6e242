#!/usr/bin/env bash
# Which knob moves the engine group's bandwidth at 75% Python on four RAM drives: the
# default run beside the GPU path with 4x larger IO units and with 2x the IO threads.
# Carry .whl (the kvoffload wheel and its dependencies; COMMIT).  OUT=/dir bash scripts/h200_units.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
echo "build: $(cat .whl/COMMIT 2>/dev/null)" > "$OUT/env.txt"
mv kvoffload /tmp/kvoffload.checkout
trap 'mv /tmp/kvoffload.checkout kvoffload 2>/dev/null' EXIT
python3 -c "import kvoffload, kvoffload.native_io as n; print('wheel:', kvoffload.__file__, n.core().describe())" | tee -a "$OUT/env.txt"
common="--make-array 4 --array-gib 6 --layouts llama --gib 2 --engine-seconds 0.6 --engine-max-repeats ${REPEATS:-4} --engine-shares 0.75 --only engine --json"
for v in "base:--engine-paths gpu,tier,raw" "unit64:--engine-paths gpu --io-unit-mib 64" "threads8:--engine-paths gpu --io-threads 8"; do
  name=${v%%:*}; args=${v#*:}
  timeout 170 python3 -m kvoffload.bench $common $args > "$OUT/engine_$name.json" 2> "$OUT/engine_$name.err"
  echo "$name rc=$?"
done
python3 scripts/engine_summary.py "$OUT"/engine_*.json
