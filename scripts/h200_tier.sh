#!/usr/bin/env bash
# The H200 run plan for issue 25: kvoffload's tier beside vLLM's fs tier with its compiled IO, one
# `python -m kvoffload.bench.tier --json` run per case, in the same run as the fs rows.
#
#   OUT=/some/dir FS_FILES=.whl/vllm-fs bash scripts/h200_tier.sh [CASE...]   # on the H200, as root, repo root
#   OUT=/tmp/plan FS_FILES=DIR bash scripts/h200_tier.sh --quick [CASE...]    # smoke test: temp dirs, tiny sizes
#
# FS_FILES: vLLM 0.33.0's fs tier files, unpacked from its wheel with their paths (about 42 KB; the wheel
# itself is 336 MB), into a git-ignored folder that travels with the checkout:
#   unzip -q -d .whl/vllm-fs vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl vllm/fs_io_C.abi3.so \
#       'vllm/v1/kv_offload/tiering/fs/io.py' 'vllm/v1/kv_offload/tiering/fs/thread_pool.py'
# Drives: 4 RAM-backed ext4 drives of 15 GiB (fully allocated tmpfs images, eager ext4 init: the recipe in
# the notes), built here and torn down on exit. Every case: the raw O_DIRECT ceilings, kvoffload's tier
# (AES-GCM unless the case says) read into staging and read into the rows (--direct-io both), and fs-core
# (vLLM's fs IO; the row says C or Python) on as many drives, one fs tier per drive:
#   drives4   4 drives, 2 MiB chunks, 16 GiB           drives4-off  the same, no seal (the cipher's share)
#   drives4-u16  the same with 16 MiB IO units (the GPU backend's; the engine issue's busy-engine runs)
#   drives4-t8   the same with 8 IO threads per lane (the default on 16 cores and 4 paths: 4)
#   drive1    1 drive, 2 MiB chunks, 6 GiB (fs writes each round to new files: 12 GiB on the drive)
#   small4    4 drives, 256 KiB chunks, 4 GiB          small1       1 drive, 256 KiB chunks, 3 GiB
#   disk      the machine's own disk (the current directory), 2 MiB chunks, 4 GiB
# Each case has a hard limit (LIMIT_S, 150 s); <case>.json, <case>.log, env.txt and steps.txt go to $OUT.
# DRIVE_GIB (15) sizes the drives; the cases' sizes assume 15.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the directory for JSON files and logs}"
: "${FS_FILES:?set FS_FILES to the unpacked vLLM 0.33.0 fs files (see the top of this script)}"
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-150}
DRIVE_GIB=${DRIVE_GIB:-15}

QUICK=0
if [ "${1:-}" = "--quick" ]; then
    QUICK=1
    shift
fi
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(drives4 drives4-off drive1 small4 small1 disk)

DRIVES=() IMAGES=() LOOPS=()
cleanup() {  # undo what was made, last first; each step also when an earlier one failed
    for d in "${DRIVES[@]}"; do
        if [ $QUICK = 1 ]; then rm -rf "$d"; else umount "$d" && rmdir "$d"; fi
    done
    for l in "${LOOPS[@]}"; do losetup -d "$l"; done
    for i in "${IMAGES[@]}"; do rm -f "$i"; done
}
trap cleanup EXIT
for i in 0 1 2 3; do
    if [ $QUICK = 1 ]; then
        DRIVES+=("$(mktemp -d "${TMPDIR:-/tmp}/kvt-d$i-XXXXXX")")
        continue
    fi
    IMAGES+=("/dev/shm/kvt-d$i.img")
    fallocate -l "${DRIVE_GIB}G" "/dev/shm/kvt-d$i.img" || exit 1
    LOOPS+=("$(losetup -f --show "/dev/shm/kvt-d$i.img")") || exit 1
    mkfs.ext4 -q -F -m 0 -E lazy_itable_init=0,lazy_journal_init=0 "${LOOPS[-1]}" || exit 1
    mkdir -p "/mnt/kvt-d$i" && DRIVES+=("/mnt/kvt-d$i") && mount "${LOOPS[-1]}" "/mnt/kvt-d$i" || exit 1
done

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
    "$PY" -c "import platform, torch, cryptography, os; print(f'python {platform.python_version()}, torch {torch.__version__}, cryptography {cryptography.__version__}, {os.cpu_count()} CPUs')"
    df -h "${DRIVES[@]}" . | sed 's/^/  /'
} 2>&1 | tee "$OUT/env.txt"
: > "$OUT/steps.txt"

four=(--dir "${DRIVES[0]}" --dir "${DRIVES[1]}" --dir "${DRIVES[2]}" --dir "${DRIVES[3]}")
one=(--dir "${DRIVES[0]}")
scale() { [ $QUICK = 1 ] && echo 0.05 || echo "$1"; }  # GiB per case
for case in "${CASES[@]}"; do
    case $case in
        drives4) args=("${four[@]}" --gib "$(scale 16)") ;;
        drives4-off) args=("${four[@]}" --gib "$(scale 16)" --seal off) ;;
        drives4-u16) args=("${four[@]}" --gib "$(scale 16)" --io-unit-mib 16) ;;
        drives4-t8) args=("${four[@]}" --gib "$(scale 16)" --io-threads 8) ;;
        drive1) args=("${one[@]}" --gib "$(scale 6)") ;;
        small4) args=("${four[@]}" --gib "$(scale 4)" --chunk-mib 0.25) ;;
        small1) args=("${one[@]}" --gib "$(scale 3)" --chunk-mib 0.25) ;;
        disk) args=(--dir . --gib "$(scale 4)") ;;
        *) echo "unknown case $case" | tee -a "$OUT/steps.txt"; continue ;;
    esac
    [ $QUICK = 1 ] && args+=(--primary-gib 0.02 --raw-seconds 0.05)
    start=$(date +%s)
    timeout -k 30 "$LIMIT_S" "$PY" -m kvoffload.bench.tier --json --tiers kvoffload-direct,fs-core --direct-io both \
        --fs-dirs all --fs-files "$FS_FILES" "${args[@]}" >"$OUT/$case.json" 2>"$OUT/$case.log"
    rc=$?
    echo "case $case: exit $rc after $(($(date +%s) - start)) s (limit $LIMIT_S s)$([ $rc = 124 ] && echo ', TIMED OUT')" |
        tee -a "$OUT/steps.txt"
    [ $rc = 0 ] || tail -n 3 "$OUT/$case.log" | sed 's/^/    /'
    "$PY" -c "import json, sys; from kvoffload.bench import tier; print(tier.table(json.load(open(sys.argv[1]))))" \
        "$OUT/$case.json" 2>/dev/null | tee -a "$OUT/steps.txt"
done
