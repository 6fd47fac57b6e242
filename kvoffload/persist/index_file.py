"""A persistent pool's index file: two header copies, then one 128-byte record per slot.

The header names the pool (its random id, which salts the keys derived from the
operator's), the file's place in the pool and the KV layout, under a CRC and an HMAC.
A record says which block a slot holds (generation, key, nonce, tag, LRU sequence)
under a keyed checksum: it tells a torn, garbled or moved record from a written one.
The index only says where to look; a block's AES-GCM tag decides whether it is served.
Reads here refuse, with the file as it was, whatever they could not read whole.
"""

from __future__ import annotations

import errno
import hmac
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvoffload.os_calls import OsCalls, moved
from kvoffload.persist.operator_key import PersistError

FORMAT_VERSION = 1
MAGIC = b"KVOFFIDX"
INDEX_SUFFIX = ".index"
MAX_KEY_BYTES = 48  # a block key: vLLM's sha256 block hash and group id take 36
# A slot's identity, the part of its associated data the index carries: generation,
# key length, key (zero padded).
IDENT_BYTES = 8 + 1 + MAX_KEY_BYTES
HEADER_COPY_BYTES = 2048
RECORDS_OFFSET = 2 * HEADER_COPY_BYTES
RECORD_BYTES = 128
_SUMMARY_OFFSET = 114
_CRC_OFFSET = 2012
_MAC_OFFSET = 2016
MAX_SUMMARY_BYTES = _CRC_OFFSET - _SUMMARY_OFFSET
# One read of the index at start-up: large enough for the disk's rate, small enough to
# read again at once where a record does not check (a flipped bit in flight, or torn).
_READ_CHUNK = 16 << 20

RECORD_DTYPE = np.dtype([
    ("gen", "<u8"), ("seq", "<u8"), ("nonce_lo", "<u8"), ("nonce_hi", "<u4"), ("key_len", "u1"),
    ("pad", "u1", 3), ("tag", "u1", 16), ("key", "u1", MAX_KEY_BYTES), ("reserved", "u1", 24),
    ("checksum", "<u8"),
])
assert RECORD_DTYPE.itemsize == RECORD_BYTES


@dataclass(frozen=True)
class PoolKeys:
    """The keys one pool uses, derived from the operator's key and the pool's id."""

    slot: bytes = field(repr=False)  # AES-128-GCM of every slot
    index: bytes = field(repr=False)  # HMAC of the header
    mult: np.ndarray = field(repr=False)  # odd multipliers of the records' keyed checksum

    @classmethod
    def derive(cls, operator_key: bytes, pool_id: bytes) -> "PoolKeys":
        from cryptography.hazmat.primitives.hashes import SHA256
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        def hkdf(label: bytes, n: int) -> bytes:
            return HKDF(algorithm=SHA256(), length=n, salt=pool_id, info=b"kvoffload/1 " + label).derive(operator_key)

        mult = np.frombuffer(hkdf(b"record checksum", 17 * 8), "<u8") | np.uint64(1)
        return cls(hkdf(b"slot aes-128-gcm", 16), hkdf(b"index hmac-sha256", 32), mult)


def record_checksums(words: np.ndarray, slots: np.ndarray, mult: np.ndarray) -> np.ndarray:
    """The keyed checksum of each record (its first 15 little-endian words) at its slot.

    Vectorised (a million records in tens of milliseconds): it tells a torn, garbled or
    moved record from a written one. Forgery is the AES-GCM tag's to catch, not this."""
    shift29, shift31, shift32 = np.uint64(29), np.uint64(31), np.uint64(32)
    with np.errstate(over="ignore"):
        h = (slots.astype(np.uint64) + np.uint64(1)) * mult[15]
        for i in range(15):
            h = (h ^ words[:, i]) * mult[i]
            h ^= h >> shift29
        h = (h ^ (h >> shift32)) * mult[16]
        h ^= h >> shift31
    return h


@dataclass(frozen=True)
class Header:
    """One index's header, held by both of its copies."""

    pool_id: bytes
    epoch: int  # which copy is newer where both verify; a pool made now holds 1 in both
    file_index: int
    num_files: int
    num_slots: int  # this file's
    slot_bytes: int
    block_bytes: int
    pool_slots: int
    fingerprint: bytes  # SHA-256 of the summary
    summary: bytes  # the fingerprint's canonical JSON

    def pack(self, keys: PoolKeys) -> bytes:
        b = bytearray(HEADER_COPY_BYTES)
        b[0:8] = MAGIC
        b[8:12] = FORMAT_VERSION.to_bytes(4, "little")
        b[12:16] = HEADER_COPY_BYTES.to_bytes(4, "little")
        b[16:32] = self.pool_id
        b[32:40] = self.epoch.to_bytes(8, "little")
        b[40:44] = self.file_index.to_bytes(4, "little")
        b[44:48] = self.num_files.to_bytes(4, "little")
        for off, v in ((48, self.num_slots), (56, self.slot_bytes), (64, self.block_bytes), (72, self.pool_slots)):
            b[off:off + 8] = v.to_bytes(8, "little")
        b[80:112] = self.fingerprint
        b[112:114] = len(self.summary).to_bytes(2, "little")
        b[_SUMMARY_OFFSET:_SUMMARY_OFFSET + len(self.summary)] = self.summary
        b[_CRC_OFFSET:_MAC_OFFSET] = zlib.crc32(b[:_CRC_OFFSET]).to_bytes(4, "little")
        b[_MAC_OFFSET:] = hmac.digest(keys.index, bytes(b[:_MAC_OFFSET]), "sha256")
        return bytes(b)


class _CopyState:
    """Why a header copy did not verify, in the order start-up reports it."""

    NOT_OURS, NEWER, DAMAGED, WRONG_KEY = "not ours", "newer", "damaged", "wrong key"


def _structure(raw: bytes) -> tuple[Optional[str], int]:
    """Whether one copy is a kvoffload header of this format by its unkeyed checks (magic,
    format version, copy size, CRC over the rest, summary length): (why not or None, its
    version). Enough to prove a file is kvoffload's (``forget``); not that it is genuine."""
    if len(raw) < HEADER_COPY_BYTES or raw[0:8] != MAGIC:
        return _CopyState.NOT_OURS, 0
    version = int.from_bytes(raw[8:12], "little")
    if version != FORMAT_VERSION:
        return (_CopyState.NEWER if version > FORMAT_VERSION else _CopyState.DAMAGED), version
    if (int.from_bytes(raw[12:16], "little") != HEADER_COPY_BYTES
            or zlib.crc32(raw[:_CRC_OFFSET]) != int.from_bytes(raw[_CRC_OFFSET:_MAC_OFFSET], "little")
            or int.from_bytes(raw[112:114], "little") > MAX_SUMMARY_BYTES):
        return _CopyState.DAMAGED, version
    return None, version


def _unpack(raw: bytes, operator_key: bytes) -> tuple[Optional[Header], Optional[str], int, Optional[PoolKeys]]:
    """(header or None, why not, its format version, the pool's keys) of one copy."""
    why, version = _structure(raw)
    if why is not None:
        return None, why, version, None
    pool_id = bytes(raw[16:32])
    keys = PoolKeys.derive(operator_key, pool_id)
    if not hmac.compare_digest(hmac.digest(keys.index, bytes(raw[:_MAC_OFFSET]), "sha256"), raw[_MAC_OFFSET:]):
        return None, _CopyState.WRONG_KEY, version, None
    n = int.from_bytes(raw[112:114], "little")
    i64 = lambda off: int.from_bytes(raw[off:off + 8], "little")  # noqa: E731
    return Header(pool_id, i64(32), int.from_bytes(raw[40:44], "little"), int.from_bytes(raw[44:48], "little"),
                  i64(48), i64(56), i64(64), i64(72), bytes(raw[80:112]),
                  bytes(raw[_SUMMARY_OFFSET:_SUMMARY_OFFSET + n])), None, version, keys


_UNTOUCHED = "it is left untouched"


def _read_fully(osc: OsCalls, fd: int, buf: memoryview, offset: int, path: str, what: str) -> None:
    """Fill ``buf`` from ``offset``, or refuse: a failed or short read is never taken for
    what the file holds (a transient fault would otherwise pass for a blank index)."""
    try:
        got = moved(osc.preadv(fd, [buf], offset), osc.preadv)
    except OSError as e:
        raise PersistError(f"cannot read {what} of {path} at byte {offset}: {e.strerror or e}; {_UNTOUCHED}: "
                           "start again once the disk reads") from None
    if got != len(buf):
        raise PersistError(f"cannot read {what} of {path} at byte {offset}: short read ({got} of {len(buf)} bytes); "
                           f"{_UNTOUCHED}: start again once the disk reads")


def read_header(osc: OsCalls, fd: int, path: str, operator_key: bytes) -> tuple[Header, PoolKeys]:
    """The newest copy of ``path``'s header that verifies and the pool's keys; a
    ``PersistError`` naming the reason otherwise (a file too short for a header included)."""
    size = _size(osc, fd, path)
    if size < RECORDS_OFFSET:
        raise PersistError(f"{path} is {size} bytes, too short for a kvoffload index; {_UNTOUCHED}: use another "
                           "disk_path")
    raw = bytearray(RECORDS_OFFSET)
    _read_fully(osc, fd, memoryview(raw), 0, path, "the index header")
    found = []
    states = []
    for copy in (0, 1):
        start = copy * HEADER_COPY_BYTES
        hdr, why, version, keys = _unpack(raw[start:start + HEADER_COPY_BYTES], operator_key)
        if hdr is not None:
            found.append((hdr.epoch, copy, hdr, keys))
        else:
            states.append((why, version))
    if found:
        _, _, hdr, keys = max(found, key=lambda f: f[:2])
        return hdr, keys
    whys = {w for w, _ in states}
    if _CopyState.NEWER in whys:
        v = max(v for w, v in states if w == _CopyState.NEWER)
        raise PersistError(f"{path} was written by a newer kvoffload (index format {v}; this one reads "
                           f"{FORMAT_VERSION}); {_UNTOUCHED}: upgrade kvoffload, or use another disk_path")
    if _CopyState.WRONG_KEY in whys:
        raise PersistError(f"{path} does not verify under this key (the wrong persist key, or another pool's "
                           f"index); {_UNTOUCHED}: give the key it was written with, or remove it with "
                           f"`python -m kvoffload forget {_data_path(path)}`")
    if whys == {_CopyState.NOT_OURS}:
        raise PersistError(f"{path} is not a kvoffload index; {_UNTOUCHED}: use another disk_path")
    raise PersistError(f"{path}: both header copies are damaged, so nothing proves it is kvoffload's; {_UNTOUCHED}: "
                       f"use another disk_path, or remove {_data_path(path)} and {path} yourself")


def _size(osc: OsCalls, fd: int, path: str) -> int:
    try:
        return osc.fstat(fd).st_size
    except OSError as e:
        raise PersistError(f"cannot examine {path}: {e.strerror or e}; {_UNTOUCHED}") from None


def _data_path(index_path: str) -> str:
    return index_path.removesuffix(INDEX_SUFFIX)


def write_headers(osc: OsCalls, fd: int, path: str, hdr: Header, keys: PoolKeys) -> None:
    """Write ``hdr`` into both copies of a new index and make it durable (fdatasync)."""
    data = memoryview(hdr.pack(keys) * 2)
    try:
        n = moved(osc.pwritev(fd, [data], 0), osc.pwritev)
        if n != len(data):
            raise OSError(errno.EIO, f"short write ({n} of {len(data)} bytes)")
        osc.fdatasync(fd)
    except OSError as e:
        raise PersistError(f"cannot write the index header of {path}: {e.strerror or e}") from None


def describe_mismatch(path: str, have: Header, want: Header) -> Optional[str]:
    """The one-line refusal when ``have`` (the file's) is not the pool ``want`` describes."""
    diffs = []
    for name, a, b in (("slots", have.num_slots, want.num_slots), ("slot bytes", have.slot_bytes, want.slot_bytes),
                       ("block bytes", have.block_bytes, want.block_bytes),
                       ("disk paths", have.num_files, want.num_files), ("path index", have.file_index,
                                                                        want.file_index)):
        if a != b:
            diffs.append(f"{name} {a} (this server: {b})")
    if have.fingerprint != want.fingerprint:
        try:
            old, new = json.loads(have.summary), json.loads(want.summary)
        except ValueError:
            old, new = {}, {}
        named = [f"{k} {old.get(k)!r} (this server: {new.get(k)!r})" for k in sorted(set(old) | set(new))
                 if old.get(k) != new.get(k)]
        diffs += named or ["the KV layout"]
    if not diffs:
        return None
    return (f"{path} holds KV of another model or layout: {'; '.join(diffs)}; it is left untouched: use another "
            f"disk_path, or remove it with `python -m kvoffload forget {_data_path(path)}`")


@dataclass
class FileRecords:
    """The records of one index as start-up found them (local slot order)."""

    raw: np.ndarray  # RECORD_DTYPE, one per slot
    valid: np.ndarray  # bool: a record whose checksum holds
    torn: np.ndarray  # bool: neither empty nor valid (torn, garbled, moved)

    @classmethod
    def empty(cls, n: int) -> "FileRecords":
        return cls(np.zeros(n, RECORD_DTYPE), np.zeros(n, bool), np.zeros(n, bool))

    @property
    def any_valid(self) -> bool:
        return bool(self.valid.any())


def read_records(osc: OsCalls, fd: int, path: str, num_slots: int, keys: PoolKeys) -> FileRecords:
    """Every record of the index, checked. A read that fails or comes back short refuses
    (``PersistError``) rather than take those slots for empty; a chunk holding a record that
    does not check is read again and must read the same (a torn record is what the disk
    holds, not a bit flipped on its way here)."""
    size, want = _size(osc, fd, path), RECORDS_OFFSET + num_slots * RECORD_BYTES
    if size < want:
        raise PersistError(f"{path} is {size} bytes but its header describes {num_slots} slots ({want} bytes); "
                           f"{_UNTOUCHED}: remove the pool with `python -m kvoffload forget {_data_path(path)}`")
    buf = np.zeros(num_slots * RECORD_BYTES, np.uint8)
    mv = memoryview(buf)
    for off in range(0, len(buf), _READ_CHUNK):
        _read_fully(osc, fd, mv[off:off + _READ_CHUNK], RECORDS_OFFSET + off, path, "the index records")
    records = _check(buf, num_slots, keys)
    for chunk in np.unique(np.flatnonzero(records.torn) * RECORD_BYTES // _READ_CHUNK).tolist():
        off = chunk * _READ_CHUNK
        part, again = mv[off:off + _READ_CHUNK], bytearray(min(_READ_CHUNK, len(buf) - off))
        _read_fully(osc, fd, memoryview(again), RECORDS_OFFSET + off, path, "the index records")
        if part != again:
            raise PersistError(f"{path} read differently twice at byte {RECORDS_OFFSET + off} (a fault on the way "
                               f"from the disk); {_UNTOUCHED}: start again")
    return records


def _check(buf: np.ndarray, num_slots: int, keys: PoolKeys) -> FileRecords:
    words = buf.view("<u8").reshape(num_slots, RECORD_BYTES // 8)
    raw = buf.view(RECORD_DTYPE)
    empty = ~words.any(axis=1)
    sums = record_checksums(words, np.arange(num_slots, dtype=np.uint64), keys.mult)
    valid = ((sums == words[:, 15]) & (raw["gen"] != 0) & (raw["key_len"] >= 1) & (raw["key_len"] <= MAX_KEY_BYTES)
             & ~raw["reserved"].any(axis=1) & ~raw["pad"].any(axis=1) & ~empty)
    return FileRecords(raw, valid, ~valid & ~empty)


def pack_records(local: np.ndarray, gens: np.ndarray, seqs: np.ndarray, nonces: np.ndarray, tags: np.ndarray,
                 keys_: Sequence[bytes], pool: PoolKeys) -> np.ndarray:
    """Records for slots ``local`` of one file (an all-zero row where ``gens`` is 0: empty);
    ``nonces`` and ``tags`` one row of 12 and 16 bytes each."""
    n = len(local)
    rec = np.zeros(n, RECORD_DTYPE)
    rec["gen"], rec["seq"] = gens, seqs
    if n:
        nonce = np.ascontiguousarray(nonces, np.uint8).reshape(n, 12)
        rec["nonce_lo"] = np.ascontiguousarray(nonce[:, :8]).view("<u8").ravel()
        rec["nonce_hi"] = np.ascontiguousarray(nonce[:, 8:]).view("<u4").ravel()
        rec["tag"] = np.asarray(tags, np.uint8).reshape(n, 16)
        rec["key_len"] = [len(k) for k in keys_]
        rec["key"] = np.frombuffer(b"".join(k.ljust(MAX_KEY_BYTES, b"\0") for k in keys_), np.uint8).reshape(n, -1)
    words = rec.view("<u8").reshape(n, RECORD_BYTES // 8)
    rec["checksum"] = record_checksums(words, np.asarray(local, np.uint64), pool.mult)
    empty = np.asarray(gens) == 0
    if empty.any():
        rec[empty] = np.zeros(1, RECORD_DTYPE)
    return rec
