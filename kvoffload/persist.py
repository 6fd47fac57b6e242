"""Persistent slot files (opt-in): blocks that survive a restart, checked before any is served.

By default kvoffload keeps nothing at rest (``slot_file``: an anonymous file, a key in
memory). With ``DiskBackend.init(persist=Persist(...))`` each disk path P gets two
named files, kept across restarts:

- ``P``, the data file: the slots exactly as the anonymous file holds them (padded
  for O_DIRECT, AES-128-GCM ciphertext);
- ``P.index``, the index (buffered: O_DIRECT cannot take 128-byte writes, and a
  separate file keeps its writes off the data file's inode lock): two copies of a
  header, then one 128-byte record per slot (key, generation, nonce, tag, LRU
  sequence, checksum), written once the slot's data write succeeded.

Keys. The operator's 32-byte key (``read_operator_key``: a file only its owner can
read, or an environment variable) is only ever held in memory. What kvoffload uses is
derived from it with HKDF-SHA256, salted with the pool's random id (in the header): a
16-byte AES-GCM key for the slots and a 32-byte key for the header's HMAC and the
records' checksums. Nothing derived from the key is written but MACs and tags.

What a slot is authenticated to (its AES-GCM associated data): the fingerprint of the
model and KV layout, its slot, its generation (one more per store to the slot) and its
key (the block hash it claims). A block moved to another slot, swapped, written for
another model or rank, or torn by a crash fails its tag: a load error, recomputed once,
never served. The index only says where to look: correctness never rests on it, nor on
the order in which writes reach the disk.

Nonces: each start draws a fresh random 96-bit start from the operating system's
CSPRNG and counts up from it, never from anything the files hold: a pool restored from
a backup or snapshot, copied to another host or started many times never repeats a
(key, nonce) pair except with the probability docs/design.md bounds (N starts sealing
Q blocks in all: at most N * Q / 2**95). Start-up writes nothing to an existing pool,
and refuses, in one line and with every file as it was, whatever it could not read.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import stat
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvoffload.os_calls import OsCalls, moved
from kvoffload.slot_file import (
    O_DIRECT,
    SlotFile,
    SlotFileError,
    _alignment,
    _close_quietly,
    _fix_mode,
    _open_directory,
    _prefill,
    _reserve,
    file_slots,
    slot_bytes_for,
    split_disk_path,
    sync_quietly,
)

logger = logging.getLogger("kvoffload")

FORMAT_VERSION = 1
MAGIC = b"KVOFFIDX"
INDEX_SUFFIX = ".index"
OPERATOR_KEY_BYTES = 32
MAX_KEY_BYTES = 48  # a block key: vLLM's sha256 block hash and group id take 36
# A slot's identity, the part of its associated data the index carries: generation,
# key length, key (zero padded).
IDENT_BYTES = 8 + 1 + MAX_KEY_BYTES
FINGERPRINT_BYTES = 32
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


class PersistError(ValueError):
    """A persistent file set that start-up refuses; the message is one line and says what to do.
    Nothing was changed on disk."""


@dataclass(frozen=True)
class Persist:
    """``DiskBackend.init(persist=...)``: the operator's key and what the KV is of.

    ``fingerprint``: what the stored KV depends on besides the tokens (model, dtype, block
    size, layer shapes, rank, ...), as short JSON values; a file written under another
    fingerprint is refused at start-up and its blocks would fail their tags.
    """

    key: bytes = field(repr=False)
    fingerprint: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) != OPERATOR_KEY_BYTES:
            raise ValueError(f"persist key must be {OPERATOR_KEY_BYTES} bytes")  # never print the key itself
        if not isinstance(self.fingerprint, Mapping) or not all(isinstance(k, str) for k in self.fingerprint):
            raise TypeError("persist fingerprint must be a mapping with str keys")
        try:
            summary(self.fingerprint)
        except (TypeError, ValueError) as e:
            raise TypeError(f"persist fingerprint must hold JSON values: {e}") from None


def summary(fingerprint: Mapping[str, Any]) -> bytes:
    """The fingerprint's canonical JSON (what the header holds and its digest covers)."""
    return json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


# -- the operator's key ---------------------------------------------------------------


def read_operator_key(key_file: Optional[str] = None, key_env: Optional[str] = None,
                      environ: Optional[Mapping[str, str]] = None) -> bytes:
    """The operator's key from exactly one of ``key_file`` (a regular file, not a symlink,
    that no one but its owner may read or write, owned by this user or root, holding 32
    bytes or 64 hex digits) or the environment variable ``key_env`` (64 hex digits).
    A refusal is a one-line ``PersistError`` that never contains key material."""
    if (key_file is None) == (key_env is None):
        raise PersistError("persist needs exactly one of persist_key_file (a file holding the key) or "
                           "persist_key_env (the name of an environment variable holding it)")
    if key_env is not None:
        env = os.environ if environ is None else environ
        if key_env not in env:
            raise PersistError(f"persist_key_env: environment variable {key_env} is not set")
        key = _parse_key(env[key_env].encode(errors="replace"), hex_only=True)
        if key is None:
            raise PersistError(f"persist_key_env: {key_env} must hold exactly {2 * OPERATOR_KEY_BYTES} hex digits, "
                               f"nothing else but one trailing newline (a {OPERATOR_KEY_BYTES}-byte key, e.g. from "
                               f"`openssl rand -hex 32`)")
        return key
    return _read_key_file(key_file)


def _read_key_file(path: str) -> bytes:
    where = f"persist_key_file {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PersistError(f"{where} is a symlink; give the key file itself") from None
        raise PersistError(f"{where}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the file opened, not the name: no swap in between
        if not stat.S_ISREG(st.st_mode):
            raise PersistError(f"{where} is not a regular file")
        if st.st_mode & 0o077:
            raise PersistError(f"{where} has mode {stat.S_IMODE(st.st_mode):o}: others may read or change the "
                               f"key; chmod 600 {path}")
        if st.st_uid not in (os.geteuid(), 0):
            raise PersistError(f"{where} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root")
        data = os.read(fd, 4 * OPERATOR_KEY_BYTES)
    except OSError as e:
        raise PersistError(f"{where}: {e.strerror}") from None
    finally:
        os.close(fd)
    key = _parse_key(data, hex_only=False)
    if key is None:
        raise PersistError(f"{where} must hold exactly {OPERATOR_KEY_BYTES} bytes, or exactly "
                           f"{2 * OPERATOR_KEY_BYTES} hex digits and at most one trailing newline "
                           f"(got {len(data)}{'+' if len(data) == 4 * OPERATOR_KEY_BYTES else ''} bytes); "
                           f"make one with `head -c {OPERATOR_KEY_BYTES} /dev/urandom > {path}`")
    return key


_HEX_KEY = re.compile(rb"[0-9a-fA-F]{%d}\n?" % (2 * OPERATOR_KEY_BYTES))


def _parse_key(data: bytes, hex_only: bool) -> Optional[bytes]:
    """The key in ``data``: exactly 32 raw bytes (a file only), or exactly 64 hex digits
    with at most one trailing newline. Nothing else: ``bytes.fromhex`` alone would skip
    whitespace and take 60 digits and 4 spaces as a 30-byte key."""
    if not hex_only and len(data) == OPERATOR_KEY_BYTES:
        return data
    if _HEX_KEY.fullmatch(data):
        return bytes.fromhex(data[: 2 * OPERATOR_KEY_BYTES].decode("ascii"))
    return None


# -- what is derived from it ------------------------------------------------------------


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


def check_keys(keys: Any, n: int) -> list[bytes]:
    """``launch_copy``'s ``keys`` for a persistent store of ``n`` blocks: one non-empty
    bytes of at most ``MAX_KEY_BYTES`` per block."""
    if keys is None:
        raise ValueError("keys: a store to a persistent pool needs each block's key (the block hash it holds)")
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of bytes, one per block, got {type(keys).__name__}")
    out = list(keys)
    if len(out) != n:
        raise ValueError(f"keys: {len(out)} keys for {n} blocks")
    for k in out:
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"keys: each key must be 1 to {MAX_KEY_BYTES} bytes, got {k!r:.60}")
    return out


# -- the header ----------------------------------------------------------------------------


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
    return index_path[: -len(INDEX_SUFFIX)] if index_path.endswith(INDEX_SUFFIX) else index_path


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


# -- records ---------------------------------------------------------------------------------


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


# -- one pool's files on disk ----------------------------------------------------------------


@dataclass
class Restored:
    """What start-up found in a pool's indexes: per global slot its record (valid ones only),
    and how many records it did not take, by cause."""

    slots: np.ndarray  # global slot ids, least recently stored first
    keys: list[bytes]  # parallel: the block key each holds
    refused: Counter = field(default_factory=Counter)

    def entries(self) -> list[tuple[int, bytes]]:
        return list(zip(self.slots.tolist(), self.keys))


def _keys_of(raw: np.ndarray) -> list[bytes]:
    key, n = raw["key"], raw["key_len"].tolist()
    flat = np.ascontiguousarray(key).tobytes()
    return [flat[MAX_KEY_BYTES * i:MAX_KEY_BYTES * i + k] for i, k in enumerate(n)]


def restorable(per_file: Sequence[FileRecords], reserved: Sequence[int] = ()) -> Restored:
    """The pool's loadable blocks, least recently stored first: each valid record's slot
    (slot s lives in file s % n at s // n) and key; where two slots hold one key, the
    newer one (a slot whose block was evicted and stored again elsewhere keeps its bytes
    until overwritten). ``reserved``: slots the caller never hands out (vLLM's null block).
    Vectorised: a million records in well under a second."""
    n = len(per_file)
    slots, seqs, idents = [], [], []
    refused: Counter = Counter()
    for i, fr in enumerate(per_file):
        refused["checksum"] += int(fr.torn.sum())
        local = np.flatnonzero(fr.valid)
        raw = fr.raw[local]
        slots.append(local * n + i)
        seqs.append(raw["seq"])
        ident = np.zeros((len(raw), 1 + MAX_KEY_BYTES), np.uint8)
        ident[:, 0], ident[:, 1:] = raw["key_len"], raw["key"]
        idents.append(ident)
    all_slots = np.concatenate(slots).astype(np.int64)
    order = np.argsort(np.concatenate(seqs), kind="stable")
    keys = np.concatenate(idents)[order]
    # The newest record of each key: the first one of each key in the reversed order.
    _, first_rev = np.unique(keys[::-1].view(np.dtype((np.void, keys.shape[1]))).ravel(), return_index=True)
    newest = np.zeros(len(order), bool)
    newest[len(order) - 1 - first_rev] = True
    refused["duplicate"] += int((~newest).sum())
    keep = newest & ~np.isin(all_slots[order], np.asarray(list(reserved), np.int64))
    refused["reserved"] += int((newest & ~keep).sum())
    kept = keys[keep]
    flat = kept[:, 1:].tobytes()
    lens = kept[:, 0].tolist()
    return Restored(all_slots[order][keep], [flat[MAX_KEY_BYTES * i:MAX_KEY_BYTES * i + k]
                                              for i, k in enumerate(lens)], +refused)


@dataclass
class IndexFile:
    """One open index: its path and the header it holds."""

    path: str
    file_index: int
    header: Optional[Header] = None
    held: list[int] = field(default_factory=list, repr=False)  # [fd] while open (as SlotFile.held)

    @property
    def fd(self) -> int:
        return self.held[0]


class Pool:
    """One persistent pool: the index of each of its data files, the keys, and what
    start-up found in the records.

    ``open`` appends every file it opens to its list as it goes (the data files to the
    caller's, the indexes to ``indexes``), so an exception at any line leaves them where
    ``close`` finds them."""

    def __init__(self, osc: OsCalls, persist: Persist, paths: Sequence[str], num_slots: int, block_bytes: int,
                 use_page_cache: bool, layout: Mapping[str, Any]) -> None:
        self.osc, self.persist, self.paths = osc, persist, list(paths)
        self.num_slots, self.block_bytes, self.use_page_cache = num_slots, block_bytes, use_page_cache
        self.summary = summary({**persist.fingerprint, **layout})
        if len(self.summary) > MAX_SUMMARY_BYTES:
            raise PersistError(f"persist fingerprint is {len(self.summary)} bytes of JSON; at most "
                               f"{MAX_SUMMARY_BYTES} fit the header")
        self.fingerprint = hashlib.sha256(self.summary).digest()
        self.indexes: list[IndexFile] = []
        self.records: list[FileRecords] = []
        self.keys: Optional[PoolKeys] = None
        self.new = False  # whether this start made the pool
        self.next_seq = 1  # the LRU sequence of the next record written
        self.created: list[str] = []  # files this start-up made (removed again if it fails)

    # -- start-up ------------------------------------------------------------------

    def open(self, files: list, max_slot_bytes: Optional[int], prefill: bool = False) -> None:
        """Open or create each path's index and data file and check them against the key and
        this server's layout. An existing pool is only read: a refusal (``PersistError``),
        whatever its cause, leaves every file as it was. ``prefill``: write a new pool's data
        files once (``slot_file._prefill``); an existing pool's are never written here."""

        pool_id: Optional[bytes] = None
        try:
            for i, path in enumerate(self.paths):
                pool_id = self._open_path(i, path, file_slots(self.num_slots, len(self.paths), i), files,
                                          max_slot_bytes, pool_id, prefill)
            seqs = [int(fr.raw["seq"][fr.valid].max()) for fr in self.records if fr.any_valid]
            self.next_seq = max(seqs, default=0) + 1
        except BaseException:
            # Only what this start-up made (nothing of value: no block was stored in it);
            # a file that was there before is never removed by a start-up.
            for p in self.created:
                try:
                    self.osc.unlink(p)
                except OSError:
                    pass
            raise

    def _blank(self, ix: IndexFile) -> bool:
        """Whether the index is positively blank: empty, or zeros throughout (a start-up killed
        while creating it, before its header). Nothing in such a pool can be decrypted (its
        id, the key's salt, is in the header), so it is made anew. Anything unread is not
        blank: a failed or short read refuses the start instead."""
        size = _size(self.osc, ix.fd, ix.path)
        chunk = bytearray(min(size, _READ_CHUNK))
        for off in range(0, size, _READ_CHUNK):
            part = memoryview(chunk)[:min(_READ_CHUNK, size - off)]
            _read_fully(self.osc, ix.fd, part, off, ix.path, "the index")
            if any(part):
                return False
        return True

    def _open_path(self, i: int, path: str, num_slots: int, files: list, max_slot_bytes: Optional[int],
                   pool_id: Optional[bytes], prefill: bool) -> bytes:
        """Path ``i``'s index and data file; the pool's id."""
        osc = self.osc
        directory, name = split_disk_path(path)
        ipath = path + INDEX_SUFFIX
        dir_fds: list[int] = []
        try:
            _open_directory(osc, directory, dir_fds)
            dir_fd = dir_fds[0]
            ist, dst = _lstat(osc, name + INDEX_SUFFIX, dir_fd, ipath), _lstat(osc, name, dir_fd, path)
            for st, p in ((ist, ipath), (dst, path)):
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise PersistError(f"{p} is not a regular file; {_UNTOUCHED}: use another disk_path")
            if ist is None and dst is not None:
                raise PersistError(f"{path} exists without its index {ipath}: not a kvoffload persistent file, or "
                                   f"its index was removed; {_UNTOUCHED}: use another disk_path, or "
                                   f"remove it with `python -m kvoffload forget --without-index {path}`")
            ix = IndexFile(ipath, i)
            self.indexes.append(ix)
            flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if ist is None else 0)
            try:
                ix.held.append(osc.open(name + INDEX_SUFFIX, flags, 0o600, dir_fd=dir_fd))
            except OSError as e:
                raise PersistError(f"cannot open {ipath}: {e.strerror or e}") from None
            try:
                # One process per pool: two would write the same records under each other.
                osc.flock(ix.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PersistError(f"{ipath} is in use by another kvoffload process (its flock is held); one "
                                   "server per disk_path") from None
            except OSError as e:
                raise PersistError(f"cannot lock {ipath}: {e.strerror or e}") from None
            if ist is None:
                self.created.append(ipath)
            try:
                _fix_mode(osc, ix.fd)
                # The index lives in the data file's directory: its file system's direct-IO alignment.
                alignment = _alignment(osc, ix.fd, path, self.use_page_cache)
            except OSError as e:
                raise PersistError(f"cannot set up {ipath}: {e.strerror or e}") from None
            slot_bytes = slot_bytes_for(self.block_bytes, alignment, self.use_page_cache)
            new_index = ist is None or self._blank(ix)
            if i == 0:
                self.new = new_index
            elif new_index != self.new:
                raise PersistError(f"{ipath} is {'new' if new_index else 'there'} but {self.paths[0]}{INDEX_SUFFIX} "
                                   f"{'is not' if new_index else 'was new'}: a pool keeps its disk paths; restore "
                                   f"them, or remove the pool with `python -m kvoffload forget "
                                   f"{' '.join(self.paths)}`")
            pool_id = pool_id or (os.urandom(16) if new_index else None)
            if max_slot_bytes is not None and slot_bytes > max_slot_bytes:
                raise SlotFileError(errno.EFBIG, f"the slot file for {path!r} would exceed its budget: {num_slots} "
                                                 f"slots of {self.block_bytes} B are padded to {slot_bytes} B each")
            want = Header(pool_id or b"", 1, i, len(self.paths), num_slots, slot_bytes, self.block_bytes,
                          self.num_slots, self.fingerprint, self.summary)
            if new_index:
                self.keys = PoolKeys.derive(self.persist.key, want.pool_id)
                try:
                    osc.ftruncate(ix.fd, 0)  # no old bytes under the new header
                except OSError as e:
                    raise PersistError(f"cannot set up {ipath}: {e.strerror or e}") from None
                _reserve_index(osc, ix.fd, ipath, num_slots)
                write_headers(osc, ix.fd, ipath, want, self.keys)
                ix.header = want
                records = FileRecords.empty(num_slots)
            else:
                hdr, keys = read_header(osc, ix.fd, ipath, self.persist.key)
                if pool_id is not None and hdr.pool_id != pool_id:
                    raise PersistError(f"{ipath} belongs to another pool than {self.paths[0]}{INDEX_SUFFIX}; "
                                       f"{_UNTOUCHED}: give the pool's own disk paths, or remove them with "
                                       f"`python -m kvoffload forget {' '.join(self.paths)}`")
                why = describe_mismatch(ipath, hdr, dataclasses.replace(want, pool_id=hdr.pool_id, epoch=hdr.epoch))
                if why:
                    raise PersistError(why)
                self.keys, ix.header = keys, hdr
                records = read_records(osc, ix.fd, ipath, num_slots, keys)
                if dst is None and records.any_valid:
                    raise PersistError(f"{path} is missing while its index {ipath} holds records; {_UNTOUCHED}: "
                                       f"restore the data file, or remove the pool with "
                                       f"`python -m kvoffload forget {path}`")
            self.records.append(records)
            if dst is None:
                self.created.append(path)
            files.append(_open_data(osc, dir_fd, path, name, num_slots, slot_bytes, alignment, self.use_page_cache,
                                    create=dst is None, may_resize=not records.any_valid,
                                    prefill=prefill and new_index))
            if new_index or dst is None:
                osc.fsync(dir_fd)  # the new names are durable before any block is stored under them
            _close_quietly(osc, dir_fds, directory)
            return ix.header.pool_id
        except BaseException as e:
            while dir_fds:
                _close_quietly(osc, dir_fds, directory)
            if isinstance(e, OSError) and not isinstance(e, (SlotFileError, PersistError)):
                raise PersistError(f"cannot set up {path}: {e.strerror or e}") from e
            raise

    # -- while serving ---------------------------------------------------------------

    def write(self, file_index: int, local: np.ndarray, gens: np.ndarray, seqs: np.ndarray, nonces: np.ndarray,
              tags: np.ndarray, keys: Sequence[bytes]) -> list[int]:
        """Write the records of slots ``local`` (of file ``file_index``; gen 0: empty) in
        runs of consecutive slots; returns the local slots whose write failed (logged by
        the caller: they keep their old record, whose block then fails its tag)."""
        ix = self.indexes[file_index]
        order = np.argsort(local, kind="stable")
        local = np.asarray(local, np.int64)[order]
        rec = pack_records(local, np.asarray(gens)[order], np.asarray(seqs)[order], np.asarray(nonces)[order],
                           np.asarray(tags)[order], [keys[j] for j in order], self.keys)
        mv = memoryview(rec.view(np.uint8))
        failed: list[int] = []
        j = 0
        while j < len(local):
            j1 = j + 1
            while j1 < len(local) and local[j1] == local[j1 - 1] + 1:
                j1 += 1
            part = mv[j * RECORD_BYTES:j1 * RECORD_BYTES]
            try:
                done = moved(self.osc.pwritev(ix.fd, [part], RECORDS_OFFSET + int(local[j]) * RECORD_BYTES),
                             self.osc.pwritev)
            except OSError:
                done = 0
            if done != len(part):  # a record moved whole (a short write's prefix) stands
                failed += local[j + done // RECORD_BYTES:j1].tolist()
            j = j1
        return failed

    def close(self, sync: bool = True) -> None:
        """Sync (fdatasync, best effort) and close every index; resumable like ``SlotFile.close``."""
        for ix in self.indexes:
            if ix.held:
                if sync:
                    sync_quietly(self.osc, ix.fd, ix.path)
                _close_quietly(self.osc, ix.held, ix.path)


def _lstat(osc: OsCalls, name: str, dir_fd: int, path: str) -> Optional[os.stat_result]:
    try:
        return osc.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PersistError(f"cannot examine {path}: {e.strerror or e}") from None


def _reserve_index(osc: OsCalls, fd: int, path: str, num_slots: int) -> None:
    _reserve(osc, fd, RECORDS_OFFSET + num_slots * RECORD_BYTES, path)


def _open_data(osc: OsCalls, dir_fd: int, path: str, name: str, num_slots: int, slot_bytes: int, alignment: int,
               use_page_cache: bool, create: bool, may_resize: bool, prefill: bool) -> Any:
    """The data file, opened (or created, mode 0600) and checked against its index's size;
    ``prefill``: written once with zeros (a new pool's only)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (0 if use_page_cache else O_DIRECT)
    flags |= os.O_CREAT | os.O_EXCL if create else 0
    fds: list[int] = []
    try:
        try:
            fds.append(osc.open(name, flags, 0o600, dir_fd=dir_fd))
        except OSError as e:
            if e.errno == errno.EINVAL and not use_page_cache:
                raise PersistError(f"the file system of {path!r} does not support O_DIRECT; set use_page_cache=True")
            raise PersistError(f"cannot open {path}: {e.strerror or e}") from None
        _fix_mode(osc, fds[0])
        size, want = osc.fstat(fds[0]).st_size, num_slots * slot_bytes
        if size != want:
            if not (create or (may_resize and size < want)):
                raise PersistError(f"{path} is {size} bytes but its index describes {num_slots} slots of {slot_bytes} "
                                   f"B ({want} bytes); it is left untouched: remove it with "
                                   f"`python -m kvoffload forget {path}`")
            _reserve(osc, fds[0], want, path)
        if prefill:
            _prefill(osc, fds[0], want, path)
        return SlotFile(fds[0], path, True, not use_page_cache, alignment, slot_bytes, num_slots, held=fds, kept=True)
    except BaseException:
        while fds:
            _close_quietly(osc, fds, path)
        raise


# -- the scheduler's side: reading a pool another process owns -------------------------------


def read_pool(paths: Sequence[str], operator_key: bytes, osc: Optional[OsCalls] = None) -> list[FileRecords]:
    """The records of a pool's indexes, read only (the IO process owns and writes them): the
    headers must verify under the key and agree on one pool, and each data file must be
    there, of the size its index describes. Refusals are ``PersistError``s; nothing is
    written."""
    osc = osc or OsCalls()
    out, pool_id = [], None
    for i, path in enumerate(paths):
        ipath = path + INDEX_SUFFIX
        fds: list[int] = []
        try:
            try:
                fds.append(osc.open(ipath, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
            except OSError as e:
                raise PersistError(f"cannot open {ipath}: {e.strerror or e}") from None
            hdr, keys = read_header(osc, fds[0], ipath, operator_key)
            if (pool_id or hdr.pool_id) != hdr.pool_id or hdr.file_index != i or hdr.num_files != len(paths):
                raise PersistError(f"{ipath} is not file {i} of the pool of {', '.join(paths)}")
            pool_id = hdr.pool_id
            try:
                st = osc.lstat(os.path.abspath(path))
            except OSError as e:
                raise PersistError(f"cannot examine {path}: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != hdr.num_slots * hdr.slot_bytes:
                raise PersistError(f"{path} does not match its index")
            out.append(read_records(osc, fds[0], ipath, hdr.num_slots, keys))
        finally:
            while fds:
                _close_quietly(osc, fds, ipath)
    return out


def agree(ranks: Sequence[Sequence[FileRecords]], reserved: Sequence[int] = ()) -> Restored:
    """What every rank's pool holds alike (a slot is a hit only if each rank holds the block:
    a load reads every rank's file), as ``restorable`` gives it; a slot some rank holds
    otherwise (another key, a missing or torn record) is refused as ``rank_mismatch``, or
    ``checksum`` where a record is torn."""
    first = ranks[0]
    merged, mismatched = [], 0
    for i, fr in enumerate(first):
        files = [r[i] for r in ranks]
        if any(len(f.raw) != len(fr.raw) for f in files):
            raise PersistError("the ranks' pools differ in size")
        valid = np.logical_and.reduce([f.valid for f in files])
        same = np.logical_and.reduce([(f.raw["key"] == fr.raw["key"]).all(axis=1) & (f.raw["key_len"] == fr.raw["key_len"])
                                      for f in files])
        torn = np.logical_or.reduce([f.torn for f in files])
        held = np.logical_or.reduce([f.valid | f.torn for f in files])
        ok = valid & same
        mismatched += int((held & ~torn & ~ok).sum())
        merged.append(FileRecords(fr.raw, ok, torn))
    found = restorable(merged, reserved)
    if mismatched:
        found.refused["rank_mismatch"] += mismatched
    return found


# -- forgetting a pool: `python -m kvoffload forget` ----------------------------------------------

_WIPE_CHUNK = 1 << 20


def forget_targets(disk_path: str) -> list[str]:
    """The data files a configured ``disk_path`` names: itself, and the per-rank files
    ``disk_path.dpD.rankR`` the vLLM connector makes, wherever a data file or an index is."""
    import glob

    found = {p for p in (disk_path,) if os.path.lexists(p) or os.path.lexists(p + INDEX_SUFFIX)}
    for p in glob.glob(glob.escape(disk_path) + ".dp*.rank*"):
        found.add(_data_path(p))
    return sorted(found)


def check_forget(path: str, without_index: bool = False, operator_key: Optional[bytes] = None,
                 osc: Optional[OsCalls] = None) -> dict[str, int]:
    """What ``forget`` would remove at ``path`` ({file: size}), once it is proved a kvoffload
    pool: its index's header (magic, format version, size, CRC; under ``operator_key`` also
    its HMAC) describes an index of exactly the file's size, and the data file beside it is
    empty or of the size the header gives. Anything else is a one-line ``PersistError``;
    nothing is changed."""
    osc = osc or OsCalls()
    ipath = path + INDEX_SUFFIX
    have = {}
    for p in (path, ipath):
        try:
            st = osc.lstat(os.path.abspath(p))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise PersistError(f"cannot examine {p}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise PersistError(f"{p} is not a regular file; it is left untouched")
        have[p] = st.st_size
    if not have:
        raise PersistError(f"{path}: no kvoffload pool file or index there")
    if ipath not in have:
        if without_index:
            return have
        raise PersistError(f"{path} has no kvoffload index, so nothing shows it is kvoffload's; it is left "
                           "untouched (add --without-index to wipe it anyway)")
    keep = f"it and {path} are left untouched"
    size = have[ipath]
    raw = bytearray(min(size, RECORDS_OFFSET))
    fds: list[int] = []
    try:
        try:
            fds.append(osc.open(os.path.abspath(ipath), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
            osc.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the fd
            got = moved(osc.preadv(fds[0], [memoryview(raw)], 0), osc.preadv)
        except BlockingIOError:
            raise PersistError(f"{ipath} is in use by a running kvoffload server; stop it first") from None
        except OSError as e:
            raise PersistError(f"cannot read {ipath}: {e.strerror or e}; {keep}") from None
    finally:
        while fds:
            _close_quietly(osc, fds, ipath)
    if got != len(raw):
        raise PersistError(f"cannot read {ipath}: short read ({got} of {len(raw)} bytes); {keep}")
    copies = [bytes(raw[c * HEADER_COPY_BYTES:(c + 1) * HEADER_COPY_BYTES]) for c in (0, 1)]
    states = [_structure(c) for c in copies]
    good = [c for c, (why, _) in zip(copies, states) if why is None]
    if not good:
        newer = [v for why, v in states if why == _CopyState.NEWER]
        if newer:
            raise PersistError(f"{ipath} was written by a newer kvoffload (index format {max(newer)}); {keep}: "
                               "forget it with that version")
        raise PersistError(f"{ipath} holds no kvoffload index header (magic, format {FORMAT_VERSION}, checksum), "
                           f"so nothing proves it is kvoffload's; {keep}")
    num_slots, slot_bytes = int.from_bytes(good[0][48:56], "little"), int.from_bytes(good[0][56:64], "little")
    if size != RECORDS_OFFSET + num_slots * RECORD_BYTES:
        raise PersistError(f"{ipath} is {size} bytes, not the {RECORDS_OFFSET + num_slots * RECORD_BYTES} its header "
                           f"describes, so nothing proves it is kvoffload's; {keep}")
    if operator_key is not None and not any(_unpack(c, operator_key)[0] is not None for c in good):
        raise PersistError(f"{ipath} does not verify under this key: another pool's, or another key's; {keep}")
    if path in have and have[path] not in (0, num_slots * slot_bytes):
        raise PersistError(f"{path} is {have[path]} bytes, not the {num_slots * slot_bytes} its index describes, "
                           f"so nothing proves it is the pool's data; it and {ipath} are left untouched")
    return have


def forget(path: str, without_index: bool = False, osc: Optional[OsCalls] = None,
           operator_key: Optional[bytes] = None) -> str:
    """Wipe the persistent pool file ``path`` and its index so that nothing in them is
    readable afterwards, then remove both; one line saying what was done.

    Only a pool ``check_forget`` proves kvoffload's (a data file without an index only with
    ``without_index``). The index is overwritten with zeros, its records first and its
    header last (a wipe cut short can be run again), and synced: the pool id that salts
    the key is gone, so the data file's ciphertext cannot be decrypted even with the
    operator's key. The data file is then discarded (hole-punched: the file system frees
    its blocks and, where it passes discards on, tells the drive they hold nothing). A
    pool a server holds (its index flock) is refused."""
    osc = osc or OsCalls()
    have = check_forget(path, without_index, operator_key, osc)
    ipath = path + INDEX_SUFFIX
    directory, _ = split_disk_path(path)
    done = []
    fds: list[int] = []
    try:
        if ipath in have:
            fds.append(osc.open(os.path.abspath(ipath), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
            try:
                osc.flock(fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PersistError(f"{ipath} is in use by a running kvoffload server; stop it first") from None
            zeros = memoryview(bytes(_WIPE_CHUNK))
            size = have[ipath]
            spans = [(off, min(_WIPE_CHUNK, size - off)) for off in range(RECORDS_OFFSET, size, _WIPE_CHUNK)]
            for off, n in spans + [(0, RECORDS_OFFSET)]:
                if moved(osc.pwritev(fds[0], [zeros[:n]], off), osc.pwritev) != n:
                    raise OSError(errno.EIO, "short write")
            osc.fdatasync(fds[0])
            done.append(f"index overwritten ({size} bytes)")
        if path in have:
            fds.append(osc.open(os.path.abspath(path), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
            try:
                osc.punch_hole(fds[-1], 0, have[path])
                done.append(f"data discarded ({have[path]} bytes)")
            except OSError as e:
                done.append(f"data not discarded ({e.strerror or e}; without its index it cannot be decrypted)")
            osc.fdatasync(fds[-1])
        for p in (ipath, path):
            if p in have:
                osc.unlink(os.path.abspath(p))
        dfd = osc.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds.append(dfd)
        osc.fsync(dfd)
    except OSError as e:
        raise PersistError(f"wiping {path} failed: {e.strerror or e}") from None
    finally:
        while fds:
            _close_quietly(osc, fds, path)
    return f"forgot {path}: {'; '.join(done)}; removed"
