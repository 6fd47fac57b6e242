"""A persistent pool (``persist``): what survives a restart, what start-up refuses, and what
is never served, on both IO paths.

Each test runs real backends one after another on the same files in a private directory,
as a restarted server would; blocks are filled from their key, so a block that loads can
be checked against the key it was stored under, whatever happened in between.
"""

from __future__ import annotations

import hashlib
import os
import stat

import numpy as np
import pytest
import torch

from faults import Fault, FaultyOsCalls
from kvoffload import DiskBackend
from kvoffload.os_calls import OsCalls
from kvoffload.persist import (INDEX_SUFFIX, RECORD_BYTES, RECORD_DTYPE, RECORDS_OFFSET, Persist, PersistError,
                               read_header, read_operator_key, record_checksums)

TENSORS = [2048, 2048]  # 4096 B a block: one slot each under O_DIRECT, no padding
BLOCK = sum(TENSORS)
BLOCKS = 8
SLOTS = 16
KEY = bytes(range(32))
FP = {"model": "tiny", "rank": 0}

@pytest.fixture(params=["native", "python"])
def io_path(request) -> str:
    """Both IO paths: each persistent store and load runs through the native core and Python."""
    return request.param


@pytest.fixture
def disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


def caches() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(BLOCKS, n, dtype=torch.int8) for i, n in enumerate(TENSORS)}


def content(key: bytes) -> bytes:
    """The block stored under ``key`` (so a block that loads tells whether it is the right one)."""
    return hashlib.shake_256(key).digest(BLOCK)


def start(disk, io_path, key=KEY, fp=FP, page_cache=False, osc=None, **kw):
    b = DiskBackend()
    c = caches()
    b.init(c, "cpu", None, None, str(disk / "kv"), SLOTS, BLOCK, use_page_cache=page_cache, io_threads=1,
           report_load_errors=True, native_io=io_path == "native", os_calls=osc, persist=Persist(key, fp), **kw)
    return b, c


def put(c, block: int, data: bytes) -> None:
    raw = torch.frombuffer(bytearray(data), dtype=torch.int8)
    c["t0"][block], c["t1"][block] = raw[:TENSORS[0]], raw[TENSORS[0]:]


def got(c, block: int) -> bytes:
    return c["t0"][block].numpy().tobytes() + c["t1"][block].numpy().tobytes()


def store(b, c, slots, keys) -> bool:
    for i, k in enumerate(keys):
        put(c, i, content(k))
    ev = []
    b.launch_copy(list(range(len(slots))), list(slots), True, 0, ev, keys=list(keys))
    assert ev[0][1].wait(10)
    return ev[0][1].ok


def load(b, c, slots) -> dict[int, bytes | None]:
    """Each slot's bytes as loaded, None where the load failed (device block left as it was)."""
    for t in c.values():
        t.fill_(7)
    ev = []
    b.launch_copy(list(slots), list(range(len(slots))), False, 0, ev)
    assert ev[0][1].wait(10)
    bad = b.get_block_ids_with_load_errors()
    return {s: None if i in bad else got(c, i) for i, s in enumerate(slots)}


def restart_and_check(disk, io_path, **kw) -> tuple[dict[int, bytes], dict]:
    """A new backend on the same files: every restored block loads, and only as what its
    key says; returns {slot: key} of those that loaded, and the refusals."""
    b, c = start(disk, io_path, **kw)
    try:
        found = b.restored()
        entries = dict(found.entries())
        out = {}
        for s, data in load(b, c, list(entries)).items():
            if data is not None:
                assert data == content(entries[s]), f"slot {s} served bytes that are not its key's"
                out[s] = entries[s]
        return out, dict(found.refused)
    finally:
        b.shutdown()


def digest_files(disk) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(disk.iterdir())}


@pytest.mark.parametrize("page_cache", [False, True], ids=["odirect", "pagecache"])
def test_blocks_survive_a_restart_in_lru_order(disk, io_path, page_cache):
    # Goal: what was stored comes back after a restart, exactly, in the order it was stored
    # (the next stores evict the oldest), an overwritten slot as its newest block, and the
    # stores after the restart survive the next one too.
    b, c = start(disk, io_path, page_cache=page_cache)
    assert store(b, c, [3, 4, 5], [b"a", b"b", b"c"])
    assert store(b, c, [9, 4], [b"d", b"e"])  # slot 4 overwritten
    b.shutdown()
    assert sorted(os.listdir(disk)) == ["kv", "kv" + INDEX_SUFFIX]
    assert all(stat.S_IMODE(os.stat(disk / n).st_mode) == 0o600 for n in os.listdir(disk))
    b, c = start(disk, io_path, page_cache=page_cache)
    assert b.restored().entries() == [(3, b"a"), (5, b"c"), (9, b"d"), (4, b"e")]
    assert {s: d == content(k) for (s, k), d in zip(b.restored().entries(), load(b, c, [3, 5, 9, 4]).values())} == \
        {3: True, 5: True, 9: True, 4: True}
    assert store(b, c, [1], [b"f"])
    b.shutdown()
    served, refused = restart_and_check(disk, io_path, page_cache=page_cache)
    assert served == {3: b"a", 5: b"c", 9: b"d", 4: b"e", 1: b"f"} and refused == {}


def test_either_io_path_reads_the_others_pool(disk):
    # Goal: a pool written through the native core restarts on the Python path and the other
    # way round: one associated data, one nonce form.
    for first, then in (("native", "python"), ("python", "native")):
        b, c = start(disk, first)
        assert store(b, c, [1, 2], [first.encode() + b"1", first.encode() + b"2"])
        b.shutdown()
        served, _ = restart_and_check(disk, then)
        assert served == {1: first.encode() + b"1", 2: first.encode() + b"2"}


def stored_nonces(disk, slots) -> list[int]:
    """The nonces the index records for ``slots`` (each the one its block was sealed with)."""
    raw = np.frombuffer((disk / ("kv" + INDEX_SUFFIX)).read_bytes()[RECORDS_OFFSET:], RECORD_DTYPE)
    return [int(raw["nonce_hi"][s]) << 64 | int(raw["nonce_lo"][s]) for s in slots]


def test_no_nonce_repeats_across_restarts_restores_and_copies(disk, tmp_path, io_path):
    # Goal: under one key, no (key, nonce) pair is used twice, whatever happens to the files:
    # plain restarts, both files put back from a copy (a backup, a snapshot), each one alone,
    # and the pair copied to another host. Nonces come from a random start per start-up, not
    # from anything the files show (the files said the same each time the copy came back).
    import shutil

    snap = tmp_path / "snap"
    nonces: list[int] = []
    runs = 0

    def run(where, slots):
        nonlocal runs
        b, c = start(where, io_path)
        try:
            assert store(b, c, slots, [b"r%d-%d" % (runs, s) for s in slots])
        finally:
            b.shutdown()
        runs += 1
        nonces.extend(stored_nonces(where, slots))

    run(disk, [1, 2])
    shutil.copytree(disk, snap)
    for _ in range(3):  # plain restarts
        run(disk, [2, 3])
    for put_back in (["kv", "kv.index"], ["kv", "kv.index"], ["kv.index"], ["kv"]):
        for name in put_back:
            shutil.copy2(snap / name, disk / name)
        run(disk, [2, 3])  # slot 2 again: the very store that repeated a nonce when epochs came from the files
    other = tmp_path / "other-host"
    shutil.copytree(snap, other)
    run(other, [2, 3])
    run(other, [2, 3])
    assert len(nonces) == 2 * runs
    assert len(set(nonces)) == len(nonces), "a nonce was used twice under the pool's key"
    assert all(0 < n < 2**96 for n in nonces)


def test_nonce_starts_are_random_and_counted_within_a_run():
    # Goal: a persistent seal counts up from a random start (no two starts alike), the
    # counter never reaching 2**96; an ephemeral seal (a fresh key per run) counts from 1.
    from kvoffload.slot_seal import COUNTER_SPACE, NONCE_SPACE, AesGcmSeal

    starts = []
    for _ in range(64):
        s = AesGcmSeal()
        assert s.reserve_nonces(3) == 1 and s.reserve_nonces(1) == 4
        s.persist(bytes(16), bytes(32), 57)
        first = s.reserve_nonces(5)
        assert s.reserve_nonces(1) == first + 5 and first + COUNTER_SPACE <= NONCE_SPACE
        starts.append(first)
    assert len(set(starts)) == len(starts) and max(starts) >= 2**90


def test_a_torn_or_garbled_record_is_not_restored(disk, io_path):
    # Goal: an index record that does not check (torn by a crash, garbled, copied from another
    # slot) is refused at start-up and counted; the other records are restored.
    b, c = start(disk, io_path)
    assert store(b, c, [1, 2, 3, 4], [b"a", b"b", b"c", b"d"])
    b.shutdown()
    idx = disk / ("kv" + INDEX_SUFFIX)
    raw = bytearray(idx.read_bytes())
    raw[RECORDS_OFFSET + 1 * RECORD_BYTES + 50] ^= 1  # slot 1: a flipped key byte
    raw[RECORDS_OFFSET + 2 * RECORD_BYTES + 64: RECORDS_OFFSET + 3 * RECORD_BYTES] = bytes(64)  # slot 2: torn
    rec4 = raw[RECORDS_OFFSET + 4 * RECORD_BYTES: RECORDS_OFFSET + 5 * RECORD_BYTES]
    raw[RECORDS_OFFSET + 7 * RECORD_BYTES: RECORDS_OFFSET + 8 * RECORD_BYTES] = rec4  # slot 4's record at 7
    idx.write_bytes(raw)
    served, refused = restart_and_check(disk, io_path)
    assert served == {3: b"c", 4: b"d"} and refused == {"checksum": 3}


@pytest.mark.parametrize("attack", ["flip", "swap", "move", "replay", "foreign", "relabel", "regenerate"])
def test_tampered_blocks_fail_their_tag_and_are_never_served(disk, tmp_path, io_path, attack):
    # Goal: a block whose bytes changed on disk, two slots' blocks swapped, a block and its
    # record copied to another slot, an older block of a slot put back over its newer one,
    # another pool's file under the same key, or a record that claims another key or
    # generation (its checksum made right, as by someone who could forge it): each fails its
    # tag at load (a load error, recomputed once by the caller), the others load exactly.
    b, c = start(disk, io_path)
    assert store(b, c, [1, 2, 3], [b"a", b"b", b"c"])
    b.shutdown()
    data, idx = disk / "kv", disk / ("kv" + INDEX_SUFFIX)
    old = data.read_bytes()
    if attack in ("replay", "foreign"):
        b, c = start(disk, io_path)
        assert store(b, c, [2], [b"b"])  # the same block again: new generation, new nonce
        b.shutdown()
    blob = bytearray(data.read_bytes())
    irec = bytearray(idx.read_bytes())
    slot = lambda s: slice(s * BLOCK, (s + 1) * BLOCK)  # noqa: E731
    rec = lambda s: slice(RECORDS_OFFSET + s * RECORD_BYTES, RECORDS_OFFSET + (s + 1) * RECORD_BYTES)  # noqa: E731
    if attack == "flip":
        blob[2 * BLOCK + 100] ^= 0x40
    elif attack == "swap":
        blob[slot(1)], blob[slot(2)] = blob[slot(2)], blob[slot(1)]
    elif attack == "move":  # slot 2's block and its record, copied to slot 7: its own check fails there
        blob[slot(7)] = blob[slot(2)]
        irec[rec(7)] = irec[rec(2)]
    elif attack == "replay":
        blob[slot(2)] = old[slot(2)]
    elif attack in ("relabel", "regenerate"):
        fd = os.open(idx, os.O_RDONLY)
        try:
            _, keys = read_header(OsCalls(), fd, str(idx), KEY)
        finally:
            os.close(fd)
        r = np.frombuffer(irec[rec(2)], RECORD_DTYPE).copy()
        if attack == "relabel":
            r["key"][0, 0] = ord("z")
        else:
            r["gen"] += 1
        r["checksum"] = record_checksums(r.view("<u8").reshape(1, -1), np.array([2], np.uint64), keys.mult)
        irec[rec(2)] = r.tobytes()
    else:  # another pool under the same key, its files swapped in for ours
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        b2, c2 = start(other, io_path)
        assert store(b2, c2, [1, 2, 3], [b"a", b"b", b"c"])
        b2.shutdown()
        blob = bytearray((other / "kv").read_bytes())
    data.write_bytes(blob)
    idx.write_bytes(irec)
    b, c = start(disk, io_path)
    try:
        got_ = load(b, c, [1, 2, 3])
    finally:
        b.shutdown()
    for s, k in zip([1, 2, 3], [b"a", b"b", b"c"]):
        assert got_[s] in (None, content(k)), f"slot {s} served wrong bytes"
    failed = {s for s, d in got_.items() if d is None}
    assert failed == {"flip": {2}, "swap": {1, 2}, "move": set(), "replay": {2}, "foreign": {1, 2, 3},
                      "relabel": {2}, "regenerate": {2}}[attack]
    if attack == "move":
        b, c = start(disk, io_path)
        try:
            assert 7 not in dict(b.restored().entries())  # its record does not check at slot 7
        finally:
            b.shutdown()


def test_a_block_that_fails_its_check_is_not_offered_again_after_a_restart(disk, io_path):
    # Goal: a load that fails its tag forgets the slot in the index too, so the restart after
    # it does not offer the same bad block again (one recompute, not one per restart).
    b, c = start(disk, io_path)
    assert store(b, c, [1, 2], [b"a", b"b"])
    b.shutdown()
    blob = bytearray((disk / "kv").read_bytes())
    blob[BLOCK + 5] ^= 1
    (disk / "kv").write_bytes(blob)
    b, c = start(disk, io_path)
    assert load(b, c, [1, 2])[1] is None
    b.shutdown()
    served, refused = restart_and_check(disk, io_path)
    assert served == {2: b"b"} and refused == {}


def test_index_write_failures_never_serve_wrong_bytes(disk, io_path):
    # Goal: an index record that could not be written (EIO, or a short write) leaves the
    # block served in this run, and after the restart either not restored or failing its
    # tag: never wrong bytes.
    b, c = start(disk, io_path)
    assert store(b, c, [1, 2], [b"a", b"b"])
    b.shutdown()
    osc = FaultyOsCalls()
    idx_fd = []
    osc.after("open", lambda info: idx_fd.append(info.result) if str(info.args[0]).endswith(INDEX_SUFFIX) else None)
    osc.fail_from("pwritev", 1, Fault.error(5), where=lambda args: args[0] in idx_fd[-1:] and args[2] >= RECORDS_OFFSET)
    b, c = start(disk, io_path, osc=osc)
    assert store(b, c, [1, 3], [b"c", b"d"])
    assert load(b, c, [1, 3]) == {1: content(b"c"), 3: content(b"d")}
    b.shutdown()
    assert osc.fired["pwritev"] >= 1
    served, _ = restart_and_check(disk, io_path)
    assert served == {2: b"b"}


def _refused(disk, io_path, match, **kw):
    before = digest_files(disk)
    with pytest.raises(PersistError, match=match) as e:
        start(disk, io_path, **kw)
    assert "\n" not in str(e.value)
    assert digest_files(disk) == before, "a refused start-up changed the files"


def test_start_up_refusals_are_one_line_and_touch_nothing(disk, io_path, fd_guard):
    # Goal: a wrong key, another model or layout, a file from a newer format, a damaged
    # header, a missing index or data file, a pool a running server holds: one line naming
    # it and what to do, and not a byte of the files changed.
    b, c = start(disk, io_path)
    assert store(b, c, [1], [b"a"])
    _refused(disk, io_path, "in use by another kvoffload process")
    b.shutdown()
    _refused(disk, io_path, "does not verify under this key", key=bytes(32))
    _refused(disk, io_path, r"another model or layout: model 'tiny' \(this server: 'other'\)", fp={"model": "other",
                                                                                               "rank": 0})
    idx = disk / ("kv" + INDEX_SUFFIX)
    raw = bytearray(idx.read_bytes())
    newer = bytearray(raw)
    newer[8:12] = newer[2048 + 8:2048 + 12] = (2).to_bytes(4, "little")
    idx.write_bytes(newer)
    _refused(disk, io_path, "written by a newer kvoffload")
    damaged = bytearray(raw)
    damaged[100] ^= 1
    damaged[2048 + 100] ^= 1
    idx.write_bytes(damaged)
    _refused(disk, io_path, "both header copies are damaged")
    idx.write_bytes(raw)
    os.rename(idx, disk / "saved")
    _refused(disk, io_path, "exists without its index")
    os.rename(disk / "saved", idx)
    os.rename(disk / "kv", disk / "saved")
    _refused(disk, io_path, "missing while its index")
    os.rename(disk / "saved", disk / "kv")
    served, _ = restart_and_check(disk, io_path)  # and after all that, intact
    assert served == {1: b"a"}


def test_one_valid_header_copy_is_enough(disk, io_path):
    # Goal: a header copy damaged on disk (a bad sector, a write torn by a crash) still
    # starts, from the other copy; either copy alone is enough.
    b, c = start(disk, io_path)
    assert store(b, c, [1], [b"a"])
    b.shutdown()
    idx = disk / ("kv" + INDEX_SUFFIX)
    raw = bytearray(idx.read_bytes())
    raw[2048 + 200] ^= 0xFF  # copy 1 (copy 0 then holds the header)
    idx.write_bytes(raw)
    served, _ = restart_and_check(disk, io_path)
    assert served == {1: b"a"}
    raw[2048 + 200] ^= 0xFF
    raw[200] ^= 0xFF  # now copy 0 is damaged and copy 1 intact
    idx.write_bytes(raw)
    served, _ = restart_and_check(disk, io_path)
    assert served == {1: b"a"}


def test_a_start_up_that_fails_creating_the_pool_leaves_nothing(disk, io_path):
    # Goal: a first start whose data file cannot be reserved leaves neither file behind;
    # one that finds files it did not make never removes them.
    osc = FaultyOsCalls().fail_from("fallocate", 2, Fault.error(28))  # the index's, then the data file's
    with pytest.raises(OSError, match="not enough space"):
        start(disk, io_path, osc=osc)
    assert os.listdir(disk) == []


@pytest.mark.parametrize("fault", [Fault.short(0.0), Fault.short(0.5), Fault.error(5), Fault.bitflip(0, 3),
                                   Fault.bitflip(130, 0)], ids=repr)
def test_a_fault_reading_the_pool_at_start_up_never_costs_it(disk, io_path, fault):
    # Goal: a short read, EIO or a bit flipped on its way, at any read start-up makes of the
    # index, either starts the pool as it was or refuses in one line with every file byte
    # for byte as it was; the next start serves every block. (One short read used to pass
    # for a blank index: start-up truncated it and made a new pool, every block lost.)
    b, c = start(disk, io_path)
    assert store(b, c, [1, 2, 3], [b"a", b"b", b"c"])
    b.shutdown()
    count = FaultyOsCalls()
    start(disk, io_path, osc=count)[0].shutdown()
    reads = count.calls["preadv"]
    assert reads >= 2
    for n in range(1, reads + 1):
        before = digest_files(disk)
        osc = FaultyOsCalls().fail_nth("preadv", n, fault)
        try:
            b, c = start(disk, io_path, osc=osc)
        except PersistError as e:
            assert "\n" not in str(e) and "left untouched" in str(e), e
            assert digest_files(disk) == before, f"preadv #{n} {fault!r}: a refused start changed the files"
        else:
            try:  # started: as it was, every block
                assert dict(b.restored().entries()) == {1: b"a", 2: b"b", 3: b"c"}, f"preadv #{n} {fault!r}"
                assert load(b, c, [1, 2, 3]) == {s: content(k) for s, k in ((1, b"a"), (2, b"b"), (3, b"c"))}
            finally:
                b.shutdown()
        served, refused = restart_and_check(disk, io_path)
        assert served == {1: b"a", 2: b"b", 3: b"c"} and refused == {}, f"preadv #{n} {fault!r} cost blocks"


def test_prefill_writes_a_new_pools_file_and_never_an_existing_ones(disk, io_path):
    # Goal: prefill with persist writes the new pool's data file once, whole, before init
    # returns (every store then a rewrite); an existing pool's data file is never written at
    # start-up, prefill or not, and its blocks are served.
    def data_writes(osc):
        fds: list[int] = []
        osc.after("open", lambda i: fds.append(i.result) if str(i.args[0]) == "kv" and i.error is None else None)
        done: list[int] = []
        osc.after("pwritev", lambda i: done.append(i.result) if i.args[0] in fds and i.error is None else None)
        return done

    osc = FaultyOsCalls()
    wrote = data_writes(osc)
    b, c = start(disk, io_path, osc=osc, prefill=True)
    size = os.path.getsize(disk / "kv")
    assert sum(wrote) == size > 0, "a new persistent pool's data file was not prefilled"
    assert store(b, c, [1], [b"a"])
    b.shutdown()
    osc = FaultyOsCalls()
    wrote = data_writes(osc)
    b, c = start(disk, io_path, osc=osc, prefill=True)
    try:
        assert wrote == [], "prefill wrote over an existing pool's data file"
        assert load(b, c, [1]) == {1: content(b"a")}
    finally:
        b.shutdown()


def test_operator_key_sources(tmp_path, monkeypatch):
    # Goal: the key comes from a file only its owner can read (raw or hex) or an environment
    # variable (hex); anything else is one line that never shows key material.
    f = tmp_path / "key"
    f.write_bytes(KEY)
    f.chmod(0o600)
    assert read_operator_key(str(f)) == KEY
    f.write_text(KEY.hex() + "\n")
    assert read_operator_key(str(f)) == KEY
    monkeypatch.setenv("KVO_KEY", KEY.hex())
    assert read_operator_key(key_env="KVO_KEY") == KEY
    bad = []
    shared = tmp_path / "shared"
    shared.write_bytes(KEY)
    shared.chmod(0o640)
    bad.append(("mode 640", lambda: read_operator_key(str(shared))))
    (tmp_path / "link").symlink_to(f)
    bad.append(("is a symlink", lambda: read_operator_key(str(tmp_path / "link"))))
    short = tmp_path / "short"
    short.write_bytes(KEY[:31])
    short.chmod(0o600)
    bad.append(("exactly 32 bytes", lambda: read_operator_key(str(short))))
    bad.append(("is not a regular file", lambda: read_operator_key(str(tmp_path))))
    bad.append(("not set", lambda: read_operator_key(key_env="KVO_NOPE")))
    monkeypatch.setenv("KVO_BAD", "zz" * 32)
    bad.append(("64 hex digits", lambda: read_operator_key(key_env="KVO_BAD")))
    # 60 hex digits and 4 spaces (bytes.fromhex skips whitespace: a 30-byte key), two newlines,
    # a CRLF, a leading space: each refused, naming the one form taken.
    for i, text in enumerate([KEY.hex()[:60] + "    ", KEY.hex()[:30] + "  " + KEY.hex()[30:60] + "  ",
                              KEY.hex() + "\n\n", KEY.hex() + "\r\n", " " + KEY.hex(), KEY.hex()[:62]]):
        monkeypatch.setenv(f"KVO_WS{i}", text)
        bad.append(("exactly 64 hex digits", lambda i=i: read_operator_key(key_env=f"KVO_WS{i}")))
        spaced = tmp_path / f"spaced{i}"
        spaced.write_text(text)
        spaced.chmod(0o600)
        bad.append(("exactly 64 hex digits", lambda p=spaced: read_operator_key(str(p))))
    bad.append(("exactly one of", lambda: read_operator_key(str(f), "KVO_KEY")))
    for match, call in bad:
        with pytest.raises(PersistError, match=match) as e:
            call()
        assert "\n" not in str(e.value) and KEY.hex() not in str(e.value) and "zz" * 32 not in str(e.value)


def test_forget_wipes_the_pool_so_nothing_is_readable(disk, io_path, capsys):
    # Goal: `python -m kvoffload forget` refuses a pool a server holds and a file that is not
    # kvoffload's (one line, exit 2, nothing touched); on a stopped pool it zeroes the index
    # (the pool id that salts the key goes with it), discards the data and removes both:
    # nothing can be restored any more.
    from kvoffload.__main__ import main

    b, c = start(disk, io_path)
    assert store(b, c, [1, 2], [b"a", b"b"])
    assert main(["forget", str(disk / "kv")]) == 2
    assert "in use by a running kvoffload server" in capsys.readouterr().err
    b.shutdown()
    (disk / "other").write_bytes(b"someone's data")
    (disk / ("other" + INDEX_SUFFIX)).write_bytes(b"not an index at all")
    assert main(["forget", str(disk / "other")]) == 2
    assert "holds no kvoffload index header" in capsys.readouterr().err
    assert (disk / "other").read_bytes() == b"someone's data"
    idx_inode = os.stat(disk / ("kv" + INDEX_SUFFIX)).st_ino
    fd = os.open(disk / ("kv" + INDEX_SUFFIX), os.O_RDONLY)  # what a lingering reader would see
    try:
        assert main(["forget", str(disk / "kv")]) == 0
        assert os.fstat(fd).st_ino == idx_inode and os.pread(fd, 1 << 16, 0) == bytes(RECORDS_OFFSET + SLOTS * 128)
    finally:
        os.close(fd)
    assert sorted(os.listdir(disk)) == ["other", "other" + INDEX_SUFFIX]
    assert "forgot" in capsys.readouterr().out
    b, c = start(disk, io_path)  # a fresh pool
    try:
        assert b.restored().entries() == [] and b._run.keeper.pool.new
    finally:
        b.shutdown()
    assert main(["forget", str(disk / "nothing")]) == 2
    assert "no kvoffload pool file or index there" in capsys.readouterr().err
    (disk / "d.dp0.rank0").mkdir()  # a directory where a rank's file would be: one line, nothing removed
    assert main(["forget", str(disk / "d")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and (disk / "d.dp0.rank0").is_dir()


def _not_a_pool(disk, name: str, index: bytes, data: bytes = b"someone's disk image") -> None:
    (disk / name).write_bytes(data)
    (disk / (name + INDEX_SUFFIX)).write_bytes(index)


@pytest.mark.parametrize("case", ["zero-magic", "blank", "empty", "magic-only", "bad-crc", "newer", "wrong-size",
                                  "data-size"])
def test_forget_removes_only_a_proven_pool(disk, case, capsys):
    # Goal: `forget` proves a file set is a kvoffload pool before it wipes anything: a header
    # copy with the magic, this format, its size and a CRC over it, describing an index of
    # the file's size and a data file of the size beside it. Anything else (an index whose
    # first 8 bytes are zero and the rest other data, an all-zero or empty one, a magic
    # alone, a bad CRC, a newer format, sizes that do not match) is one line, exit 2, and
    # both files are byte for byte as they were.
    from kvoffload.__main__ import main

    b, c = start(disk, "python")
    assert store(b, c, [1], [b"a"])
    b.shutdown()
    real = (disk / ("kv" + INDEX_SUFFIX)).read_bytes()
    index = {
        "zero-magic": bytes(8) + os.urandom(RECORDS_OFFSET + 1000),
        "blank": bytes(RECORDS_OFFSET + SLOTS * RECORD_BYTES),
        "empty": b"",
        "magic-only": b"KVOFFIDX" + bytes(RECORDS_OFFSET + SLOTS * RECORD_BYTES - 8),
        "bad-crc": real[:100] + bytes([real[100] ^ 1]) + real[101:2148] + bytes([real[2148] ^ 1]) + real[2149:],
        "newer": real[:8] + (2).to_bytes(4, "little") + real[12:2056] + (2).to_bytes(4, "little") + real[2060:],
        "wrong-size": real + bytes(RECORD_BYTES),
        "data-size": real,
    }[case]
    _not_a_pool(disk, "disk.img", index, (disk / "kv").read_bytes() + b"x" if case == "data-size" else b"mine")
    before = digest_files(disk)
    assert main(["forget", str(disk / "disk.img")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "left untouched" in err, err
    assert digest_files(disk) == before
    # The real pool is proved, under its key too; under another key it is refused.
    key = disk.parent / "key"
    key.write_bytes(bytes(32))
    key.chmod(0o600)
    assert main(["forget", "--key-file", str(key), str(disk / "kv")]) == 2
    assert "does not verify under this key" in capsys.readouterr().err and digest_files(disk) == before
    key.write_bytes(KEY)
    assert main(["forget", "--key-file", str(key), str(disk / "kv")]) == 0
    assert not (disk / "kv").exists() and (disk / "disk.img").exists()


def test_forget_refuses_every_target_before_wiping_any(disk, capsys):
    # Goal: with several disk paths, one that is not kvoffload's refuses them all: nothing wiped.
    from kvoffload.__main__ import main

    b, c = start(disk, "python")
    assert store(b, c, [1], [b"a"])
    b.shutdown()
    _not_a_pool(disk, "disk.img", bytes(8) + os.urandom(5000))
    before = digest_files(disk)
    assert main(["forget", str(disk / "kv"), str(disk / "disk.img")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and digest_files(disk) == before


def test_without_persist_nothing_is_named(disk, io_path):
    # Goal: the default is unchanged: no named file while serving or after.
    b = DiskBackend()
    b.init(caches(), "cpu", None, None, str(disk / "kv"), SLOTS, BLOCK, io_threads=1, report_load_errors=True,
           native_io=io_path == "native")
    ev = []
    b.launch_copy([0], [1], True, 0, ev, keys=[b"ignored"])
    assert ev[0][1].wait(10) and ev[0][1].ok
    assert os.listdir(disk) == []
    b.shutdown()
    assert os.listdir(disk) == []


def test_persistent_stores_need_keys(disk, io_path):
    # Goal: a store to a persistent pool without its blocks' keys (or with unusable ones) is
    # refused before anything is queued.
    b, c = start(disk, io_path)
    try:
        for keys, match in ((None, "needs each block's key"), ([b"a"], "1 keys for 2 blocks"),
                            ([b"a", b""], "1 to 48 bytes"), ([b"a", b"x" * 49], "1 to 48 bytes"),
                            ([b"a", "b"], "1 to 48 bytes")):
            ev = []
            with pytest.raises(ValueError, match=match):
                b.launch_copy([0, 1], [1, 2], True, 0, ev, keys=keys)
            assert ev == [] and b._run.open_jobs == {}
    finally:
        b.shutdown()
    with pytest.raises(ValueError, match="persist needs encrypt=True"):
        DiskBackend().init(caches(), "cpu", None, None, str(disk / "kv"), SLOTS, BLOCK, encrypt=False,
                           persist=Persist(KEY, FP))


def test_the_ranks_agree_on_what_is_restored(tmp_path, io_path):
    # Goal: with several ranks (one pool each), a slot is restored only where every rank
    # holds the same block: a rank holding another key, none, or a torn record refuses it
    # (counted by cause), and vLLM's null block is never restored.
    from kvoffload.persist import agree, read_pool

    ranks = []
    for r in range(2):
        d = tmp_path / f"rank{r}"
        d.mkdir(mode=0o700)
        b, c = start(d, io_path)
        assert store(b, c, [0, 1, 2, 3], [b"n", b"a", b"b", b"c"])
        assert store(b, c, [4], [b"d" if r == 0 else b"x"])  # rank 1 holds another block at 4
        if r == 0:
            assert store(b, c, [5], [b"e"])  # rank 1 never stored 5
        b.shutdown()
        ranks.append(d / "kv")
    idx = tmp_path / "rank1" / ("kv" + INDEX_SUFFIX)
    raw = bytearray(idx.read_bytes())
    raw[RECORDS_OFFSET + 3 * RECORD_BYTES + 8] ^= 1  # rank 1's record of slot 3: torn
    idx.write_bytes(raw)
    found = agree([read_pool([str(p)], KEY) for p in ranks], reserved=(0,))
    assert found.entries() == [(1, b"a"), (2, b"b")]
    assert dict(found.refused) == {"checksum": 1, "rank_mismatch": 2, "reserved": 1}
    with pytest.raises(PersistError, match="does not verify under this key"):
        read_pool([str(ranks[0])], bytes(32))


def test_the_tier_keeps_its_chunks_across_a_restart(tmp_path, io_path):
    # Goal: kvoffload's tier under vLLM's CPU primary (SlotTier) with persist: chunks stored
    # before a restart are hits after it, loaded exactly into the primary; the pool's LRU
    # order comes back, and the tier counts what it restored.
    import mmap

    from kvoffload.vllm_tier import SlotTier, TierConfig

    row, rows = 8192, 8
    mm = mmap.mmap(-1, row * rows)
    prim = np.frombuffer(mm, np.int8).reshape(rows, row)
    key = tmp_path / "key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    cfg = TierConfig.from_tier_config({"disk_path": str(tmp_path / "tier"), "disk_capacity_bytes": 8 * row,
                                       "persist": True, "persist_key_file": str(key),
                                       "native_io": io_path == "native"})
    prim[:] = np.random.default_rng(0).integers(-128, 128, prim.shape, dtype=np.int8)
    want = prim[:3].copy()
    t = SlotTier(memoryview(prim), cfg, fingerprint={"model": "tiny"})
    t.submit_store(1, [b"k0", b"k1", b"k2"], [0, 1, 2])
    assert t.drain(10) and all(f.success for f in t.poll())
    t.close()
    prim[:] = 0
    t = SlotTier(memoryview(prim), cfg, fingerprint={"model": "tiny"})
    try:
        assert [t.lookup(k) for k in (b"k0", b"k1", b"k2", b"k3")] == [True, True, True, False]
        t.submit_load(2, [b"k0", b"k1", b"k2"], [5, 6, 7])
        assert t.drain(10) and all(f.success for f in t.poll())
        assert np.array_equal(prim[5:8], want)
        assert t.take_metrics()["data"]["vllm:kvoffload_restored_blocks_total"] == {(): 3}
    finally:
        t.close()
    with pytest.raises(PersistError, match="another model or layout"):
        SlotTier(memoryview(prim), cfg, fingerprint={"model": "other"})


@pytest.mark.parametrize("extra, match", [
    ({"persist": True}, "exactly one of persist_key_file"),
    ({"persist": True, "persist_key_file": "/k", "persist_key_env": "K"}, "exactly one of persist_key_file"),
    ({"persist_key_file": "/k"}, "persist is not true"),
    ({"persist": "true", "persist_key_env": "K"}, "expected a JSON boolean"),
    ({"persist": True, "persist_key_env": "not a name"}, "name of an environment variable"),
    ({"persist": True, "persist_key_file": ""}, "path to the key file"),
    ({"persist": True, "persist_key_env": "K", "encrypt": False}, "needs encryption"),
])
def test_persist_keys_are_checked_together(extra, match):
    # Goal: the persist keys are refused in one line naming what is wrong, the same way in
    # kv_connector_extra_config and in a tier entry.
    from kvoffload.config import OffloadConfig
    from kvoffload.vllm_tier import TierConfig

    with pytest.raises(ValueError, match=match):
        OffloadConfig.from_extra_config({"kv_offload_backend": "disk", "disk_path": "/tmp/kv", **extra})
    with pytest.raises(ValueError, match=match):
        TierConfig.from_tier_config({"disk_path": "/tmp/kv", **extra})
    ok = OffloadConfig.from_extra_config({"kv_offload_backend": "disk", "disk_path": "/tmp/kv", "persist": True,
                                          "persist_key_env": "K"})
    assert ok.persist.enabled and ok.persist.key_env == "K" and ok.backend_kwargs().keys().isdisjoint({"persist"})


def test_a_refusal_names_the_class_where_operators_import_it():
    # vLLM's engine logs the worker's exception as "module.Class: message"; the operator
    # (and test_engine_persist) look for kvoffload.persist.PersistError, whichever room of
    # the package raised it.
    import traceback

    try:
        read_operator_key(key_env="KVOFFLOAD_TEST_KEY_NOT_SET")
    except PersistError as e:
        assert traceback.format_exception_only(e)[0].startswith("kvoffload.persist.PersistError: ")
    else:
        raise AssertionError("no refusal")
