"""What persistence costs: store throughput with ``persist`` on against off, and start-up time
over a large index. Prints two short tables (docs/vllm.md, "Persistence: what it costs").

``PYTHONPATH=. python3 scripts/bench_persist.py --dir D [--device cuda] [--pairs 5]``

- Stores: per pair, one backend per setting on D (2 MiB llama-like blocks, 64 x 32 KiB,
  AES-GCM, the default IO threads and unit), made in flipped order, ``--blocks`` blocks
  stored in jobs of ``--job-blocks`` (a vLLM step's worth) over every slot, timed from the
  first launch to the last completion after one untimed pass, ``--repeat`` timings per case
  (median kept), ``--pairs`` pairs. The persistent one also writes an index record per slot
  after its data write (buffered, not synced).
- Start-up: a pool of ``--startup-slots`` slots (4 KiB blocks, so the data file stays
  small) whose index holds a valid record in every slot, written directly; then the
  seconds of a whole ``DiskBackend.init`` on it (headers, locking, reading and checking
  every record, raising the epoch with its fdatasync, the records in memory) and, within
  it, of reading and checking the records alone (``persist.read_records``); and, beside it,
  the same init without persistence.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from kvoffload import cli_args
from kvoffload.device import random_caches, resolve_device
from kvoffload.disk_backend import DiskBackend
from kvoffload.os_calls import OsCalls
from kvoffload.persist import (INDEX_SUFFIX, RECORD_BYTES, RECORDS_OFFSET, Persist, pack_records,
                               read_header, read_records)

PROG = "scripts/bench_persist.py"
MiB, GiB = 1 << 20, 1 << 30
TENSORS = [32 * 1024] * 64  # 2 MiB a block
KEY = bytes(range(32))


def build_parser() -> cli_args.Parser:
    p = cli_args.Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=cli_args.Directory(), required=True, help="where the slot files go")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--blocks", type=cli_args.Integer(8), default=512, help="2 MiB blocks per store run (default 512)")
    p.add_argument("--job-blocks", type=cli_args.Integer(1), default=32, help="blocks per store job (default 32)")
    p.add_argument("--pairs", type=cli_args.Integer(1), default=5, help="on/off pairs (default 5)")
    p.add_argument("--repeat", type=cli_args.Integer(1), default=3, help="timings per case per pair (default 3)")
    p.add_argument("--startup-slots", type=cli_args.Integer(1), default=1 << 20,
                   help="slots of the start-up pool (default 1048576)")
    p.add_argument("--page-cache", action="store_true", help="page cache instead of O_DIRECT")
    return p


def store_rate(b: DiskBackend, blocks: int, job: int, first_slot: int, persistent: bool) -> float:
    """GiB/s of storing device blocks [0, blocks) to slots from ``first_slot``, in jobs of ``job``."""
    ev: list = []
    t0 = time.perf_counter()
    for i in range(0, blocks, job):
        ids = list(range(i, min(i + job, blocks)))
        keys = [(first_slot + j).to_bytes(8, "little") * 4 for j in ids] if persistent else None
        b.launch_copy(ids, [first_slot + j for j in ids], True, len(ev), ev, keys=keys)
    for _, e in ev:
        e.synchronize()
        assert e.ok, "a store failed"
    return blocks * sum(TENSORS) / (time.perf_counter() - t0) / GiB


def stores(a, device: torch.device) -> list[tuple[float, float]]:
    """(off, on) GiB/s per pair. Each pair makes both backends anew, in flipped order (on a
    virtual disk the file made first measured up to 25% faster, whichever it was), warms
    each once (first writes convert extents), then times them in flipped order."""
    caches = random_caches(device, a.blocks, TENSORS)
    pairs = []
    for p in range(a.pairs):
        order = ("off", "on") if p % 2 == 0 else ("on", "off")
        backends = {}
        try:
            for name in order:
                d = os.path.join(a.dir, f"store-{p}-{name}")
                os.makedirs(d, mode=0o700)
                b = DiskBackend()
                b.init(caches, device, None, None, os.path.join(d, "kv"), a.blocks, sum(TENSORS),
                       use_page_cache=a.page_cache, report_load_errors=True,
                       persist=Persist(KEY, {"bench": 1}) if name == "on" else None)
                backends[name] = b
                store_rate(b, a.blocks, a.job_blocks, 0, name == "on")
            rates = {name: statistics.median(store_rate(backends[name], a.blocks, a.job_blocks, 0, name == "on")
                                             for _ in range(a.repeat)) for name in reversed(order)}
            pairs.append((rates["off"], rates["on"]))
        finally:
            for b in backends.values():
                b.shutdown()
        for name in order:  # the kept pool's files too: the next pair starts from an empty disk
            d = os.path.join(a.dir, f"store-{p}-{name}")
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
    return pairs


def startup(a) -> tuple[float, float, int]:
    """(seconds of init on a full index, of reading and checking its records, blocks restored)."""
    d = os.path.join(a.dir, "startup")
    os.makedirs(d, mode=0o700)
    path = os.path.join(d, "kv")
    n, block = a.startup_slots, 4096
    caches = {"t": torch.zeros(1, block, dtype=torch.int8)}
    b = DiskBackend()  # creates the pool (data file and empty index)
    b.init(caches, "cpu", None, None, path, n, block, use_page_cache=True, persist=Persist(KEY, {"bench": 1}))
    b.shutdown()
    osc = OsCalls()
    fd = os.open(path + INDEX_SUFFIX, os.O_RDWR)
    try:
        _, keys = read_header(osc, fd, path + INDEX_SUFFIX, KEY)
        chunk = 1 << 16
        for s in range(0, n, chunk):  # a valid record in every slot, as a full pool's index holds
            local = np.arange(s, min(s + chunk, n))
            k = len(local)
            nonces = np.zeros((k, 12), np.uint8)
            nonces[:, :8] = local.astype("<u8").view(np.uint8).reshape(-1, 8)
            rec = pack_records(local, np.ones(k, np.uint64), local.astype(np.uint64) + 1, nonces,
                               np.zeros((k, 16), np.uint8),
                               [int(x).to_bytes(8, "little") * 4 for x in local], keys)
            os.pwrite(fd, rec.tobytes(), RECORDS_OFFSET + s * RECORD_BYTES)
        os.fsync(fd)
        t0 = time.perf_counter()
        fr = read_records(osc, fd, path + INDEX_SUFFIX, n, keys)
        check_s = time.perf_counter() - t0
        assert int(fr.valid.sum()) == n
    finally:
        os.close(fd)
    t0 = time.perf_counter()
    b = DiskBackend()
    b.init(caches, "cpu", None, None, path, n, block, use_page_cache=True, persist=Persist(KEY, {"bench": 1}))
    init_s = time.perf_counter() - t0
    restored = len(b.restored().slots)
    b.shutdown()
    t0 = time.perf_counter()  # the same pool without persistence: what any start-up costs
    b = DiskBackend()
    b.init(caches, "cpu", None, None, os.path.join(d, "plain"), n, block, use_page_cache=True)
    plain_s = time.perf_counter() - t0
    b.shutdown()
    return init_s, check_s, plain_s, restored


def main(argv: list[str] | None = None) -> int:
    return cli_args.main(PROG, lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    a = build_parser().parse_args(argv)
    try:
        device = resolve_device(a.device)
    except (RuntimeError, ValueError) as e:
        raise cli_args.UsageError(f"--device {a.device}: {e}") from None
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench-persist-") as tmp:
        a.dir = tmp
        pairs = stores(a, device)
        init_s, check_s, plain_s, restored = startup(a)
    ratios = [on / off for off, on in pairs]
    print(f"store throughput, {a.blocks} x 2 MiB blocks in jobs of {a.job_blocks}, {device}, "
          f"{'page cache' if a.page_cache else 'O_DIRECT'}, AES-GCM (GiB/s, median of {a.repeat} per case)")
    print("pair  persist off  persist on  on/off")
    for i, ((off, on), r) in enumerate(zip(pairs, ratios)):
        print(f"{i:>4}  {off:>11.2f}  {on:>10.2f}  {r:>6.3f}")
    print(f"on/off: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(f"start-up over {a.startup_slots} slots (every record valid): DiskBackend.init {init_s:.2f} s, of which "
          f"reading and checking the index {check_s:.2f} s; {restored} blocks restored; the same init without "
          f"persist {plain_s:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
