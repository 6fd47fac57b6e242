"""The native core against its reference, the Python path: same jobs, same faults, same everything.

Hypothesis draws a program (stores and loads of blocks to slots) and a fault schedule
(the Nth ``pwritev``/``preadv`` fails, comes short, lies, or flips a bit), and runs it on
a fresh backend once per path, job by job. Both must give the same job results, failed
store slots, load errors, failure counts by cause, blocks and bytes counted, blocks
delivered, file calls (which call, at which offset, of how many bytes) and, with no
seal, the same bytes on disk. One IO thread per lane, each job waited for before the
next: the schedule then means the same calls on both paths.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults import Fault, FaultyOsCalls
from kvoffload import DiskBackend
from kvoffload import metrics as m
from kvoffload.device import CpuDevice, HostDevice, alloc_host

BLOCKS, SLOTS, BLOCK = 8, 12, 4096
FAULTS = {
    "error": lambda: Fault.error(5),
    "short": lambda: Fault.short(0.5),
    "lie": lambda: Fault.lie(),
    "bitflip": lambda: Fault.bitflip(byte=BLOCK + 100, bit=2),
}


@st.composite
def programs(draw):
    jobs = []
    for _ in range(draw(st.integers(1, 6))):
        is_store = draw(st.booleans())
        n = draw(st.integers(1, 5))
        blocks = draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
        slots = draw(st.lists(st.integers(0, SLOTS - 1), min_size=n, max_size=n, unique=True))
        jobs.append((is_store, blocks, slots))
    kinds = {"pwritev": ["error", "short", "lie"], "preadv": ["error", "short", "bitflip"]}
    faults = draw(st.lists(st.sampled_from(["pwritev", "preadv"]).flatmap(
        lambda c: st.tuples(st.just(c), st.integers(1, 10), st.sampled_from(kinds[c]))),
        max_size=3, unique_by=lambda f: f[:2]))
    return jobs, faults


class Recording(FaultyOsCalls):
    """FaultyOsCalls that logs every data call: (call, offset, bytes asked, result)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        for call in ("pwritev", "preadv"):
            self.after(call, self._record)

    def _record(self, info) -> None:
        fd, bufs, offset = info.args
        self.log.append((info.call, offset, sum(len(b) for b in bufs),
                         info.result if info.error is None else type(info.error).__name__))


def aligned(t: torch.Tensor) -> torch.Tensor:
    out = alloc_host(t.numel(), 4096).view(torch.int8).view(t.shape)
    out.copy_(t)
    return out


def run(tmp_path, io_path: str, device: str, seal: str, jobs, faults) -> dict:
    host = device != "staged"
    gen = torch.Generator().manual_seed(0)
    # Host blocks 4096-aligned, so a direct lane is one on both paths (the allocator's own is 64 B).
    caches = ({"blocks": aligned(torch.randint(-128, 128, (BLOCKS, BLOCK), dtype=torch.int8, generator=gen))} if host else
              {f"layer{i}": torch.randint(-128, 128, (BLOCKS, BLOCK // 2), dtype=torch.int8, generator=gen)
               for i in range(2)})
    osc = Recording()
    for call, n, kind in faults:
        osc.fail_nth(call, n, FAULTS[kind]())
    d = tmp_path / io_path
    d.mkdir()
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(d / "kv.bin"), SLOTS, BLOCK, io_threads=1, report_load_errors=True,
           encrypt=seal == "aes-gcm", checksums=False, os_calls=osc, native_io=io_path == "native",
           device_impl=CpuDevice() if not host else HostDevice(direct_io=device == "direct"))
    out: dict = {"jobs": []}
    try:
        assert b.stats()["io_path"] == io_path
        out["direct"] = b.stats()["direct_io"]
        assert out["direct"]["load"] == (device == "direct" and b.files[0].direct), out["direct"]
        ev: list = []
        for i, (is_store, blocks, slots) in enumerate(jobs):
            if not is_store:  # what a failed load leaves is compared too
                for v in caches.values():
                    v[blocks] = 3
            b.launch_copy(blocks if is_store else slots, slots if is_store else blocks, is_store, i, ev)
            assert ev[-1][1].wait(10)
            out["jobs"].append((ev[-1][1].ok, sorted(b.get_failed_store_slots()),
                                sorted(b.get_block_ids_with_load_errors()),
                                {k: v.clone() for k, v in caches.items()} if not is_store else None))
        p = b.take_metrics() or {"data": {}}
        out["metrics"] = {name: p["data"].get(name) for name in (m.BLOCKS, m.BYTES, m.FAILED)}
        out["stats"] = {k: b.stats()[k] for k in ("bytes_written", "bytes_read")}
        f = b.files[0]
        with open(f"/proc/self/fd/{f.fd}", "rb") as fh:
            out["disk"] = fh.read() if seal == "off" else None
    finally:
        b.shutdown()
    out["calls"] = osc.log
    return out


def same(a: dict, b: dict) -> None:
    assert a["direct"] == b["direct"]
    assert a["calls"] == b["calls"], "the file calls differ"
    for i, (x, y) in enumerate(zip(a["jobs"], b["jobs"])):
        assert x[:3] == y[:3], f"job {i}: (ok, failed store slots, load errors) differ"
        if x[3] is not None:
            assert all(torch.equal(x[3][k], y[3][k]) for k in x[3]), f"job {i}: the blocks delivered differ"
    assert a["metrics"] == b["metrics"] and a["stats"] == b["stats"]
    assert a["disk"] == b["disk"], "the bytes on disk differ"


@pytest.mark.faults
@pytest.mark.parametrize("seal", ["aes-gcm", "off"])
@pytest.mark.parametrize("device", ["staged", "host", "direct"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(program=programs())
def test_both_paths_give_the_same_outcomes(tmp_path_factory, native_core, device, seal, program):
    jobs, faults = program
    tmp = tmp_path_factory.mktemp("diff")
    native = run(tmp, "native", device, seal, jobs, faults)
    python = run(tmp, "python", device, seal, jobs, faults)
    same(native, python)


def test_the_comparison_sees_a_difference(tmp_path, native_core):
    # The checker itself: one fault on one side only must be told apart.
    jobs = [(True, [0, 1], [0, 1]), (False, [0, 1], [0, 1])]
    a = run(tmp_path, "native", "staged", "off", jobs, [])
    b = run(tmp_path, "python", "staged", "off", jobs, [("preadv", 1, "error")])
    with pytest.raises(AssertionError):
        same(a, b)
    assert np.array_equal(np.frombuffer(a["disk"], np.uint8), np.frombuffer(b["disk"], np.uint8))
