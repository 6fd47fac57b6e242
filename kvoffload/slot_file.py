"""The slot file: one preallocated file of fixed-size slots per disk path.

Slot ``s`` lives at ``s * slot_bytes``. Under O_DIRECT every slot is padded to the
file system's direct-IO alignment so that buffer address, file offset and length
are always aligned, whatever the block size (vLLM #52678, #55424).

The file never has a name while it holds KV bytes: by default it is anonymous
(``O_TMPFILE``); the named fallback creates a uniquely named file with
``O_EXCL|O_NOFOLLOW`` mode 0600 relative to a directory fd and unlinks it before a
single KV byte is written. That hides the data from other users and leaves no file
after a ``kill -9``; it does not keep bytes off the device: the blocks of a deleted
file stay readable on the raw device until reused. What keeps a prompt off the
device is the encryption of every slot (``slot_seal``), whose key never leaves
process memory; ``close`` also discards (hole-punches) the file's blocks.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Optional

from kvoffload.os_calls import OsCalls

logger = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
O_TMPFILE = getattr(os, "O_TMPFILE", 0)
# Slots are padded to at least a page even where the file system would accept
# 512-byte direct IO: NVMe drives with 4 KiB sectors turn smaller writes into
# read-modify-write cycles.
MIN_DIRECT_ALIGNMENT = 4096
FALLBACK_ALIGNMENT = 4096
# A random name that exists already (only if someone plants it) makes O_EXCL fail
# with EEXIST; we try a few names, then give up rather than loop forever.
_CREATE_ATTEMPTS = 3


class SlotFileError(OSError):
    """The slot file could not be created or reserved; the message says why."""


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def file_slots(num_slots: int, num_files: int, i: int) -> int:
    """Slots of file ``i`` when slot ``s`` lives in file ``s % num_files`` (arithmetic, so
    a count of 1e30 is refused by the disk check rather than by ``len(range(...))``)."""
    return max(0, (num_slots - i + num_files - 1) // num_files)


def slot_bytes_for(total_block_bytes: int, alignment: int, use_page_cache: bool) -> int:
    """Bytes one slot takes in the file: the block padded to ``alignment`` under O_DIRECT."""
    if total_block_bytes <= 0:
        raise ValueError(f"total_block_bytes must be > 0, got {total_block_bytes}")
    if use_page_cache:
        return total_block_bytes
    return round_up(total_block_bytes, alignment)


@dataclass
class SlotFile:
    fd: int
    path: str  # the path asked for (its directory holds the data)
    named: bool  # created through the named fallback (unlinked right after)
    direct: bool  # opened with O_DIRECT
    alignment: int  # slot size, staging address and offsets are multiples of this
    slot_bytes: int
    num_slots: int
    # [fd] while open, [] once closed. The fd leaves this list in the very step that
    # closes it, so a close cut short by an interrupt is finished by the next close,
    # and a finished one is never repeated (a second close could hit a reused number).
    held: list[int] = field(default_factory=list, repr=False)
    # A persistent data file (``persist``): named, and kept when closed.
    kept: bool = False

    @property
    def size(self) -> int:
        return self.slot_bytes * self.num_slots

    def close(self, osc: OsCalls, discard: bool = True) -> None:
        """Discard the file's blocks (best effort), then close it; a no-op once closed.

        Punching the whole file out frees its space at once and, on a file system
        mounted with ``discard`` (or an SSD that honours it), tells the drive the
        blocks hold nothing; the data is encrypted either way. A kept file is synced
        instead (fdatasync, best effort), so a clean exit survives a power loss.
        """
        if not self.held:
            return
        if self.kept:
            if discard:  # not from a fork()ed child's copy: the parent still writes
                sync_quietly(osc, self.fd, self.path)
        elif discard:
            try:
                osc.punch_hole(self.fd, 0, self.size)
            except OSError as e:
                logger.info("kvoffload: discarding the slot file of %s failed: %s", self.path, e.strerror)
        _close_quietly(osc, self.held, self.path)

    @classmethod
    def create(
        cls,
        osc: OsCalls,
        path: str,
        num_slots: int,
        block_bytes: int,
        use_page_cache: bool,
        named_file: bool = False,
        max_slot_bytes: Optional[int] = None,
        prefill: bool = False,
    ) -> "SlotFile":
        """Create, secure and preallocate the slot file for ``path``; clean up on any failure.

        ``max_slot_bytes``: the most one slot may take (the caller's disk budget per
        slot); a larger padded slot is refused before any space is reserved. ``prefill``:
        write the whole file once with zeros before it is used (``_prefill``).
        """
        if num_slots < 1:
            raise ValueError(f"num_disk_slots must be >= 1, got {num_slots}")
        directory, name = split_disk_path(path)
        # What this call holds, each recorded in the line that makes it, so an exception
        # at any later line (an interrupt included) finds it: the fds (the directory's,
        # then the slot file's) and the slot file's name while it has one.
        fds: list[int] = []
        names: list[str] = []
        try:
            _open_directory(osc, directory, fds)
            named = _create(osc, fds, directory, name, use_page_cache, named_file, names)
            fd = fds[1]
            alignment = _alignment(osc, fd, path, use_page_cache)
            slot_bytes = slot_bytes_for(block_bytes, alignment, use_page_cache)
            if max_slot_bytes is not None and slot_bytes > max_slot_bytes:
                raise SlotFileError(
                    errno.EFBIG,
                    f"the slot file for {path!r} would exceed its budget: {num_slots} slots of "
                    f"{block_bytes} B are padded to {slot_bytes} B each under O_DIRECT ({alignment} B "
                    f"alignment), {num_slots * slot_bytes} B in all, but only {num_slots * max_slot_bytes} B "
                    "were given. Size the pool with the padded slot (KvoffloadConnector does; vLLM's own "
                    "worker does not), or set use_page_cache (no padding)",
                )
            _reserve(osc, fd, num_slots * slot_bytes, path)
            if prefill:
                _prefill(osc, fd, num_slots * slot_bytes, path)
            _close_quietly(osc, fds, directory, index=0)  # everything after this goes through fd
            sf = cls(fd, path, named, not use_page_cache, alignment, slot_bytes, num_slots, held=fds)
            logger.info(
                "kvoffload slot file for %s: %d slots x %d B = %.2f GiB, %s, %s",
                path, num_slots, slot_bytes, sf.size / 2**30,
                "O_DIRECT" if sf.direct else "page cache", "named+unlinked" if named else "anonymous",
            )
            return sf
        except BaseException as e:
            # The named file's own name first (it is ours: O_EXCL, random), so a failed
            # init leaves no file; then the fds, the slot file's before the directory's.
            for n in names:
                _unlink_quietly(osc, n, fds[0])
            while fds:
                # A failed close of one fd must neither replace the create error nor
                # leak the other fd (found by tests/test_faults_sweep.py).
                _close_quietly(osc, fds, path)
            if isinstance(e, OSError) and not isinstance(e, SlotFileError):
                # statx, fstatvfs or ftruncate failed: say for which path.
                raise SlotFileError(e.errno, f"cannot set up the slot file for {path!r}: {e.strerror}") from e
            raise


def split_disk_path(path: str) -> tuple[str, str]:
    """(directory, file name) of a disk path; a path that names a directory is refused.

    ``'/mnt/nvme/'`` would otherwise become the file ``nvme`` in ``/mnt``.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"disk_path must be a non-empty file path, got {path!r}")
    if path.endswith(os.sep) or os.path.basename(path) in (".", "..") or os.path.isdir(path):
        raise ValueError(
            f"disk_path {path!r} names a directory; give a file path inside it, e.g. "
            f"{os.path.join(path, 'kv')!r} (the file itself never appears there)"
        )
    return os.path.split(os.path.abspath(path))


def _open_directory(osc: OsCalls, directory: str, fds: list[int]) -> None:
    """Open ``directory`` and append its fd to ``fds``; refuse an unsafe one."""
    # O_NOFOLLOW on the directory itself: a parent that is a symlink could point
    # the KV data anywhere; everything after this goes through dir_fd.
    try:
        fds.append(osc.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise SlotFileError(
                e.errno,
                f"disk_path directory {directory!r} is a symlink; give its real path "
                f"({os.path.realpath(directory)!r}) so the KV file cannot be redirected",
            ) from e
        raise SlotFileError(e.errno, f"cannot open disk_path directory {directory!r}: {e.strerror}") from e
    try:
        st = osc.fstat(fds[-1])
    except OSError as e:
        raise SlotFileError(e.errno, f"cannot stat disk_path directory {directory!r}: {e.strerror}") from e
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise SlotFileError(
            errno.EPERM,
            f"disk_path directory {directory!r} is world-writable without the sticky bit "
            f"(mode {stat.S_IMODE(st.st_mode):o}): another user could swap the KV file; "
            "use a private directory",
        )


def _create(osc, fds, directory, name, use_page_cache, named_file, names) -> bool:
    """Create the slot file in the directory ``fds[0]`` and append its fd; whether it is named."""
    flags = os.O_RDWR | os.O_CLOEXEC | (0 if use_page_cache else O_DIRECT)
    if not named_file and O_TMPFILE:
        try:
            fds.append(osc.open(".", flags | O_TMPFILE, 0o600, dir_fd=fds[0]))
        except OSError as e:
            # EOPNOTSUPP/EISDIR: no O_TMPFILE here (old kernel or file system).
            # EINVAL may be O_TMPFILE or O_DIRECT; the named path tells them apart.
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise SlotFileError(e.errno, f"cannot create slot file in {directory!r}: {e.strerror}") from e
            logger.info("O_TMPFILE unavailable in %s (%s); using a named file", directory, e.strerror)
        else:
            try:
                _fix_mode(osc, fds[-1])
            except OSError as e:
                raise SlotFileError(
                    e.errno, f"cannot set mode 0600 on the slot file in {directory!r}: {e.strerror}") from e
            return False
    _create_named(osc, fds, directory, name, flags, use_page_cache, names)
    return True


def _temp_prefix(name: str) -> str:
    return f".{name}.kvoffload-"


def _create_named(osc, fds, directory, name, flags, use_page_cache, names) -> None:
    dir_fd = fds[0]
    # Stale files from earlier runs: vLLM's own backend leaves one named exactly
    # disk_path, which may be world-readable and hold prompts; a kvoffload init
    # killed in the microseconds between its create and unlink leaves an empty one.
    # Start-up never deletes data, though: a stale name that holds bytes stays.
    try:
        stale = [name] + [n for n in osc.listdir(dir_fd) if n.startswith(_temp_prefix(name))]
    except OSError as e:
        raise SlotFileError(e.errno, f"cannot list {directory!r}: {e.strerror}") from e
    for n in stale:
        if _holds_data(osc, dir_fd, directory, n):
            continue
        try:
            osc.unlink(n, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise SlotFileError(e.errno, f"cannot remove stale {os.path.join(directory, n)!r}: {e.strerror}") from e
    for _ in range(_CREATE_ATTEMPTS):
        # A fresh random name per init: two backends starting on one path never
        # unlink each other's file, and a failure can only ever remove our own.
        tmp = _temp_prefix(name) + secrets.token_hex(8)
        # Listed before the open, so an interrupt just after it finds the name
        # (removing a random name that was never made is harmless).
        names.append(tmp)
        try:
            # O_EXCL: never open something that is already there (a symlink planted
            # at the name fails with EEXIST, live or dangling; nothing is followed).
            fds.append(osc.open(tmp, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd))
        except FileExistsError:
            names.remove(tmp)  # not ours
            logger.warning("%s already exists; trying another name", os.path.join(directory, tmp))
            continue
        except OSError as e:
            # Some file systems create the file, then refuse O_DIRECT: the name stays
            # listed, so create() removes it.
            if e.errno == errno.EINVAL and not use_page_cache:
                raise SlotFileError(
                    e.errno,
                    f"the file system of {directory!r} does not support O_DIRECT; "
                    "set use_page_cache=True (kv_connector_extra_config: \"use_page_cache\": true)",
                ) from e
            raise SlotFileError(e.errno, f"cannot create a slot file in {directory!r}: {e.strerror}") from e
        try:
            _fix_mode(osc, fds[-1])
            # Drop the name before any KV byte is written: the data lives only as
            # long as our fd, and a crash leaves nothing behind.
            try:
                osc.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                # Another init on this path removed it as stale: what matters is that
                # the file has no name left.
                if osc.fstat(fds[-1]).st_nlink != 0:
                    raise
        except OSError as e:
            raise SlotFileError(e.errno, f"cannot secure the slot file in {directory!r}: {e.strerror}") from e
        names.remove(tmp)
        return
    raise SlotFileError(
        errno.EEXIST, f"could not create a fresh slot file in {directory!r} in {_CREATE_ATTEMPTS} attempts"
    )


def _holds_data(osc: OsCalls, dir_fd: int, directory: str, name: str) -> bool:
    """Whether the stale ``name`` may hold someone's data, and so must stay (warned about).

    kvoffload unlinks its named file before writing a byte, so its own leftovers are
    empty. A regular file with bytes is someone's: vLLM's own backend's at disk_path
    (plaintext KV), or a file under a name like ours. Nothing needs it gone: our name
    is random and made with O_EXCL. A symlink or an empty file holds nothing: removed
    (unlink never follows a link). A name that cannot be examined stays too."""
    path = os.path.join(directory, name)
    try:
        st = osc.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("kvoffload: cannot stat %s (%s); leaving it", path, e.strerror)
        return True
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return False
    logger.warning("kvoffload: leaving %s (%d bytes): not an empty leftover of a kvoffload start-up, so it may "
                   "hold someone's data (vLLM's own disk backend leaves plaintext KV at disk_path); remove it "
                   "yourself if nothing needs it", path, st.st_size)
    return True


def sync_quietly(osc: OsCalls, fd: int, what: str) -> None:
    """fdatasync, logging a failure: a kept file that could not be synced may lose its newest
    blocks to a power loss, and those then fail their checks; nothing else depends on it."""
    try:
        osc.fdatasync(fd)
    except OSError as e:
        logger.warning("kvoffload: syncing %s failed: %s", what, e.strerror or e)


def _unlink_quietly(osc: OsCalls, name: str, dir_fd: int) -> None:
    try:
        osc.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _close_quietly(osc: OsCalls, fds: list[int], what: str, index: int = -1) -> None:
    """Close ``fds[index]`` and drop it from ``fds`` in one step that no interrupt can split
    (``OsCalls.close`` is ``os.close`` itself)."""
    # close(2): Linux releases the fd even when close reports an error, and a retry
    # could close another thread's fd; so log and go on.
    try:
        osc.close(fds.pop(index))
    except OSError as e:
        logger.warning("closing an fd of %s failed: %s", what, e)


def _fix_mode(osc: OsCalls, fd: int) -> None:
    # open()'s mode is filtered by the umask (0277 would give 0400); set it exactly.
    osc.fchmod(fd, 0o600)


def _alignment(osc: OsCalls, fd: int, path: str, use_page_cache: bool) -> int:
    if use_page_cache:
        return 1
    reported: Optional[tuple[int, int]] = osc.dio_alignment(fd)
    if reported is None:
        return FALLBACK_ALIGNMENT
    mem, off = reported
    if mem == 0 or off == 0:
        raise SlotFileError(
            errno.EINVAL,
            f"the file system of {path!r} reports no O_DIRECT support; set use_page_cache=True",
        )
    return max(mem, off, MIN_DIRECT_ALIGNMENT)


def check_space(osc: OsCalls, path: str, size: int) -> None:
    """Refuse ``size`` bytes that the file system of ``path``'s directory cannot hold,
    before anything is made (the directory gets the same checks as at creation)."""
    directory, _ = split_disk_path(path)
    fds: list[int] = []
    try:
        _open_directory(osc, directory, fds)
        vfs = osc.fstatvfs(fds[0])
        # Closed here on success, not in a finally: one interrupt per call can then land
        # on this line (and the except closes it) but never skip the close.
        _close_quietly(osc, fds, directory)
    except BaseException as e:
        while fds:
            _close_quietly(osc, fds, directory)
        if isinstance(e, OSError) and not isinstance(e, SlotFileError):
            raise SlotFileError(e.errno, f"cannot stat the file system of {directory!r}: {e.strerror}") from e
        raise
    if vfs.f_flag & os.ST_RDONLY:
        # Its free space means nothing: say what will really fail.
        raise SlotFileError(errno.EROFS, f"cannot create a slot file in {directory!r}: {os.strerror(errno.EROFS)}")
    free = _free(vfs)
    if size > free:
        raise _no_space(path, size, free)


def _free(vfs: os.statvfs_result) -> int:
    return vfs.f_bavail * vfs.f_frsize


def _no_space(path: str, size: int, free: int) -> SlotFileError:
    return SlotFileError(errno.ENOSPC, f"not enough space for the slot file of {path!r}: need {size} bytes, {free} free")


PREFILL_CHUNK = 16 << 20


def _prefill(osc: OsCalls, fd: int, size: int, path: str) -> None:
    """Write [0, size) once with zeros. ext4 and XFS hand fallocated space out as unwritten
    extents and convert each on its first write, so a fresh file's first stores run slower
    than rewrites (RAM drives on the H200: 0.35-0.53 of a rewrite; the dev VM's virtio ext4:
    0.83, ``scripts/probe_first_write.py``); written once here, every store is a rewrite,
    for a start-up that costs one full write of the file (docs/config.md)."""
    zeros = memoryview(mmap.mmap(-1, min(PREFILL_CHUNK, size)))  # page-aligned, as O_DIRECT needs
    for off in range(0, size, len(zeros)):
        n = min(len(zeros), size - off)
        try:
            done = osc.pwritev(fd, [zeros[:n]], off)
        except OSError as e:
            raise SlotFileError(e.errno, f"cannot prefill the slot file for {path!r} at byte {off}: "
                                         f"{e.strerror}") from e
        if done != n:
            raise SlotFileError(errno.EIO, f"cannot prefill the slot file for {path!r}: short write at "
                                           f"byte {off} ({done} of {n})")


def _reserve(osc: OsCalls, fd: int, size: int, path: str) -> None:
    # posix_fallocate, not ftruncate: a sparse file would hit ENOSPC in the middle
    # of a run, as a store failure, instead of at start-up.
    free = _free(osc.fstatvfs(fd))
    if size > free:
        raise _no_space(path, size, free)
    try:
        osc.fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_space(path, size, free) from e
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            # No fallocate on this file system (glibc's emulation fails with EINVAL on
            # an O_DIRECT fd). A sparse file still works; ENOSPC then surfaces as
            # failed stores, which the backend reports.
            logger.warning("fallocate unsupported for %s (%s); file is sparse", path, e.strerror)
            osc.ftruncate(fd, size)
            return
        raise SlotFileError(e.errno, f"cannot reserve {size} bytes for {path!r}: {e.strerror}") from e
