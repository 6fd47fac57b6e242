"""What the drive under a disk path really did: its block device's own counters.

A "disk" tier can be served from RAM without anyone noticing: a page cache that holds the
working set, a tmpfs or other RAM-backed file system, a misconfigured path. The kernel
counts what each block device really reads and writes (``/sys/dev/block/MAJ:MIN/stat``:
sectors of 512 bytes, the third field read, the seventh written), for all its users;
kvoffload reports them per disk path beside the bytes it moved itself, so loads the drive
never saw show as such. A path on no block device (tmpfs, overlay, a network file system)
says so instead. Read with plain ``open`` like ``/proc/meminfo``: it is the kernel's
bookkeeping, not a file of the pool's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvoffload.os_calls import OsCalls

SECTOR_BYTES = 512


@dataclass(frozen=True)
class BlockDevice:
    name: str  # the kernel's name: "nvme0n1p1", "vda", "loop3", "dm-0"
    stat_path: str

    def bytes_moved(self) -> Optional[tuple[int, int]]:
        """(bytes read, bytes written) since the device appeared; None where unreadable."""
        try:
            with open(self.stat_path) as fh:
                fields = fh.read().split()
            return int(fields[2]) * SECTOR_BYTES, int(fields[6]) * SECTOR_BYTES
        except (OSError, ValueError, IndexError):
            return None


def of_file(osc: OsCalls, fd: int) -> Optional[BlockDevice]:
    """The block device holding the open file ``fd``, or None: on no block device, or none
    this process can see (``/sys`` unreadable, or the file's ``fstat`` failed). Only a
    report hangs on it, so it never fails the caller."""
    try:
        return of_device(osc.fstat(fd).st_dev)
    except OSError:
        return None


def of_device(st_dev: int) -> Optional[BlockDevice]:
    """The block device whose ``st_dev`` this is, or None (no block device counters)."""
    base = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
    dev = BlockDevice(os.path.basename(os.path.realpath(base)), base + "/stat")
    return dev if dev.bytes_moved() is not None else None


def describe(dev: Optional[BlockDevice]) -> str:
    return dev.name if dev is not None else ("no block device (RAM-backed, remote, or not visible in /sys: no drive's "
                                             "counters show these reads)")
