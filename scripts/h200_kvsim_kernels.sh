# The H200 run behind kvsim/profiles/gpu_h200.json's eager and compiled steps, and the
# kernel probe of the steps the model misses (docs/kvsim.md, "The GPU's step time"):
#   bash scripts/h200_kvsim_kernels.sh   (from the repository root; writes $OUT)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
{ git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; command -v gcc cc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 120 python3 scripts/h200_kernel_probe.py "$OUT/probe.json" > "$OUT/probe.log" 2>&1; echo "probe rc $?"
python3 -m kvsim calibrate gpu --models qwen3-32b:tp2,qwen3-32b,llama3-70b:tp4,llama3-8b,qwen3-8b \
  --kernels eager,compiled --budget-s "${BUDGET_S:-380}" -o "$OUT/gpu_h200.json" > "$OUT/kvsim_fit.txt" 2> "$OUT/kvsim_cal.log"
echo "calibrate rc $?"
grep -c '"kernels": "compiled"' "$OUT/gpu_h200.json"
tail -3 "$OUT/kvsim_fit.txt"; grep -iE "error|warn|recompil" "$OUT/kvsim_cal.log" | head -5
grep -E "qwen3-32b  tp=2 (eager|compiled) +(prefill|decode)" "$OUT/kvsim_cal.log" | head -40 | awk '{print $2,$3,$4,$5,$6,$8}'
