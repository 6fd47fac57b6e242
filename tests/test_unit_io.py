"""unit_io: a whole unit's file IO and seals in one GIL-free call, equal to the Python path.

The library is built from kvoffload/unit_io.c on first use (the system C compiler and
OpenSSL's libcrypto); where it cannot be, these tests skip with the reason, and the
backend keeps its Python path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from faults import Fault, FaultyOsCalls
from kvoffload import unit_io
from kvoffload.os_calls import OsCalls

LIB = unit_io.library()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"unit_io unavailable: {unit_io.why_unavailable()}")

SLOT, PAYLOAD = 8192, 5000  # a padded slot, as under O_DIRECT


class Unit:
    """n slots of random payloads at the given file slots, with staging rows or host rows."""

    def __init__(self, tmp_path, slots: list[int], in_place: bool = False, seed: int = 0,
                 slot: int = SLOT, payload: int = PAYLOAD) -> None:
        self.n, self.slot, self.payload = len(slots), slot, payload
        self.fd = os.open(tmp_path / "slots.bin", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, slot * (max(slots) + 2))
        self.key = os.urandom(16)
        self.src = np.random.default_rng(seed).integers(0, 256, (self.n, payload), dtype=np.uint8)
        self.staging = np.zeros((self.n, slot), np.uint8)
        self.rows = np.zeros((self.n, slot), np.uint8)  # host rows, slot-sized (direct IO)
        self.a = unit_io.UnitArrays.make(max(64, self.n))
        self.a.file_off[: self.n] = [s * slot for s in slots]
        self.a.nonce[: self.n] = np.arange(100, 100 + self.n)
        self.a.aad[: self.n] = slots
        self.in_place = in_place

    def store(self, osc: OsCalls = OsCalls(), seal: int = unit_io.SEAL_AES_GCM, copy=None) -> np.ndarray:
        a, n = self.a, self.n
        a.buf[:n] = [self.staging[j].ctypes.data for j in range(n)]
        a.payload[:n] = [self.src[j].ctypes.data for j in range(n)]
        unit_io.run_unit(LIB, True, unit_io.io_functions(osc), self.fd, n, a, self.slot, self.payload, seal,
                         self.key, copy)
        return a.status[:n].copy()

    def load(self, osc: OsCalls = OsCalls(), seal: int = unit_io.SEAL_AES_GCM, copy=None
             ) -> tuple[np.ndarray, np.ndarray]:
        a, n = self.a, self.n
        self.rows[:] = 0x5A  # what the rows held before: must never survive a failed slot
        if self.in_place:
            a.buf[:n] = a.payload[:n] = [self.rows[j].ctypes.data for j in range(n)]
        else:
            self.staging[:] = 0
            a.buf[:n] = [self.staging[j].ctypes.data for j in range(n)]
            a.payload[:n] = [self.rows[j].ctypes.data for j in range(n)]
        unit_io.run_unit(LIB, False, unit_io.io_functions(osc), self.fd, n, a, self.slot, self.payload, seal,
                         self.key, copy)
        return a.status[:n].copy(), self.rows[:, : self.payload]


def test_seals_open_with_aesgcm_and_back(tmp_path):
    # Goal: the C seal is AesGcmSeal's (nonce, associated data, tag), so records sealed
    # by either path open on the other, and the file holds ciphertext only.
    u = Unit(tmp_path, [3, 4, 5, 9])
    assert (u.store() == unit_io.STATUS_OK).all()
    aead = AESGCM(u.key)
    for j in range(u.n):
        ct = os.pread(u.fd, SLOT, int(u.a.file_off[j]))
        assert ct[:PAYLOAD] != u.src[j].tobytes() and ct[PAYLOAD:] == bytes(SLOT - PAYLOAD)
        pt = aead.decrypt(int(u.a.nonce[j]).to_bytes(12, "little"), ct[:PAYLOAD] + u.a.tag[j].tobytes(),
                          int(u.a.aad[j]).to_bytes(8, "little"))
        assert pt == u.src[j].tobytes()
    # Sealed in Python, opened in C.
    nonce = 7
    blob = aead.encrypt(nonce.to_bytes(12, "little"), u.src[1].tobytes(), (4).to_bytes(8, "little"))
    os.pwrite(u.fd, blob[:PAYLOAD], 4 * SLOT)
    u.a.nonce[1], u.a.tag[1] = nonce, np.frombuffer(blob[PAYLOAD:], np.uint8)
    status, rows = u.load()
    assert (status == unit_io.STATUS_OK).all() and (rows == u.src).all()


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "host-row"])
def test_a_slot_failing_its_check_leaves_zeros_not_bytes(tmp_path, in_place):
    u = Unit(tmp_path, [0, 1, 2, 3], in_place=in_place)
    u.store()
    os.pwrite(u.fd, bytes([os.pread(u.fd, 1, 2 * SLOT + 10)[0] ^ 1]), 2 * SLOT + 10)  # a bit on disk
    u.a.tag[0, 3] ^= 0x80  # a wrong record
    status, rows = u.load()
    assert status.tolist() == [unit_io.STATUS_INTEGRITY, 0, unit_io.STATUS_INTEGRITY, 0]
    assert not rows[0].any() and not rows[2].any()
    assert (rows[1] == u.src[1]).all() and (rows[3] == u.src[3]).all()


def test_a_failed_run_keeps_what_moved_and_retries_slot_by_slot(tmp_path):
    # Goal: the Python path's rule. Slots 0-3 are one run: its first read fails (EIO),
    # each slot is then read alone and all four load.
    u = Unit(tmp_path, [0, 1, 2, 3])
    u.store()
    osc = FaultyOsCalls().fail_nth("preadv", 1)
    status, rows = u.load(osc)
    assert (status == 0).all() and (rows == u.src).all()
    assert osc.calls["preadv"] == 1 + 4


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "host-row"])
def test_short_and_failed_reads_fail_only_their_slots(tmp_path, in_place):
    u = Unit(tmp_path, [0, 1, 2, 5], in_place=in_place)
    u.store()
    # Every read moves half: the run of 3 moves 1.5 slots (slot 0 whole), then 1 and 2
    # come short alone; slot 5 (its own run) comes short too.
    status, rows = u.load(FaultyOsCalls().fail_from("preadv", 1, Fault.short(0.5)))
    assert status.tolist() == [0] + [unit_io.STATUS_SHORT] * 3
    assert (rows[0] == u.src[0]).all() and not rows[1:].any()
    status, rows = u.load(FaultyOsCalls().fail_from("preadv", 1, Fault.error(errno.EIO)))
    assert status.tolist() == [unit_io.STATUS_IO_ERROR] * 4 and (u.a.err[:4] == errno.EIO).all()
    assert not rows.any()


def test_bit_flips_and_lying_writes_are_caught_by_the_tag(tmp_path):
    u = Unit(tmp_path, [0, 1, 2, 3])
    osc = FaultyOsCalls().fail_nth("pwritev", 1, Fault.lie())  # reports the run written, writes nothing
    assert (u.store(osc) == 0).all()  # nothing can tell at write time...
    status, rows = u.load()
    assert (status == unit_io.STATUS_INTEGRITY).all() and not rows.any()  # ...the tag does on load
    u.store()
    status, rows = u.load(FaultyOsCalls().fail_nth("preadv", 1, Fault.bitflip(byte=SLOT + 7, bit=3)))
    assert status.tolist() == [0, unit_io.STATUS_INTEGRITY, 0, 0] and not rows[1].any()


def test_failed_writes_fail_their_slots(tmp_path):
    u = Unit(tmp_path, [0, 1, 2, 7])
    status = u.store(FaultyOsCalls().fail_from("pwritev", 1, Fault.short(0.5)))
    assert status.tolist() == [0] + [unit_io.STATUS_SHORT] * 3
    status = u.store(FaultyOsCalls().fail_from("pwritev", 1, Fault.error(errno.ENOSPC)))
    assert (status == unit_io.STATUS_IO_ERROR).all() and (u.a.err[:4] == errno.ENOSPC).all()


def test_an_exception_in_the_seam_is_raised_after_the_unit(tmp_path):
    # Goal: what the seam raises that is not an OSError (a harness bug, a device
    # failure hook) is not lost in C: it fails the unit's calls and comes out after.
    u = Unit(tmp_path, [0, 1])
    u.store()
    osc = FaultyOsCalls()

    def boom(info):
        raise RuntimeError("from the seam")

    osc.before("preadv", boom)
    with pytest.raises(RuntimeError, match="from the seam"):
        u.load(osc)
    status, rows = u.load()  # the next unit on this thread starts clean
    assert (status == 0).all() and (rows == u.src).all()


def test_off_seal_copies_without_checks(tmp_path):
    u = Unit(tmp_path, [0, 1, 2])
    assert (u.store(seal=unit_io.SEAL_OFF) == 0).all()
    assert os.pread(u.fd, PAYLOAD, SLOT) == u.src[1].tobytes()  # plaintext on disk, by choice
    status, rows = u.load(seal=unit_io.SEAL_OFF)
    assert (status == 0).all() and (rows == u.src).all()


class StagingCopy:
    """A store's device copy as unit_io.c launches it: callbacks stand in for the
    driver's batch copy (here: the payloads land in the source rows), event record and
    wait; ``rc`` fails the batch with that error code."""

    BATCH = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
    EVENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def __init__(self, u: Unit, rc: int = 0) -> None:
        self.u, self.rc, self.calls = u, rc, []
        self.landed = u.src.copy()
        u.src[:] = 0  # until the copy, the source holds no KV yet
        self.fns = (self.BATCH(self.batch), self.RECORD(self.record), self.EVENT(self.wait))  # kept alive
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in self.fns]
        self.c = unit_io.DeviceCopy(batch=addr[0], record=addr[1], wait=addr[2], count=1, event=1234)

    def batch(self, *args) -> int:
        self.calls.append("batch")
        if self.rc == 0:
            self.u.src[:] = self.landed
        return self.rc

    def record(self, event, stream) -> int:
        self.calls.append("record")
        return 0

    def wait(self, event) -> int:
        assert event == 1234
        self.calls.append("wait")
        return 0


def test_a_store_makes_and_waits_for_its_device_copy_inside_the_call(tmp_path):
    # Goal: a store's copy into staging is launched, recorded and waited for in the
    # same GIL-free call, once, before any slot is sealed: what is written is what the
    # copy brought.
    u = Unit(tmp_path, [0, 1, 2])
    copy = StagingCopy(u)
    assert (u.store(copy=copy.c) == 0).all()
    assert copy.calls == ["batch", "record", "wait"]
    status, rows = u.load()
    assert (status == 0).all() and (rows == copy.landed).all() and rows.any()


def test_a_failed_device_copy_fails_the_unit_before_any_io(tmp_path):
    # Goal: the device failed (the batch's error code): the call raises, nothing was
    # sealed or written (the file's slots are still zeros), and a load does no IO.
    u = Unit(tmp_path, [0, 1])
    osc = FaultyOsCalls()
    copy = StagingCopy(u, rc=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(unit_io.DeviceCopyError, match="CUresult 700"):
        u.store(osc, copy=copy.c)
    assert copy.calls == ["batch"] and osc.calls["pwritev"] == 0
    assert os.pread(u.fd, 2 * SLOT, 0) == bytes(2 * SLOT)
    with pytest.raises(unit_io.DeviceCopyError):
        u.load(osc, copy=copy.c)
    assert osc.calls["preadv"] == 0


def test_the_libcrypto_in_use_is_named():
    # Its AES-GCM sets the native path's CPU per byte; the start-up line names it.
    assert unit_io.crypto_version().startswith("OpenSSL ")


def test_the_unit_runs_without_the_gil(tmp_path):
    # Goal: a Python thread keeps running while one unit is in C: 64 slots of 1 MiB
    # sealed and written in one call, far longer than the 5 ms switch interval. Were the
    # GIL held for the call, the thread would stall for all of it.
    u = Unit(tmp_path, list(range(64)), slot=1 << 20, payload=1 << 20)
    stop, ticks = threading.Event(), []

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)  # a bare loop would hold the GIL for whole switch intervals

    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        u.store()  # one call
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    during = [x for x in ticks if t0 <= x <= t1]
    gaps = np.diff([t0, *during, t1])
    assert t1 - t0 > 0.04, "the unit was too quick to tell"
    assert gaps.max() < 0.5 * (t1 - t0), (gaps.max(), t1 - t0)


def test_the_cache_directory_must_be_private(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="not a private directory"):
        unit_io._private_dir(shared)
    unit_io._private_dir(tmp_path / "fresh")
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700


# -- the backend's lanes on the native path ---------------------------------------


def _backend(tmp_path, monkeypatch=None, **kw):
    import torch

    from kvoffload.disk_backend import DiskBackend
    from kvoffload.device import random_caches

    caches = random_caches("cpu", 16, [4096, 1000])
    b = DiskBackend()
    b.init(caches, torch.device("cpu"), None, None, str(tmp_path / "kv.bin"), 32, 5096, report_load_errors=True,
           capacity_bytes=32 * 8192,
           **kw)
    return b, caches


def _round_trip(b, caches) -> bool:
    import torch

    want = {k: v.clone() for k, v in caches.items()}
    ev: list = []
    b.launch_copy(list(range(16)), list(range(16, 32)), True, 0, ev)
    ev[-1][1].synchronize()
    for v in caches.values():
        v.zero_()
    b.launch_copy(list(range(16, 32)), list(range(16)), False, 0, ev)
    ev[-1][1].synchronize()
    return all(torch.equal(caches[k], want[k]) for k in caches) and not b.get_block_ids_with_load_errors()


@pytest.mark.parametrize("env, kw, native", [
    ("", {}, True), ("auto", {}, True), ("off", {}, False), ("on", {}, True),
    ("", {"native_io": False}, False), ("off", {"native_io": True}, True),
    ("", {"encrypt": False, "checksums": False}, True),  # no checks: the native copy
    ("", {"encrypt": False}, False),  # xxh3 has no native seal
])
def test_the_backend_takes_the_native_path_where_asked_and_able(tmp_path, monkeypatch, env, kw, native):
    monkeypatch.setenv("KVOFFLOAD_NATIVE_IO", env)
    b, caches = _backend(tmp_path, **kw)
    try:
        assert b.stats()["native_io"] is native
        assert _round_trip(b, caches)
    finally:
        b.shutdown()


def test_native_required_where_it_cannot_run_is_refused_at_init(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^native_io=True: no native xxh3 seal"):
        _backend(tmp_path, encrypt=False, native_io=True)
    monkeypatch.setenv("KVOFFLOAD_NATIVE_IO", "sometimes")
    with pytest.raises(ValueError, match=r"KVOFFLOAD_NATIVE_IO='sometimes': expected on, off or auto"):
        _backend(tmp_path)
    monkeypatch.setenv("KVOFFLOAD_NATIVE_IO", "on")
    with pytest.raises(ValueError, match=r"^native_io=True: no native xxh3 seal"):
        _backend(tmp_path, encrypt=False)
