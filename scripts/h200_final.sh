#!/usr/bin/env bash
# The session's last H200 call: the carried wheel under `pytest -m cuda` (the copy paths changed
# since the last run), the engine group at 75% Python on four RAM drives, the persistent pool's
# costs and the ways of making a slot file against first stores on one RAM drive, then the plain
# checkout's Python path under `pytest -m cuda`. At most 8 files in $OUT. Carry .whl (the kvoffload
# wheel, cryptography, cffi, pycparser; COMMIT).
#   OUT=/dir bash scripts/h200_final.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
. scripts/h200_wheel.sh
# One RAM drive, built as the notes say (fully allocated image, eager ext4 init).
fallocate -l 12G /dev/shm/pd.img && L=$(losetup -f --show /dev/shm/pd.img) && mkfs.ext4 -q -F -m 0 \
  -E lazy_itable_init=0,lazy_journal_init=0 "$L" && mkdir -p /mnt/pd && mount "$L" /mnt/pd || echo "ram drive failed"
wheel_only
PYTHONPATH=/tmp/site KVOFFLOAD_REQUIRE_NATIVE=1 timeout 120 python3 -m pytest -m cuda -q -p no:cacheprovider -x \
  > "$OUT/cuda_wheel.log" 2>&1; echo "cuda tests, the wheel: rc=$? $(tail -1 "$OUT/cuda_wheel.log")"
mkdir -p -m 700 /mnt/pd/persist
PYTHONPATH=/tmp/site timeout 80 python3 scripts/bench_persist.py --dir /mnt/pd/persist --device cuda --blocks 256 \
  --pairs 5 --repeat 3 > "$OUT/persist.txt" 2>&1; echo "persist bench rc=$?"; tail -20 "$OUT/persist.txt"
timeout 90 python3 scripts/probe_first_write.py --dir /mnt/pd --gib 3 --threads 4 --rounds 2 > "$OUT/first_write.txt" 2>&1
echo "first-write probe rc=$?"; cat "$OUT/first_write.txt"
PYTHONPATH=/tmp/site timeout 140 python3 -m kvoffload.bench --make-array 4 --array-gib 6 --layouts llama --gib 2 \
  --engine-seconds 0.6 --engine-max-repeats 3 --engine-shares 0.75 --engine-paths gpu,tier,raw --only engine --json \
  > "$OUT/engine4.json" 2> /dev/null; echo "engine group rc=$?"
PYTHONPATH=/tmp/site python3 scripts/engine_summary.py "$OUT/engine4.json"
checkout_back
PYTHONPATH=.:/tmp/site KVOFFLOAD_NATIVE_IO=off timeout 100 python3 -m pytest -m cuda -q -p no:cacheprovider -x \
  > "$OUT/cuda_checkout.log" 2>&1; echo "cuda tests, the plain checkout (Python path): rc=$? $(tail -1 "$OUT/cuda_checkout.log")"
umount /mnt/pd 2>/dev/null; losetup -d "$L" 2>/dev/null; rm -f /dev/shm/pd.img
