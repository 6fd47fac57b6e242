"""``python -m kvoffload forget``: prove a pool is kvoffload's, then wipe and remove it.

Nothing is changed until every check passed; the index is overwritten before it is
removed, so the pool id that salts the key is gone and the data file's ciphertext
cannot be decrypted even with the operator's key.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Optional

from kvoffload.os_calls import OsCalls, moved
from kvoffload.persist.index_file import (
    FORMAT_VERSION,
    HEADER_COPY_BYTES,
    INDEX_SUFFIX,
    RECORD_BYTES,
    RECORDS_OFFSET,
    _CopyState,
    _data_path,
    _structure,
    _unpack,
)
from kvoffload.persist.operator_key import PersistError
from kvoffload.slot_file import _close_quietly, split_disk_path

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
