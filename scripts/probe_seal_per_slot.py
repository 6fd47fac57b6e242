"""What opening one small slot costs after an O_DIRECT read, by seal.

One thread reads random 64 KiB slots of a file in ``--dir`` with O_DIRECT into a
4096-aligned buffer (one reused row, or cycling over 16 rows), then does what a load
does after its read:

  none            nothing
  xxh3            the checksum of the row (``ChecksumSeal``)
  copy            only the copy of a valid ciphertext and tag into the row (the
                  baseline for the two AES rows, whose open needs one)
  aes in place    that copy, then ``decrypt_into`` the row itself (``AesGcmSeal``'s load)
  aes out of place  that copy, then ``decrypt_into`` another buffer (``HostDevice``)

Prints the mean ``preadv`` time, the time after it, and process CPU per slot: whether
the decrypt costs more than its bytes, and whether a row left dirty by an in-place
decrypt makes the next direct read into it slower.
``PYTHONPATH=. python3 scripts/probe_seal_per_slot.py --dir /some/ext4/dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvoffload.device import alloc_host

SLOT = 64 * 1024
SLOTS = 4096
ROWS = 16
KINDS = ("none", "xxh3", "copy", "aes in place", "aes out of place")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="a directory on a file system with O_DIRECT")
    p.add_argument("--ops", type=int, default=3000, help="slots read per case (3000)")
    a = p.parse_args()
    fd, path = -1, tempfile.mktemp(prefix=".probe-seal-", dir=a.dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        buf = alloc_host(SLOT * ROWS + 4096, 4096)  # + room for the tag after the last row
        mv = memoryview(buf.numpy())
        for i in range(SLOTS // ROWS):  # written in full: reads hit allocated blocks
            os.pwritev(fd, [mv[: SLOT * ROWS]], i * SLOT * ROWS)
        aead, nonce = AESGCM(os.urandom(16)), os.urandom(12)
        sealed = bytearray(SLOT + 16)
        aead.encrypt_into(nonce, bytes(SLOT), b"slot", sealed)
        out = memoryview(alloc_host(SLOT, 4096).numpy())
        rng = np.random.default_rng(0)
        print(f"probe_seal_per_slot: {a.ops} random {SLOT // 1024} KiB O_DIRECT reads per case in {a.dir}")
        for rows in (1, ROWS):
            for kind in KINDS:
                t_io = t_after = 0.0
                c0 = time.process_time()
                for k in range(a.ops):
                    row = mv[(k % rows) * SLOT : (k % rows + 1) * SLOT + 16]
                    t0 = time.perf_counter()
                    os.preadv(fd, [row[:SLOT]], int(rng.integers(SLOTS)) * SLOT)
                    t1 = time.perf_counter()
                    if kind == "xxh3":
                        xxhash.xxh3_64_intdigest(row[:SLOT])
                    elif kind != "none":
                        row[:] = sealed
                        if kind == "aes in place":
                            aead.decrypt_into(nonce, row, b"slot", row[:SLOT])
                        elif kind == "aes out of place":
                            aead.decrypt_into(nonce, row, b"slot", out)
                    t_io += t1 - t0
                    t_after += time.perf_counter() - t1
                cpu = time.process_time() - c0
                print(f"{kind:<17} rows {rows:>2}: preadv {t_io / a.ops * 1e6:6.1f} us   after it "
                      f"{t_after / a.ops * 1e6:6.1f} us   process CPU {cpu / a.ops * 1e6:6.1f} us per slot")
        for size in (SLOT, 2 * 2**20):  # the cipher alone, in cache: per-call cost against bytes
            src, dst = bytearray(size), bytearray(size + 16)
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                aead.encrypt_into(nonce, src, b"slot", dst)
                calls += 1
            dt = (time.perf_counter() - t0) / calls
            print(f"encrypt_into {size // 1024:>5} KiB alone: {dt * 1e6:7.1f} us a call, {size / dt / 2**30:5.2f} GiB/s")
    finally:
        if fd >= 0:
            os.close(fd)
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
