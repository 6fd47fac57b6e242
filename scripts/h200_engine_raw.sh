#!/usr/bin/env bash
# One H200 call: the engine group's raw bound (16 and 64 MiB units) beside kvoffload's
# tier path, on four RAM drives; and what a native unit executor could build with there.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(which gcc cc; gcc --version | head -1; python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])';
 ls "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h";
 python3 -c 'import _hashlib; print([l.split()[-1] for l in open("/proc/self/maps") if "libcrypto" in l][:1])';
 ls /usr/lib/x86_64-linux-gnu/libcrypto.so* /usr/include/openssl/evp.h) 2>&1 | sed 's/^/probe: /'
common=(--only engine --make-array 4 --array-gib 5 --gib 2 --engine-seconds 0.7 --engine-max-repeats 4 --json
        --engine-shares 0.25,0.75)
python3 -m kvoffload.bench "${common[@]}" --engine-paths raw,tier > "$OUT/raw16.json" 2> "$OUT/raw16.log"; echo "rc=$?"
python3 -m kvoffload.bench "${common[@]}" --engine-paths raw --io-unit-mib 64 > "$OUT/raw64.json" 2> "$OUT/raw64.log"; echo "rc=$?"
for f in "$OUT"/raw16.json "$OUT"/raw64.json; do python3 -c "
import json, sys
d = json.load(open(sys.argv[1])); print(sys.argv[1], 'unit MiB', d['config']['io_unit_bytes'] >> 20, 'ok', d['ok'])
for r in d['engine']:
    print(f\"{r['path']:4} {r['direction']:5} {r['drives']} {r['share']:.2f} step {r['engine_step_ratio']:.3f} med {r['engine_step_ratio_median']:.3f} bw {r['bandwidth_ratio']:.3f} med {r['bandwidth_ratio_median']:.3f} {r['gib_s_busy']:.2f}/{r['gib_s_ref']:.2f} GiB/s\")
" "$f"; done
