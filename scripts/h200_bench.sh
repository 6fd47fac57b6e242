#!/usr/bin/env bash
# The H200 run plan for issues 14 (fast storage) and 13 (encryption cost): three
# `python -m kvoffload.bench --json` runs, then a compact table of all three, last.
#
#   OUT=/some/dir bash scripts/h200_bench.sh           # on the H200, as root, from the repository root
#   OUT=/tmp/plan bash scripts/h200_bench.sh --quick   # the same commands on CPU at smoke-test sizes
#
# 1. disk:  the machine's own disk (the current directory): llama + small blocks, O_DIRECT and page
#           cache, aes-gcm and xxh3; DRAM backend, device seam, the seals alone (GIL scaling).
# 2. array: 4 RAM-backed ext4 drives of 14 GiB (loop devices over /dev/shm, built and torn down by the
#           bench): one drive alone, 2 files on it, and all 4 striped; llama, O_DIRECT, aes-gcm and xxh3.
# 3. seam:  the device copy alone for the MLA and many-tensor layouts.
# Every case runs >= 2 s. Expected wall time 6-7 minutes. Each step has a hard limit (below; 9 minutes
# together, under the device's 10-minute command limit): a step that hits it is sent SIGTERM, tears its
# drives down and still writes the cases it measured (marked "interrupted"), and the next step runs.
# Written to $OUT: <step>.json (the bench's JSON), <step>.log (its progress and full table on
# failure), env.txt, steps.txt, summary.txt.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the directory for JSON files and logs}"
mkdir -p "$OUT"

if [ "${1:-}" = "--quick" ]; then
    COMMON=(--quick --device cpu)
    DISK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-plan-XXXXXX")
    ARRAY_GIB=0.25
    LIMITS=(120 120 60)
else
    COMMON=(--case-seconds 2 --raw-seconds 0.3)
    DISK_DIR=.
    ARRAY_GIB=14
    LIMITS=(320 170 60)
fi

{
    if git rev-parse --short HEAD >/dev/null 2>&1; then
        echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' + local changes')"
    else
        echo "commit unknown (no git checkout here)"
    fi
    "$PY" - <<'EOF'
import os, platform, torch
try:
    import cryptography
    crypto = cryptography.__version__
except ImportError:
    crypto = "MISSING: the aes-gcm cases will fail"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, cryptography {crypto}, GPU {gpu}, "
      f"{os.cpu_count()} CPUs, euid {os.geteuid()}")
EOF
    df -h /dev/shm "$DISK_DIR" | sed 's/^/  /'
} 2>&1 | tee "$OUT/env.txt"
: > "$OUT/steps.txt"

step() {  # step NAME LIMIT_S ARGS...: one bench run to $OUT/NAME.json, progress to $OUT/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout -k 30 "$limit" "$PY" -m kvoffload.bench --json "${COMMON[@]}" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
    rc=$?
    echo "step $name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)$([ $rc = 124 ] && echo ', TIMED OUT')" |
        tee -a "$OUT/steps.txt"
    [ $rc = 0 ] || tail -n 3 "$OUT/$name.log" | sed 's/^/    /'
}

step disk "${LIMITS[0]}" --dir "$DISK_DIR" --layouts llama,small --modes direct,pagecache --seals aes-gcm,xxh3 \
    --only disk,dram,seam,seal
step array "${LIMITS[1]}" --make-array 4 --array-gib "$ARRAY_GIB" --layouts llama --modes direct \
    --seals aes-gcm,xxh3 --only disk,stripe
step seam "${LIMITS[2]}" --layouts mla,many --only seam

[ "$DISK_DIR" = . ] || rm -rf "$DISK_DIR"
echo
"$PY" -m kvoffload.bench.report "$OUT/disk.json" "$OUT/array.json" "$OUT/seam.json" | tee "$OUT/summary.txt"
