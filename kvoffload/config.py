"""``kv_connector_extra_config`` parsing: vLLM's SimpleCPUOffloadConnector keys plus kvoffload's.

Stricter than vLLM 0.33, which calls ``bool()`` on flags (so ``"false"`` is true) and
ignores unknown keys (so a typo silently disables a setting): here every key is
checked whatever the backend, and a bad one is a ``ValueError`` naming the key, the
value and what is allowed. Never imports vLLM.
"""

from __future__ import annotations

import difflib
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from kvoffload.slot_file import MIN_DIRECT_ALIGNMENT, slot_bytes_for

logger = logging.getLogger(__name__)

GiB = 1 << 30
BACKENDS = ("cpu", "disk")
DEFAULT_CPU_BYTES = 8 * GiB  # vLLM 0.33's DEFAULT_CPU_CAPACITY_BYTES
DEFAULT_DISK_CAPACITY_BYTES = 100 * GiB
DEFAULT_DISK_BUFFER_SLOTS = 2

# Opt-in persistence (persist/): the flag and where the operator's key comes from.
PERSIST_KEYS = ("persist", "persist_key_file", "persist_key_env")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Every key vLLM 0.33's connector (or a newer one, #52678/#49644 follow-ups) reads.
VLLM_KEYS = frozenset({
    "kv_offload_backend", "disk_path", "disk_capacity_bytes", "disk_buffer_slots",
    "use_page_cache", "direct_io_alignment", "cpu_bytes_to_use", "cpu_bytes_to_use_per_rank",
    "num_cpu_blocks", "lazy_offload", "lazy_offload_min_prefix_tokens", "async_init",
    "cpu_offload_shared", "cpu_hugepage_block_size",
})
# The keys kvoffload reads the same way from kv_connector_extra_config (OffloadConfig) and
# from a tier entry (vllm_slot_tier.TierConfig): DiskSettings holds each one's default and check.
DISK_SETTING_KEYS = ("disk_capacity_bytes", "use_page_cache", "encrypt", "checksums", "io_threads", "io_unit_bytes",
                     "named_file", "native_io", "prefill_file", *PERSIST_KEYS)
KVOFFLOAD_KEYS = frozenset(DISK_SETTING_KEYS) - VLLM_KEYS
# Keys that were renamed: the message names the new one.
RENAMED_KEYS = {"io_depth": "io_threads"}
KNOWN_KEYS = VLLM_KEYS | KVOFFLOAD_KEYS
# Keys that mean nothing under kv_offload_backend="cpu" (warned about once, then ignored).
DISK_ONLY_KEYS = ("disk_path", "disk_buffer_slots", "direct_io_alignment", *DISK_SETTING_KEYS)

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; case-insensitive"
# ASCII digits only (\d would take other scripts' digits too), and no exponent.
_SIZE_RE = re.compile(r"^\s*(\d*)(?:\.(\d*))?\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII)
# The largest file offset (off_t): no size beyond it can describe a file or a pool.
MAX_SIZE = 2**63 - 1


def parse_size(key: str, value: Any, positive: bool = False) -> int:
    """Bytes from an int or a string such as ``"100GiB"``, ``"512MB"``, ``"1.5 GiB"``;
    with ``positive``, 0 or less is refused too.

    Exact: the digits are read as integers (``"1.07GB"`` is 1,070,000,000 bytes and
    ``"9007199254740993"`` stays odd), never through a float.
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: expected a number of bytes (e.g. 107374182400 or '100GiB'), not a bool")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a JSON number such as 1e9: exact as far as the float is
    if isinstance(value, int):
        n = value
    else:
        n = _parse_size_text(key, value)
    if n > MAX_SIZE:
        raise _too_large(key, value)
    if positive and n <= 0:
        raise ValueError(f"{key}={value!r}: must be > 0")
    return n


def _too_large(key: str, value: Any) -> ValueError:
    return ValueError(f"{key}={value!r} is more than the largest file offset (2**63 - 1 bytes)")


def _parse_size_text(key: str, value: Any) -> int:
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    scale = _UNITS.get((m.group(3).lower() or "b")) if m else None
    if scale is None or not (m.group(1) or m.group(2)):
        raise ValueError(
            f"{key}={value!r}: expected an integer number of bytes or a string with a unit "
            f"({_UNIT_NAMES}), e.g. 107374182400, '100GiB' or '512MB'"
        )
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
    # Bounds before arithmetic, so a thousand-digit string costs nothing: more than 19
    # whole digits exceeds 2**63 at any unit, and a fraction with more than 40 digits
    # (the last one not 0) is no whole number of bytes at any unit (<= 2**40).
    if len(whole) > 19:
        raise _too_large(key, value)
    # whole.frac x scale = (whole x 10^k + frac) x scale / 10^k, all in integers.
    k = len(frac)
    n, rest = divmod((int(whole or "0") * 10**k + int(frac or "0")) * scale, 10**k) if k <= 40 else (0, 1)
    if rest:
        raise ValueError(f"{key}={value!r} is not a whole number of bytes")
    return n


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r}: expected an integer >= {minimum}")
    return value


def _bool(key: str, value: Any) -> bool:
    # Strict on purpose: vLLM's bool("false") is True.
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: expected a JSON boolean (true or false)")
    return value


NATIVE_IO_ENV = "KVOFFLOAD_NATIVE_IO"
_CHOICES = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False, "auto": None, "": None}


def parse_choice(value: Any, name: str) -> Optional[bool]:
    """``native_io`` as given: a bool, None (auto), or on/off/auto (the IO engine, engine.py)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _CHOICES:
        return _CHOICES[value.strip().lower()]
    raise ValueError(f"{name}={value!r}: expected on, off or auto")


@dataclass(frozen=True)
class PersistConfig:
    """``persist``, ``persist_key_file``, ``persist_key_env``: checked together, the same way
    for ``kv_connector_extra_config`` and a tier entry. The key itself is read only when
    the pool opens (``operator_key``)."""

    enabled: bool = False
    key_file: Optional[str] = None
    key_env: Optional[str] = None

    @classmethod
    def from_keys(cls, given: dict[str, Any], encrypt: bool) -> "PersistConfig":
        enabled = _bool("persist", given.get("persist", False))
        key_file, key_env = given.get("persist_key_file"), given.get("persist_key_env")
        if key_file is not None and (not isinstance(key_file, str) or not key_file):
            raise ValueError(f"persist_key_file={key_file!r}: expected a path to the key file")
        if key_env is not None and (not isinstance(key_env, str) or not _ENV_NAME_RE.match(key_env)):
            raise ValueError(f"persist_key_env={key_env!r}: expected the name of an environment variable")
        if not enabled:
            if key_file is not None or key_env is not None:
                raise ValueError("persist_key_file/persist_key_env are set but persist is not true; set "
                                 '"persist": true to keep the disk tier across restarts')
            return cls()
        if (key_file is None) == (key_env is None):
            raise ValueError('"persist": true needs exactly one of persist_key_file (a file only its owner can '
                             "read, holding a 32-byte key) or persist_key_env (an environment variable holding "
                             "it as 64 hex digits)")
        if not encrypt:
            raise ValueError('"persist": true needs encryption: remove "encrypt": false (a kept file holds only '
                             "ciphertext)")
        return cls(True, key_file, key_env)

    def operator_key(self) -> bytes:
        """The operator's key (``persist.read_operator_key``: a one-line ``PersistError`` if unusable)."""
        from kvoffload.persist import read_operator_key

        return read_operator_key(self.key_file, self.key_env)


def num_slots(capacity_bytes: int, slot_bytes: int) -> int:
    """Slots a capacity holds: the ONE sizing rule for scheduler and every rank (vLLM #52921)."""
    n = capacity_bytes // slot_bytes
    if n < 1:
        raise ValueError(
            f"disk_capacity_bytes={capacity_bytes} is smaller than one disk slot ({slot_bytes} bytes)"
        )
    return n


_SIZES = ("disk_capacity_bytes", "io_unit_bytes")
_FLAGS = ("use_page_cache", "encrypt", "checksums", "named_file", "prefill_file")


@dataclass(frozen=True)
class DiskSettings:
    """The backend's settings that the connector and the tier share: one default and one
    check per key. ``parse`` reads them from a config dict (sizes such as ``"1TiB"``);
    a dataclass built directly is checked too, each error naming its key."""

    # Bytes of slot files: per rank for the connector (as in vLLM), all paths together for a tier.
    disk_capacity_bytes: int = DEFAULT_DISK_CAPACITY_BYTES
    use_page_cache: bool = False
    encrypt: bool = True  # AES-GCM per slot: no prompt readable from the disk
    checksums: bool = True  # xxh3 per slot when encrypt is off
    io_threads: Optional[int] = None  # per lane; None: the backend's default
    # Most bytes one IO worker moves per unit; its staging is this (loads: twice). None: the
    # backend's default (disk_backend.default_io_unit_bytes, which says why that size).
    io_unit_bytes: Optional[int] = None
    named_file: bool = False  # skip O_TMPFILE, use the named (and unlinked) file
    # The IO path: True/"on" the native core (refused at start-up where it cannot run),
    # False/"off" the Python path, None/"auto" the core where it was built ($KVOFFLOAD_NATIVE_IO).
    native_io: Optional[bool] = None
    prefill_file: bool = False  # write the slot files once at start-up: first stores at the rewrite rate
    persist: PersistConfig = PersistConfig()  # keep the disk tier across restarts (persist/)

    def __post_init__(self) -> None:
        for key in _SIZES:
            n = getattr(self, key)
            if key == "io_unit_bytes" and n is None:
                continue
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_SIZE:
                raise ValueError(f"{key}={n!r}: must be > 0 bytes and at most 2**63 - 1 (an int; a config "
                                 "dict's sizes such as '1TiB' are parsed by from_extra_config/from_tier_config)")
        if self.io_threads is not None:
            _int("io_threads", self.io_threads, 1)
        for key in _FLAGS:
            _bool(key, getattr(self, key))
        object.__setattr__(self, "native_io", parse_choice(self.native_io, "native_io"))
        if not isinstance(self.persist, PersistConfig):
            raise ValueError(f"persist={self.persist!r}: expected a PersistConfig (the config parsers read the "
                             "persist keys)")
        if self.persist.enabled and not self.encrypt:
            raise ValueError('"persist": true needs encryption: remove "encrypt": false')

    @staticmethod
    def parse(given: dict[str, Any]) -> dict[str, Any]:
        """The settings ``given`` sets (of ``DISK_SETTING_KEYS``), parsed and checked, as
        keywords for the dataclass; ``persist`` always (off where its keys are absent)."""
        kw: dict[str, Any] = {}
        for key in _SIZES:
            if key in given:
                kw[key] = parse_size(key, given[key], positive=True)
        if "io_threads" in given:
            kw["io_threads"] = _int("io_threads", given["io_threads"], 1)
        for key in _FLAGS:
            if key in given:
                kw[key] = _bool(key, given[key])
        if "native_io" in given:
            kw["native_io"] = parse_choice(given["native_io"], "native_io")
        kw["persist"] = PersistConfig.from_keys({k: given[k] for k in PERSIST_KEYS if k in given},
                                                kw.get("encrypt", True))
        return kw

    @property
    def seal(self) -> str:
        """How each slot is sealed: aes-gcm, xxh3 or off."""
        return "aes-gcm" if self.encrypt else "xxh3" if self.checksums else "off"

    def backend_kwargs(self) -> dict[str, Any]:
        """These settings as ``DiskBackend.init`` keywords (the caller adds the rest)."""
        kw = {"encrypt": self.encrypt, "checksums": self.checksums, "io_threads": self.io_threads,
              "named_file": self.named_file, "capacity_bytes": self.disk_capacity_bytes,
              "native_io": self.native_io, "prefill": self.prefill_file}
        if self.io_unit_bytes is not None:  # else the backend's default, defined there only
            kw["io_unit_bytes"] = self.io_unit_bytes
        return kw


@dataclass(frozen=True)
class OffloadConfig(DiskSettings):
    """``kv_connector_extra_config``: vLLM's keys and the shared ``DiskSettings``."""

    backend: str = "cpu"
    disk_path: Optional[str] = None
    disk_buffer_slots: int = DEFAULT_DISK_BUFFER_SLOTS
    # Alignment slots are sized with (the slot file pads to at least 4096 under O_DIRECT).
    direct_io_alignment: int = MIN_DIRECT_ALIGNMENT
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES  # server-wide, divided by world size
    cpu_bytes_to_use_per_rank: Optional[int] = None
    num_cpu_blocks: Optional[int] = None  # explicit pool size in blocks/slots
    lazy_offload: bool = False

    @classmethod
    def from_extra_config(cls, extra: Optional[dict[str, Any]]) -> "OffloadConfig":
        extra = dict(extra or {})
        renamed = [f"{k!r} is now {RENAMED_KEYS[k]!r}" for k in sorted(extra) if k in RENAMED_KEYS]
        if renamed:
            raise ValueError(f"renamed kv_connector_extra_config key(s): {'; '.join(renamed)}")
        unknown = sorted(k for k in extra if k not in KNOWN_KEYS)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, sorted(KNOWN_KEYS), n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"unknown kv_connector_extra_config key(s): {', '.join(hints)}; "
                f"known keys: {', '.join(sorted(KNOWN_KEYS))}"
            )
        backend = extra.get("kv_offload_backend", "cpu")
        if backend not in BACKENDS:
            raise ValueError(f"kv_offload_backend={backend!r}: expected one of {BACKENDS}")

        kw: dict[str, Any] = {"backend": backend}
        if "disk_path" in extra:
            p = extra["disk_path"]
            if not isinstance(p, str) or not p:
                raise ValueError(f"disk_path={p!r}: expected a non-empty file path")
            kw["disk_path"] = p
        for key in ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank"):
            if key in extra:
                kw[key] = parse_size(key, extra[key], positive=True)
        for key, minimum in (("disk_buffer_slots", 1), ("num_cpu_blocks", 1), ("direct_io_alignment", 1)):
            if key in extra:
                kw[key] = _int(key, extra[key], minimum)
        if "direct_io_alignment" in kw and kw["direct_io_alignment"] & (kw["direct_io_alignment"] - 1):
            raise ValueError(f"direct_io_alignment={kw['direct_io_alignment']!r}: expected a power of two")
        if "lazy_offload" in extra:
            kw["lazy_offload"] = _bool("lazy_offload", extra["lazy_offload"])
        cfg = cls(**kw, **DiskSettings.parse(extra))

        if backend == "disk" and cfg.disk_path is None:
            raise ValueError('kv_offload_backend="disk" requires disk_path (a file path on the offload disk)')
        if backend == "cpu":
            ignored = [k for k in DISK_ONLY_KEYS if k in extra]
            if ignored:
                msg = (f'kv_offload_backend is "cpu": ignoring disk-only key(s) {", ".join(ignored)}; '
                       'set kv_offload_backend="disk" to use them')
                warnings.warn(msg, stacklevel=2)
                logger.warning(msg)
        return cfg

    @property
    def disk_mode(self) -> bool:
        return self.backend == "disk"

    def cpu_bytes_per_rank(self, world_size: int) -> int:
        """vLLM's rule: ``cpu_bytes_to_use`` is server-wide unless the per-rank key is set."""
        if self.cpu_bytes_to_use_per_rank is not None:
            return self.cpu_bytes_to_use_per_rank
        return self.cpu_bytes_to_use // world_size

    def slot_bytes(self, total_block_bytes: int) -> int:
        """Padded slot size the sizing rule assumes for a block of ``total_block_bytes``."""
        return slot_bytes_for(total_block_bytes, max(self.direct_io_alignment, MIN_DIRECT_ALIGNMENT),
                              self.use_page_cache)

    def num_disk_slots(self, total_block_bytes: int) -> int:
        """Slots of one rank's file: ``num_slots(disk_capacity_bytes, slot_bytes)``."""
        return num_slots(self.disk_capacity_bytes, self.slot_bytes(total_block_bytes))

    def normalized_extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        """``extra`` with sizes as plain ints, the form vLLM's own ``int(...)`` parsing accepts."""
        out = dict(extra)
        for key in ("disk_capacity_bytes", "cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "io_unit_bytes"):
            if key in out:
                out[key] = getattr(self, key)
        return out


def rank_disk_path(disk_path: str, dp_rank: int, world_rank: int) -> str:
    """Per-rank file name: unique across DP replicas and TP/PP/PCP ranks.

    vLLM 0.33 appends ``.rank_{device.index or 0}``, which collides when several
    processes each see their GPU as ``cuda:0`` (CUDA_VISIBLE_DEVICES per process).
    """
    return f"{disk_path}.dp{dp_rank}.rank{world_rank}"
