"""The IO hardware profile: rates of the drive, page cache, host memory, PCIe and sealing.

``python -m kvsim calibrate BENCH.json -o hw.json`` writes one from the output of
``python -m kvoffload.bench --json`` (calibrate.py); ``--hardware hw.json`` (or a
built-in name) uses it. Rates are GiB/s, as the bench prints them. The built-in
profiles, all calibrated from the bench runs recorded in ``tests/data``: one
RAM-backed drive on the H200 (the default: the stand-in for one fast NVMe drive),
four of them (the fast-drive array of the performance issue), and the H200 VM's own
virtual disk, which is what kvoffload's bench ran on, not a deployment's drive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.cli_args import finite_number, read_json, where
from kvsim.limits import MAX_CPUS, MAX_DRIVES, MAX_GIB_S, MAX_US, MIN_GIB_S, integer_in, number_in, shown

GiB = 1 << 30
PROFILE_DIR = Path(__file__).parent / "profiles"
BUILTIN = {"h200-disk": "h200_disk.json", "h200-array": "h200_array.json", "h200-ramdrive": "h200_ramdrive.json"}
# The VM's own virtual disk: a profile for what kvsim itself runs on, not for a deployment.
VM_DISK_PROFILE = "h200-disk"
DEFAULT_PROFILE = "h200-ramdrive"
SEALS = ("aes-gcm", "xxh3", "off")
# A file load moves each byte through DRAM about five times (page cache or drive
# read, staging write, seal read and write, DMA read) against a memcpy's two.
HOST_PASSES = 5


def bytes_per_ns(gib_s: float) -> float:
    return gib_s * GiB / 1e9


@dataclass(frozen=True)
class DiskDirection:
    """One direction of one drive under O_DIRECT.

    An IO of ``b`` bytes alone takes ``latency_us + b / qd1_gib_s``; ``d`` IOs in
    flight overlap until the drive is busy all the time, each IO then holding it for
    ``io_us + b / max_gib_s`` (``io_us``: what every IO costs however deep the queue,
    which caps small IOs at a rate per IO rather than per byte):
    ``min(b / (io_us + b / max_gib_s), d * b / t(b))``.
    """

    latency_us: float
    qd1_gib_s: float
    max_gib_s: float
    io_us: float = 0.0

    def busy_ns(self, io_bytes: int) -> float:
        """How long an IO holds the busy drive."""
        return self.io_us * 1e3 + io_bytes / bytes_per_ns(self.max_gib_s)

    def rate(self, io_bytes: int, depth: float) -> float:
        """Bytes per ns of the drive with ``depth`` IOs of ``io_bytes`` in flight."""
        one = self.latency_us * 1e3 + io_bytes / bytes_per_ns(self.qd1_gib_s)
        return min(io_bytes / self.busy_ns(io_bytes), depth * io_bytes / one)


@dataclass(frozen=True)
class IoCost:
    """A cost per IO of ``b`` bytes: ``us + b / MiB * us_per_mib`` microseconds."""

    us: float = 0.0
    us_per_mib: float = 0.0

    def ns(self, nbytes: int) -> float:
        return self.us * 1e3 + nbytes * self.us_per_mib * 1e3 / (1 << 20)


@dataclass(frozen=True)
class IoProfile:
    name: str
    source: str  # what it was fitted from
    drives: int  # independent drives; kvoffload puts one slot file on each
    cpus: int  # the host's cores: kvoffload sizes its IO threads by them
    disk_read: DiskDirection
    disk_write: DiskDirection
    # One thread's buffered copy out of the page cache; buffered writes into one file,
    # whose threads take turns on its inode lock. All threads together are bounded by
    # host_io_gib_s.
    page_cache_read_gib_s: float
    page_cache_write_gib_s: float
    # File IO of all threads through host memory: the staging buffers, the seal and
    # the DMA each move the bytes through DRAM again (docs/performance.md).
    host_io_gib_s: float
    # One stream of pinned copies (vLLM's per-block copies, the DRAM tier), with a
    # fixed cost per copy call.
    pcie_h2d_gib_s: float
    pcie_d2h_gib_s: float
    copy_call_us: float
    # kvoffload's batched unit copies from all its IO threads together.
    seam_h2d_gib_s: float
    seam_d2h_gib_s: float
    # And per row of such a copy (a descriptor of the batch), on top of its bytes.
    seam_h2d_row_us: float = 0.0
    seam_d2h_row_us: float = 0.0
    # One thread sealing (encrypting or checksumming) or opening a slot.
    seal_gib_s: dict[str, float] = field(default_factory=dict)
    # CPU time kvoffload's IO threads spend per slot holding the GIL (the Python loop,
    # the syscall wrappers, the seal's call): the threads of a direction take turns.
    slot_cpu_us: float = 0.0
    # A slot's first write into a fresh slot file, on top of the write: ext4 converts
    # the fallocated (unwritten) extent, under the inode's lock, so the other threads
    # of that file wait (O_DIRECT); a buffered first write allocates its page-cache
    # pages (the rewrite finds them resident).
    first_write: IoCost = field(default_factory=IoCost)
    first_write_page_cache: IoCost = field(default_factory=IoCost)
    # Where each figure came from, and per bench case its measured and predicted
    # seconds (calibrate.py): for the record.
    notes: list[str] = field(default_factory=list)
    fidelity: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Types before ranges: a JSON profile can hold anything (a string rate, a list
        # where an object belongs), and each must be one clear error naming the field.
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str):
                raise ProfileError(name, f"profile: {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.seal_gib_s, dict) or not all(isinstance(k, str) for k in self.seal_gib_s):
            raise ProfileError("seal_gib_s", f"profile {self.name!r}: seal_gib_s must be an object of rates by seal, "
                                             f"got {self.seal_gib_s!r}")
        if not isinstance(self.notes, list) or not all(isinstance(n, str) for n in self.notes):
            raise ProfileError("notes", f"profile {self.name!r}: notes must be a list of strings")
        if not isinstance(self.fidelity, list) or not all(isinstance(r, dict) for r in self.fidelity):
            raise ProfileError("fidelity", f"profile {self.name!r}: fidelity must be a list of objects")
        for part, cls in _PARTS.items():
            if not isinstance(getattr(self, part), cls):
                raise ProfileError(part, f"profile {self.name!r}: {part} must be an object with "
                                         f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        rates = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name.endswith("_gib_s") and f.name != "seal_gib_s"}
        for d in ("disk_read", "disk_write"):
            rates.update({f"{d}.{k}": v for k, v in vars(getattr(self, d)).items() if k.endswith("_gib_s")})
        rates.update({f"seal_gib_s.{k}": v for k, v in self.seal_gib_s.items()})
        # Each figure in its range (kvsim/limits.py): a rate of 1e-300 GiB/s made IO times
        # past a float's range, 1e9 drives a loop of a billion.
        for name, v in rates.items():
            if not (finite_number(v) and v > 0):
                raise ProfileError(name, f"profile {self.name!r}: {name} must be a number > 0, got {shown(v)}")
            if not number_in(v, MIN_GIB_S, MAX_GIB_S):
                raise ProfileError(name, f"profile {self.name!r}: {name} must be a rate in [{MIN_GIB_S:g}, "
                                         f"{MAX_GIB_S:g}] GiB/s, got {shown(v)}")
        costs = (("copy_call_us", self.copy_call_us), ("seam_h2d_row_us", self.seam_h2d_row_us),
                 ("seam_d2h_row_us", self.seam_d2h_row_us), ("slot_cpu_us", self.slot_cpu_us),
                 *((f"{d}.{k}", getattr(getattr(self, d), k)) for d in ("disk_read", "disk_write")
                   for k in ("latency_us", "io_us")),
                 *((f"{c}.{k}", getattr(getattr(self, c), k)) for c in ("first_write", "first_write_page_cache")
                   for k in ("us", "us_per_mib")))
        for name, v in (("drives", self.drives), ("cpus", self.cpus), *costs):
            if not (finite_number(v) and v >= 0):
                raise ProfileError(name, f"profile {self.name!r}: {name} must be a number >= 0, got {shown(v)}")
        for name, v in costs:
            if v > MAX_US:
                raise ProfileError(name, f"profile {self.name!r}: {name} must be at most {MAX_US:g} us, got {shown(v)}")
        for name, v, most in (("drives", self.drives, MAX_DRIVES), ("cpus", self.cpus, MAX_CPUS)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProfileError(name, f"profile {self.name!r}: {name} must be an integer >= 1, got {shown(v)}")
            if not integer_in(v, 1, most):
                raise ProfileError(name, f"profile {self.name!r}: {name} must be an integer in [1, {most}], "
                                         f"got {shown(v)}")
        if missing := [s for s in SEALS if s != "off" and s not in self.seal_gib_s]:
            raise ProfileError("seal_gib_s", f"profile {self.name!r}: seal_gib_s lacks {', '.join(missing)}")

    def seal_ns_per_byte(self, seal: str) -> float:
        return 0.0 if seal == "off" else 1.0 / bytes_per_ns(self.seal_gib_s[seal])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Any, path: str) -> "IoProfile":
        """The profile in ``doc`` (from ``cli_args.read_json``); an error starts with the
        file and the line of the bad field."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where(path, doc)}: a hardware profile is a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if unknown := sorted(set(doc) - names):
            raise ValueError(f"{where(path, doc, unknown[0])}: unknown profile key(s) {', '.join(unknown)}")
        if missing := sorted(required - set(doc)):
            raise ValueError(f"{where(path, doc)}: profile lacks {', '.join(missing)}")
        kw = dict(doc)
        for key, part in _PARTS.items():
            if key in kw:
                kw[key] = _part(part, kw[key], path, doc, key)
        try:
            return cls(**kw)
        except ProfileError as e:
            top, dot, sub = e.field.partition(".")
            inner = doc.get(top)
            loc = where(path, inner, sub) if dot and isinstance(inner, dict) else where(path, doc, top)
            raise ValueError(f"{loc}: {e}") from None


class ProfileError(ValueError):
    """A profile field of the wrong type or range; ``field`` names it (``disk_read.max_gib_s``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


# The profile's keys that are objects of their own.
_PARTS = {"disk_read": DiskDirection, "disk_write": DiskDirection, "first_write": IoCost,
          "first_write_page_cache": IoCost}


def _part(cls: type, value: Any, path: str, doc: Any, key: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(value, dict):
        raise ValueError(f"{where(path, doc, key)}: {key} must be an object with {', '.join(sorted(names))}")
    if unknown := sorted(set(value) - names):
        raise ValueError(f"{where(path, value, unknown[0])}: {key}: unknown key(s) {', '.join(unknown)}")
    try:
        return cls(**value)
    except TypeError as e:  # a required key missing
        raise ValueError(f"{where(path, value)}: {key}: {e}") from None


def load_profile(name_or_path: str) -> IoProfile:
    """A built-in profile by name (``BUILTIN``) or a JSON file by path."""
    path = PROFILE_DIR / BUILTIN[name_or_path] if name_or_path in BUILTIN else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--hardware {name_or_path!r}: no such file, and not one of {', '.join(BUILTIN)}")
    return IoProfile.from_json(read_json(str(path)), str(path))
