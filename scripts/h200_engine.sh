#!/usr/bin/env bash
# One H200 call for the engine group (python -m kvoffload.bench --only engine): four
# RAM-backed drives, Python's default GIL hand-over (5 ms) and 1 ms. Carry .whl
# (cryptography, cffi, pycparser for Python 3.12). Results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log -1 --format='commit %h %s' 2>/dev/null || true
nproc; python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
common=(--only engine --make-array 4 --array-gib 5 --gib 2 --engine-seconds 0.7 --engine-max-repeats 5 --json)
python3 -m kvoffload.bench "${common[@]}" "$@" > "$OUT/engine.json" 2> "$OUT/engine.log"; echo "default switch: rc=$?"
python3 -m kvoffload.bench "${common[@]}" --engine-shares 0.75 --engine-switch-ms 1 "$@" \
  > "$OUT/engine_switch1ms.json" 2> "$OUT/engine_switch1ms.log"; echo "1 ms switch: rc=$?"
python3 - "$OUT"/engine.json "$OUT"/engine_switch1ms.json <<'PY'
import json, sys
from kvoffload.bench import engine
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except Exception as e:
        print(path, "unreadable:", e); continue
    print(path, "switch ms", d["config"].get("engine_switch_ms"), "ok", d["ok"])
    print(engine.table([engine.EngineCaseResult(**{**r, "engine_step_ratio_spread": tuple(r["engine_step_ratio_spread"]),
          "bandwidth_ratio_spread": tuple(r["bandwidth_ratio_spread"])}) for r in d["engine"]]))
PY
