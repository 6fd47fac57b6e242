"""How a slot file's first stores compare with later ones, for each way of making the file.

ext4 and XFS hand `posix_fallocate`d space out as unwritten extents: the first write into
each converts it (a journalled metadata change), so a fresh slot file's first stores run
slower than rewrites. This probe makes a file of --gib GiB in --dir each way, then writes it
twice with O_DIRECT, 2 MiB a call, from --threads threads (each its own share of the file),
and prints the start-up cost of each way and the first and second passes' rates:

- ``fallocate``: posix_fallocate (kvoffload's default): reserved, unwritten extents;
- ``sparse``: ftruncate only: blocks allocated by the first write itself;
- ``written``: fallocate, then the whole file written once with zeros before use (what a
  start-up prefill would do): every extent written, at the price of a full write.

    python scripts/probe_first_write.py --dir D [--gib 4] [--threads 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time

CHUNK = 2 << 20


def write_pass(fd: int, size: int, threads: int) -> float:
    """Seconds to write [0, size) once, O_DIRECT, CHUNK a call, split over ``threads``."""
    per = size // threads

    def body(k: int) -> None:
        buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
        buf.write(os.urandom(4096) * (CHUNK // 4096))
        for off in range(k * per, (k + 1) * per, CHUNK):
            os.pwritev(fd, [buf], off)

    ts = [threading.Thread(target=body, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def one(directory: str, way: str, size: int, threads: int) -> tuple[float, float, float]:
    path = os.path.join(directory, f".probe-{way}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        if way == "sparse":
            os.ftruncate(fd, size)
        else:
            os.posix_fallocate(fd, 0, size)
        if way == "written":
            write_pass(fd, size, threads)
            os.fdatasync(fd)
        setup = time.perf_counter() - t0
        first = write_pass(fd, size, threads)
        second = write_pass(fd, size, threads)
        return setup, size / first / 2**30, size / second / 2**30
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    size = int(a.gib * 2**30) // (CHUNK * a.threads) * CHUNK * a.threads
    got: dict[str, list[tuple[float, float, float]]] = {}
    for r in range(a.rounds):  # the ways interleaved, in rotating order
        ways = ["fallocate", "sparse", "written"]
        for way in ways[r % 3:] + ways[: r % 3]:
            got.setdefault(way, []).append(one(a.dir, way, size, a.threads))
    print(f"{a.dir}: {size / 2**30:.2f} GiB, {a.threads} threads, {CHUNK >> 20} MiB O_DIRECT writes, {a.rounds} rounds")
    print(f"{'way':<10} {'start-up s':>10} {'first GiB/s':>12} {'second GiB/s':>13} {'first/second':>13}")
    for way, rows in got.items():
        setup, first, second = (statistics.median(x) for x in zip(*rows))
        ratios = [f / s for _, f, s in rows]
        print(f"{way:<10} {setup:10.2f} {first:12.2f} {second:13.2f} {statistics.median(ratios):8.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
