#!/usr/bin/env bash
# One H200 call for the native IO core: `pytest -m cuda` on the wheel built on the dev VM
# and carried (the checkout's kvoffload/ moved aside, so the wheel's is the one imported),
# the seal rates (the core's AES-GCM against cryptography's, interleaved rounds), the engine
# group at 75% Python on one and four RAM drives, then `pytest -m cuda` on the plain checkout
# (PYTHONPATH=.: no core built there, the Python path) and, optionally, kvsim's GPU calibration. Carry .whl: the kvoffload wheel (pip wheel . --no-deps -w .whl),
# cryptography, cffi and pycparser for Python 3.12, and COMMIT (git describe of the build).
#   OUT=/dir bash scripts/h200_native.sh [--kvsim]
set -u -o pipefail
cd "$(dirname "$0")/.."
. scripts/h200_wheel.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version())"
  lscpu | grep -E "Model name|^CPU\(s\)"; } >> "$OUT/env.txt" 2>&1
wheel_only
PYTHONPATH=/tmp/site KVOFFLOAD_REQUIRE_NATIVE=1 timeout 220 python3 -m pytest -m cuda -q -p no:cacheprovider -x \
  > "$OUT/cuda_wheel.log" 2>&1; echo "cuda tests, the wheel (native core): rc=$? $(tail -1 "$OUT/cuda_wheel.log")"
PYTHONPATH=/tmp/site timeout 60 python3 -m kvoffload.bench --only seal --seals aes-gcm --case-seconds 1 --runs 3 --json \
  > "$OUT/seal.json" 2> "$OUT/seal.log"; echo "seal bench rc=$?"
PYTHONPATH=/tmp/site timeout 60 python3 scripts/bench_aes_gcm.py --impl all --rounds 7 --sizes 2M,256K \
  > "$OUT/gcm.txt" 2>&1; echo "gcm bench rc=$?"
# The engine group beside a main thread at 75% Python, one RAM drive then four (the notes'
# recipe: --make-array), the wheel's core.
eng=(--layouts llama --gib 2 --engine-seconds 0.7 --engine-max-repeats 4 --engine-shares 0.75
     --engine-paths gpu,tier,raw --only engine --json)
for n in 1 4; do
  PYTHONPATH=/tmp/site timeout 170 python3 -m kvoffload.bench --make-array $n --array-gib 6 "${eng[@]}" \
    > "$OUT/engine$n.json" 2> "$OUT/engine$n.log"; echo "engine group, $n drive(s): rc=$?"
done
PYTHONPATH=/tmp/site python3 scripts/engine_summary.py "$OUT/engine1.json" "$OUT/engine4.json"
checkout_back
PYTHONPATH=.:/tmp/site KVOFFLOAD_NATIVE_IO=off timeout 220 python3 -m pytest -m cuda -q -p no:cacheprovider -x \
  > "$OUT/cuda_checkout.log" 2>&1; echo "cuda tests, the plain checkout (Python path): rc=$? $(tail -1 "$OUT/cuda_checkout.log")"
if [ "${1:-}" = "--kvsim" ]; then
  PYTHONPATH=.:/tmp/site timeout 240 python3 -m kvsim calibrate gpu --models qwen3-32b,qwen3-32b:tp2,llama3-8b,qwen3-8b,llama3-70b:tp4 \
    --budget-s 150 -o "$OUT/gpu_h200.json" > "$OUT/kvsim_cal.log" 2>&1; echo "kvsim calibrate gpu rc=$?"
fi
cat "$OUT/gcm.txt" | tail -12
