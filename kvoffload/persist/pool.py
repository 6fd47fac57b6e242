"""One persistent pool at start-up and while serving: its files opened and checked, what
they hold that may be served (``restorable``), and the records written as stores land.

``read_pool`` and ``agree`` are the scheduler's side: it reads the pool the IO processes
own, and serves a slot only where every rank holds the same block.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import os
import stat
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvoffload.os_calls import OsCalls, moved
from kvoffload.persist.index_file import (
    _READ_CHUNK,
    _UNTOUCHED,
    INDEX_SUFFIX,
    MAX_KEY_BYTES,
    MAX_SUMMARY_BYTES,
    RECORD_BYTES,
    RECORDS_OFFSET,
    FileRecords,
    Header,
    PoolKeys,
    _read_fully,
    _size,
    describe_mismatch,
    pack_records,
    read_header,
    read_records,
    write_headers,
)
from kvoffload.persist.operator_key import Persist, PersistError, summary
from kvoffload.slot_keeper import Restored
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
