"""Which pass order loads a CPU-tier row faster, and whether the in-place open releases the GIL.

Two loads of the same sealed chunks into the rows of a page-aligned primary (anonymous
shared memory, as vLLM's CPU tier), by ``--threads`` threads, each taking units of
``--unit-chunks`` consecutive slots into random rows of its own:

  direct   read straight into the rows, then ``open_block`` each in place (the tier's
           direct lane)
  staged   read into the thread's staging, then ``open`` each into its row (the tier's
           staging path for host blocks)

The read is an O_DIRECT ``preadv`` from a file in ``--dir``, or, without ``--dir``, a
numpy copy from a sealed buffer of ``--gib`` (what a RAM drive's read is: a CPU copy,
here without the loop device's kernel threads and their share of the cores). After one
untimed round of each, the cases alternate for ``--rounds`` rounds; GiB/s and process
CPU s/GiB per round (a loop device's copies run in kernel threads, not counted).

Before them, the cipher alone in cache: ``open_block`` (cryptography's streaming GCM
decryptor) against ``open`` into a row (``AESGCM.decrypt_into``) on 1 and 2 threads, and
a pure-Python counter's rate beside one thread of each (near its rate alone: the GIL is
released). ``PYTHONPATH=. python3 scripts/probe_tier_direct.py [--dir /some/ext4/dir]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import threading
import time
from typing import Optional

import numpy as np

from kvoffload.device import alloc_host
from kvoffload.slot_seal import SEALS

GiB, MiB = 2**30, 2**20


def cipher_alone(seal, chunk: int, seconds: float) -> None:
    rng = np.random.default_rng(1)
    row = memoryview(bytearray(chunk + 16))
    row[:chunk] = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes()
    record = seal.seal(0, row, chunk)
    sealed = np.frombuffer(bytes(row[:chunk]), np.uint8)

    def one(kind: str, stop: threading.Event, count: list) -> None:
        staging = memoryview(bytearray(chunk + 16))
        block = memoryview(bytearray(chunk))
        # Both copy the ciphertext first, standing in for the read: into the row (then
        # opened in place), or into staging (then opened into the row).
        while not stop.is_set():
            if kind == "open_block":
                np.copyto(np.frombuffer(block, np.uint8), sealed)
                assert seal.open_block(0, block, record)
            else:
                np.copyto(np.frombuffer(staging[:chunk], np.uint8), sealed)
                assert seal.open(0, staging, chunk, record, block)
            count.append(1)

    def counter(stop: threading.Event, out: list) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1000 == 0:
                out.extend(range(1000))

    def run(kinds: list[str]) -> list[float]:
        stop, counts = threading.Event(), [[] for _ in kinds]
        ts = [threading.Thread(target=counter if k == "counter" else one, args=(stop, c) if k == "counter"
                               else (k, stop, c)) for k, c in zip(kinds, counts)]
        for t in ts:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in ts:
            t.join()
        return [len(c) / seconds if k == "counter" else len(c) * chunk / seconds / GiB
                for k, c in zip(kinds, counts)]

    alone = run(["counter"])[0]
    during_one_call(seal)
    print(f"cipher alone, {chunk // 1024} KiB in cache, each after a copy of the ciphertext (the read's stand-in):")
    for kind in ("open_block", "open into row"):
        one_t, two_t = sum(run([kind])), sum(run([kind, kind]))
        beside = run([kind, "counter"])[1]
        print(f"  {kind:<14} 1 thread {one_t:6.2f} GiB/s, 2 threads {two_t:6.2f}; a Python counter beside one "
              f"thread {beside / 1e6:5.2f} M/s (alone {alone / 1e6:5.2f})")


def during_one_call(seal, size: int = 256 * MiB) -> None:
    """How far a pure-Python counter gets while another thread is inside one call on ``size``
    bytes: only in the switch intervals around it if the call holds the GIL (``sum`` over 32 MiB,
    a C loop, for reference), as far as the cores allow if it releases it. Needs no free core,
    unlike a 1-against-2-thread rate."""
    row = memoryview(bytearray(size + 16))
    record = seal.seal(0, row, size)
    sealed = bytes(row[:size])
    block = memoryview(bytearray(size))
    calls = {
        "open_block": lambda: seal.open_block(0, block, record),
        "open into row": lambda: seal.open(0, row, size, record, block),
        "sum() of 32 MiB": lambda: sum(block[: 32 * MiB]),
    }
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the GIL changes hands within 0.1 ms around the calls
    print(f"a Python counter while another thread is inside one {size // MiB} MiB call:")
    for name, call in calls.items():
        block[:] = sealed  # open_block decrypts in place: give it the ciphertext again
        stop, count, inside = threading.Event(), [0], threading.Event()

        def counter() -> None:
            inside.wait()
            while not stop.is_set():
                count[0] += 1

        t = threading.Thread(target=counter)
        t.start()
        inside.set()
        time.sleep(0.01)  # the counter is running
        c0, t0 = count[0], time.perf_counter()
        call()
        dt, counted = time.perf_counter() - t0, count[0] - c0
        stop.set()
        t.join()
        print(f"  {name:<15} {dt * 1e3:6.1f} ms, counter +{counted} ({counted / dt / 1e6:.2f} M/s)")
    sys.setswitchinterval(interval)


class Source:
    """Where the sealed slots are read from: an O_DIRECT file, or a buffer in memory."""

    def __init__(self, directory: Optional[str], nbytes: int) -> None:
        self.fd, self.mem = -1, None
        if directory is None:
            self.mem = mmap.mmap(-1, nbytes)
            self.buf = np.frombuffer(self.mem, np.uint8)
            return
        path = tempfile.mktemp(prefix=".probe-tier-direct-", dir=directory)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        os.unlink(path)  # nothing named is left, whatever happens next

    def write(self, data: memoryview, offset: int) -> None:
        if self.mem is None:
            os.pwritev(self.fd, [data], offset)
        else:
            self.buf[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, dst: list[memoryview], offset: int) -> int:
        if self.mem is None:
            return os.preadv(self.fd, dst, offset)
        for d in dst:  # numpy's copy releases the GIL, as a read does
            np.copyto(np.frombuffer(d, np.uint8), self.buf[offset : offset + len(d)])
            offset += len(d)
        return sum(len(d) for d in dst)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        if self.mem is not None:
            del self.buf
            self.mem.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="a directory on a file system with O_DIRECT (default: read from memory)")
    p.add_argument("--gib", type=float, default=1.0, help="GiB of sealed chunks (1)")
    p.add_argument("--primary-gib", type=float, default=0.5, help="GiB of primary rows (0.5)")
    p.add_argument("--chunk-mib", type=float, default=2.0, help="MiB a chunk (2)")
    p.add_argument("--unit-chunks", type=int, default=2, help="chunks one read moves (2: the tier's 4 MiB units)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seal", choices=sorted(SEALS), default="aes-gcm")
    p.add_argument("--cipher-seconds", type=float, default=1.0, help="seconds per cipher-alone case (0: skip)")
    a = p.parse_args()
    chunk = int(a.chunk_mib * MiB)
    seal = SEALS[a.seal]()
    if a.cipher_seconds > 0 and a.seal == "aes-gcm":
        cipher_alone(seal, chunk, a.cipher_seconds)
    n = int(a.gib * GiB) // chunk // a.unit_chunks * a.unit_chunks
    rows_n = int(a.primary_gib * GiB) // chunk
    mem = mmap.mmap(-1, rows_n * chunk)
    view = memoryview(mem)
    np.frombuffer(mem, np.uint8).fill(1)  # fault every page in now, not in the first timed round
    src = Source(a.dir, n * chunk)
    try:
        mv = memoryview(alloc_host(chunk + 16, 4096).numpy())
        rng = np.random.default_rng(0)
        records, plains = [], []
        for s in range(n):  # every slot sealed for real, so every open checks and succeeds
            mv[:chunk] = rng.integers(0, 256, chunk, dtype=np.uint8).tobytes() if s < 64 else plains[s % 64]
            if s < 64:
                plains.append(bytes(mv[:chunk]))
            records.append(seal.seal(s, mv, chunk))
            src.write(mv[:chunk], s * chunk)
        print(f"probe_tier_direct: {n} chunks of {chunk // 1024} KiB ({n * chunk / GiB:.2f} GiB, {a.seal}) "
              f"{'in ' + a.dir if a.dir else 'from memory'}, {rows_n} primary rows, {a.threads} threads, "
              f"{a.unit_chunks} chunks a read")
        results: dict[str, list[tuple[float, float]]] = {"direct": [], "staged": []}
        for kind in results:  # untimed: the first reads of the file run slower
            load_all(kind, src, view, rows_n, chunk, n, a, seal, records, -1)
        for r in range(a.rounds):
            for kind in (("direct", "staged") if r % 2 == 0 else ("staged", "direct")):
                results[kind].append(load_all(kind, src, view, rows_n, chunk, n, a, seal, records, r))
        # Every row holds a checked plaintext: compare one against what was sealed.
        assert bytes(view[:chunk]) in plains, "a row holds bytes that were never sealed"
        for kind, got in results.items():
            rates = ", ".join(f"{g:.2f}" for g, _ in got)
            cpu = ", ".join(f"{c:.3f}" for _, c in got)
            print(f"{kind:<7} GiB/s per round: {rates}; median {np.median([g for g, _ in got]):.2f} "
                  f"(process CPU s/GiB {cpu})")
    finally:
        src.close()
        view.release()
        mem.close()
    return 0


def load_all(kind: str, src: Source, view: memoryview, rows_n: int, chunk: int, n: int, a, seal, records,
             seed: int) -> tuple[float, float]:
    """Load every slot once, in units of consecutive slots in random order, into random rows."""
    units = list(range(0, n, a.unit_chunks))
    np.random.default_rng(seed + 1).shuffle(units)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            load_units(t)
        except BaseException as e:  # re-raised below: a failed open must fail the probe
            errors.append(e)

    def load_units(t: int) -> None:
        staging = memoryview(alloc_host(a.unit_chunks * chunk + 16, 4096).numpy())
        rng = np.random.default_rng((seed + 1) * 100 + t)
        mine = np.arange(t, rows_n, a.threads)  # distinct rows per thread, as jobs' rows are
        want = a.unit_chunks * chunk
        while True:
            with lock:
                if not units:
                    return
                s0 = units.pop()
            slots = range(s0, s0 + a.unit_chunks)
            dst = [view[r * chunk : (r + 1) * chunk] for r in rng.choice(mine, a.unit_chunks, replace=False)]
            if kind == "direct":
                assert src.read(dst, s0 * chunk) == want
                for s, d in zip(slots, dst):
                    assert seal.open_block(s, d, records[s])
            else:
                assert src.read([staging[:want]], s0 * chunk) == want
                for j, (s, d) in enumerate(zip(slots, dst)):
                    assert seal.open(s, staging[j * chunk :], chunk, records[s], d)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(a.threads)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if errors:
        raise errors[0]
    return n * chunk / GiB / dt, cpu / (n * chunk / GiB)


if __name__ == "__main__":
    sys.exit(main())
