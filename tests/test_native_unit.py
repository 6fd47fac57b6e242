"""The native engine's unit functions (``native_engine/store_unit.c``, ``load_unit.c``), driven directly.

Each test fills a unit's arrays as the engine's workers do (``engine.c``'s ``prepare``) and
checks what one call does: seals that ``cryptography`` opens and the reverse, runs and
retries, what reaches the payloads when a slot fails, shutdown's gate, and the GIL. The
engines are held to one behaviour by ``test_native_differential.py``.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from faults import Fault, FaultyOsCalls
from kvoffload import native_engine
from kvoffload.os_calls import OsCalls, moved
from kvoffload.slot_seal import AesGcmSeal

SLOT, PAYLOAD = 8192, 5000  # a padded slot, as under O_DIRECT


@pytest.fixture
def core(native_core):
    return native_core


class UnitArrays:
    """One unit's arrays (``kvo_slots``) and ``kvo_unit``, as a worker fills them."""

    def __init__(self, core, rows: int, aad_bytes: int) -> None:
        ffi = core.ffi
        self.core, self.aad_bytes = core, aad_bytes
        self.file_off = np.zeros(rows, np.int64)
        self.buf = np.zeros(rows, np.uint64)
        self.payload = np.zeros(rows, np.uint64)
        self.nonce = np.zeros((rows, 12), np.uint8)
        self.aad = np.zeros((rows, aad_bytes), np.uint8)
        self.tag = np.zeros((rows, 16), np.uint8)
        self.status = np.zeros(rows, np.int32)
        self.err = np.zeros(rows, np.int32)
        self.slots = ffi.new("kvo_slots *")
        for name, field in ffi.typeof("kvo_slots").fields:
            setattr(self.slots, name, ffi.cast(field.type, getattr(self, name).ctypes.data))
        self.unit = ffi.new("kvo_unit *")

    def run(self, is_store: bool, n: int, fd: int, slot: int, payload: int, seal: int, key, osc: OsCalls,
            views: list, gate) -> None:
        """One call; a seam that is not the plain one is called back with ``views`` (the
        engine's own buffers), as the engine's workers do."""
        ffi, lib = self.core.ffi, self.core.lib
        u = self.unit
        u.fd, u.n, u.slot_bytes, u.payload_bytes = fd, n, slot, payload
        u.max_run, u.seal, u.aad_bytes, u.key, u.gate = 1024, seal, self.aad_bytes, key, gate
        method = osc.pwritev if is_store else osc.preadv
        raised: list[BaseException] = []

        def io(handle, j0, j1, offset):
            if raised:
                return -errno.EIO
            try:
                return moved(method(fd, views[j0:j1], offset), method)
            except OSError as e:
                return -(e.errno or errno.EIO)
            except BaseException as e:  # noqa: BLE001 - the engine makes it fatal for the run
                raised.append(e)
                return -errno.EIO

        cb = ffi.callback("kvo_io_fn", io)
        if native_engine.plain_call(osc, "pwritev" if is_store else "preadv"):
            u.io, u.io_handle = ffi.NULL, ffi.NULL
        else:
            u.io, u.io_handle = cb, ffi.NULL
        (lib.kvo_store_unit if is_store else lib.kvo_load_unit)(u, self.slots)
        if raised:
            raise raised[0]


class Unit:
    """n slots of random payloads at the given file slots, read into staging rows and opened
    into host rows, or (``in_place``) read into and opened in the host rows themselves."""

    def __init__(self, core, tmp_path, slots: list[int], in_place: bool = False, seed: int = 0,
                 slot: int = SLOT, payload: int = PAYLOAD) -> None:
        self.core, self.n, self.slot, self.payload = core, len(slots), slot, payload
        self.fd = os.open(tmp_path / "slots.bin", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, slot * (max(slots) + 2))
        self.key = os.urandom(16)
        self.gcm_key = native_engine.gcm_key(core, self.key)
        self.gate = core.ffi.new("int *")
        self.src = np.random.default_rng(seed).integers(0, 256, (self.n, payload), dtype=np.uint8)
        self.staging = np.zeros((self.n, slot), np.uint8)
        self.rows = np.zeros((self.n, slot), np.uint8)  # host rows, slot-sized (direct IO)
        self.c = UnitArrays(core, max(64, self.n), 8)
        self.c.file_off[: self.n] = [s * slot for s in slots]
        self.c.nonce[: self.n] = AesGcmSeal.nonce_array(range(100, 100 + self.n))
        self.c.aad[: self.n] = AesGcmSeal().aad_array(slots)
        self.in_place = in_place

    def call(self, is_store: bool, osc: OsCalls, seal: int, bufs, payloads, skip=()) -> np.ndarray:
        c, n = self.c, self.n
        c.buf[:n], c.payload[:n] = bufs, payloads
        c.status[:n] = self.core.lib.KVO_OK
        c.status[list(skip)] = self.core.lib.KVO_SKIP
        views = [memoryview(b) for b in (self.staging if not self.in_place or is_store else self.rows)]
        c.run(is_store, n, self.fd, self.slot, self.payload, seal, self.gcm_key, osc, views, self.gate)
        return c.status[:n].copy()

    def store(self, osc: OsCalls = OsCalls(), seal: int = 1) -> np.ndarray:
        return self.call(True, osc, seal, [r.ctypes.data for r in self.staging], [r.ctypes.data for r in self.src])

    def load(self, osc: OsCalls = OsCalls(), seal: int = 1, skip=()) -> tuple[np.ndarray, np.ndarray]:
        self.rows[:] = 0x5A  # what the rows held before
        rows = [r.ctypes.data for r in self.rows]
        if self.in_place:
            status = self.call(False, osc, seal, rows, rows, skip)
        else:
            self.staging[:] = 0
            status = self.call(False, osc, seal, [r.ctypes.data for r in self.staging], rows, skip)
        return status, self.rows[:, : self.payload]


def test_seals_open_with_cryptography_and_back(core, tmp_path):
    # Goal: the core's seal is AesGcmSeal's (nonce, associated data, tag), so a slot sealed
    # on either path opens on the other, and the file holds ciphertext only.
    u = Unit(core, tmp_path, [3, 4, 5, 9])
    assert (u.store() == core.lib.KVO_OK).all()
    aead = AESGCM(u.key)
    for j in range(u.n):
        ct = os.pread(u.fd, SLOT, int(u.c.file_off[j]))
        assert ct[:PAYLOAD] != u.src[j].tobytes() and ct[PAYLOAD:] == bytes(SLOT - PAYLOAD)
        pt = aead.decrypt(u.c.nonce[j].tobytes(), ct[:PAYLOAD] + u.c.tag[j].tobytes(), u.c.aad[j].tobytes())
        assert pt == u.src[j].tobytes()
    # Sealed in Python, opened in C.
    nonce = 7
    blob = aead.encrypt(nonce.to_bytes(12, "little"), u.src[1].tobytes(), (4).to_bytes(8, "little"))
    os.pwrite(u.fd, blob[:PAYLOAD], 4 * SLOT)
    u.c.nonce[1], u.c.tag[1] = AesGcmSeal.nonce_array([nonce])[0], np.frombuffer(blob[PAYLOAD:], np.uint8)
    status, rows = u.load()
    assert (status == core.lib.KVO_OK).all() and (rows == u.src).all()


def test_the_vector_forms_of_nonce_and_aad_are_the_seals_own():
    seal = AesGcmSeal()
    assert seal.nonce_array([1, 2**64 - 1]).tobytes() == b"".join(n.to_bytes(12, "little") for n in (1, 2**64 - 1))
    assert seal.aad_array([0, 7, 2**40]).tobytes() == b"".join(s.to_bytes(8, "little") for s in (0, 7, 2**40))


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "host-row"])
def test_a_slot_failing_its_check_leaves_zeros_not_bytes(core, tmp_path, in_place):
    u = Unit(core, tmp_path, [0, 1, 2, 3], in_place=in_place)
    u.store()
    os.pwrite(u.fd, bytes([os.pread(u.fd, 1, 2 * SLOT + 10)[0] ^ 1]), 2 * SLOT + 10)  # a bit on disk
    u.c.tag[0, 3] ^= 0x80  # a wrong record
    status, rows = u.load()
    assert status.tolist() == [core.lib.KVO_INTEGRITY, 0, core.lib.KVO_INTEGRITY, 0]
    assert not rows[0].any() and not rows[2].any()
    assert (rows[1] == u.src[1]).all() and (rows[3] == u.src[3]).all()


def test_a_failed_run_keeps_what_moved_and_retries_slot_by_slot(core, tmp_path):
    # Goal: the Python path's rule. Slots 0-3 are one run: its first read fails (EIO),
    # each slot is then read alone and all four load.
    u = Unit(core, tmp_path, [0, 1, 2, 3])
    u.store()
    osc = FaultyOsCalls().fail_nth("preadv", 1)
    status, rows = u.load(osc)
    assert (status == 0).all() and (rows == u.src).all()
    assert osc.calls["preadv"] == 1 + 4


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "host-row"])
def test_short_and_failed_reads_fail_only_their_slots(core, tmp_path, in_place):
    u = Unit(core, tmp_path, [0, 1, 2, 5], in_place=in_place)
    u.store()
    # Every read moves half: the run of 3 moves 1.5 slots (slot 0 whole), then 1 and 2
    # come short alone; slot 5 (its own run) comes short too.
    status, rows = u.load(FaultyOsCalls().fail_from("preadv", 1, Fault.short(0.5)))
    assert status.tolist() == [0] + [core.lib.KVO_SHORT] * 3
    assert (rows[0] == u.src[0]).all()
    # A failed read into a host row may have written part of it: zeroed. Through staging,
    # the row is left as it was: nothing was written into it.
    assert (rows[1:] == (0 if in_place else 0x5A)).all()
    status, rows = u.load(FaultyOsCalls().fail_from("preadv", 1, Fault.error(errno.EIO)))
    assert status.tolist() == [core.lib.KVO_IO_ERROR] * 4 and (u.c.err[:4] == errno.EIO).all()
    assert (rows == (0 if in_place else 0x5A)).all()


def test_slots_with_no_store_are_skipped_without_io_and_split_runs(core, tmp_path):
    # Goal: as the Python path's units_of(skip=...): a skipped row ends a run even where
    # the file slots around it are consecutive, and is neither read nor written.
    u = Unit(core, tmp_path, [0, 1, 2, 3])
    u.store()
    osc = FaultyOsCalls()
    status, rows = u.load(osc, skip=[1])
    assert status.tolist() == [0, core.lib.KVO_SKIP, 0, 0] and osc.calls["preadv"] == 2
    assert (rows[[0, 2, 3]] == u.src[[0, 2, 3]]).all() and (rows[1] == 0x5A).all()


def test_bit_flips_and_lying_writes_are_caught_by_the_tag(core, tmp_path):
    u = Unit(core, tmp_path, [0, 1, 2, 3])
    osc = FaultyOsCalls().fail_nth("pwritev", 1, Fault.lie())  # reports the run written, writes nothing
    assert (u.store(osc) == 0).all()  # nothing can tell at write time...
    status, rows = u.load()
    assert (status == core.lib.KVO_INTEGRITY).all() and not rows.any()  # ...the tag does on load
    u.store()
    status, rows = u.load(FaultyOsCalls().fail_nth("preadv", 1, Fault.bitflip(byte=SLOT + 7, bit=3)))
    assert status.tolist() == [0, core.lib.KVO_INTEGRITY, 0, 0] and not rows[1].any()


def test_failed_writes_fail_their_slots(core, tmp_path):
    u = Unit(core, tmp_path, [0, 1, 2, 7])
    status = u.store(FaultyOsCalls().fail_from("pwritev", 1, Fault.short(0.5)))
    assert status.tolist() == [0] + [core.lib.KVO_SHORT] * 3
    status = u.store(FaultyOsCalls().fail_from("pwritev", 1, Fault.error(errno.ENOSPC)))
    assert (status == core.lib.KVO_IO_ERROR).all() and (u.c.err[:4] == errno.ENOSPC).all()


def test_off_seal_copies_without_checks(core, tmp_path):
    u = Unit(core, tmp_path, [0, 1, 2])
    assert (u.store(seal=0) == 0).all()
    assert os.pread(u.fd, PAYLOAD, SLOT) == u.src[1].tobytes()  # plaintext on disk, by choice
    status, rows = u.load(seal=0)
    assert (status == 0).all() and (rows == u.src).all()


def test_a_closing_gate_stops_file_calls_and_an_ended_one_every_write(core, tmp_path):
    # Goal: shutdown's gate. Closing: a load makes no file call. Ended: a load writes
    # nothing at all (here its first run's read goes through a hang-free seam that ends
    # the gate in the middle, as shutdown ending the job during a hung read would).
    u = Unit(core, tmp_path, [0, 1, 2, 5])
    u.store()
    core.lib.kvo_gate_close(u.gate)
    osc = FaultyOsCalls()
    status, rows = u.load(osc)
    assert (status == core.lib.KVO_CANCELLED).all() and osc.calls["preadv"] == 0 and (rows == 0x5A).all()
    u.gate[0] = 0
    osc = FaultyOsCalls()
    osc.after("preadv", lambda info: core.lib.kvo_gate_end(u.gate))
    u.in_place = True
    status, rows = u.load(osc)
    assert (status == core.lib.KVO_CANCELLED).all() and osc.calls["preadv"] == 1
    whole = u.rows[:3, :PAYLOAD]  # what the read itself put in the rows: never opened
    assert not (whole == u.src[:3]).all(axis=1).any() and (u.rows[3] == 0x5A).all()


def test_the_unit_runs_without_the_gil(core, tmp_path):
    # Goal: a Python thread keeps running while one unit is in C: 64 slots of 1 MiB
    # sealed and written in one call, far longer than the 5 ms switch interval. Were the
    # GIL held for the call, the thread would stall for all of it.
    u = Unit(core, tmp_path, list(range(64)), slot=1 << 20, payload=1 << 20)
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
    assert t1 - t0 > 0.01, "the unit was too quick to tell"
    assert gaps.max() < 0.5 * (t1 - t0), (gaps.max(), t1 - t0)
