"""Per slot, the record of its latest completed store: what a load checks it against.

A record is what the seal made when the slot was written: AES-GCM's nonce and tag (and,
in a persistent pool, the slot's identity: generation and block key, authenticated with
it), or xxh3's digest, or only "valid". ``Records`` holds records as arrays, one row per
slot, for the whole pool (``Run.records``) and for a job's slots (what a load checks,
what a store made): a job's records move between them in a few array operations, never
slot by slot, whichever engine ran it. A slot whose row is not ``valid`` holds no block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

NONCE_BYTES, TAG_BYTES, DIGEST_BYTES = 12, 16, 8

# The bytes of each field a seal's records use (the others are 0 wide: no memory).
_WIDTHS = {"aes-gcm": (NONCE_BYTES, TAG_BYTES, 0), "xxh3": (0, 0, DIGEST_BYTES), "off": (0, 0, 0)}


def record_bytes(seal: str, ident_bytes: int = 0) -> int:
    """Host memory one slot's record takes (``budget`` charges it per slot)."""
    return 1 + sum(_WIDTHS[seal]) + ident_bytes


@dataclass
class Records:
    """Records of ``len(valid)`` slots; each field one row of bytes per slot."""

    valid: np.ndarray  # bool
    nonce: np.ndarray  # uint8 (n, 12): AES-GCM's nonce, little-endian
    tag: np.ndarray  # uint8 (n, 16): AES-GCM's tag
    digest: np.ndarray  # uint8 (n, 8): xxh3's, little-endian
    ident: np.ndarray  # uint8 (n, ident_bytes): a persistent pool's identity

    @classmethod
    def empty(cls, n: int, seal: str, ident_bytes: int = 0) -> "Records":
        nonce, tag, digest = _WIDTHS[seal]
        return cls(np.zeros(n, bool), np.zeros((n, nonce), np.uint8), np.zeros((n, tag), np.uint8),
                   np.zeros((n, digest), np.uint8), np.zeros((n, ident_bytes), np.uint8))

    def __len__(self) -> int:
        return len(self.valid)

    def take(self, rows: Any) -> "Records":
        """A copy of ``rows`` (indices or a mask)."""
        return Records(self.valid[rows], self.nonce[rows], self.tag[rows], self.digest[rows], self.ident[rows])

    def put(self, rows: Any, src: "Records") -> None:
        """``src``'s rows into ``rows`` (as many of each)."""
        self.valid[rows], self.nonce[rows], self.tag[rows] = src.valid, src.nonce, src.tag
        self.digest[rows], self.ident[rows] = src.digest, src.ident

    def clear(self, rows: Any) -> None:
        self.valid[rows] = False

    def same(self, rows: Any, other: "Records") -> np.ndarray:
        """Per row, whether ``rows`` still hold ``other``'s records (every store seals anew:
        a slot stored again since holds another nonce, digest or identity)."""
        return (self.valid[rows] & other.valid & (self.nonce[rows] == other.nonce).all(1)
                & (self.digest[rows] == other.digest).all(1) & (self.ident[rows] == other.ident).all(1))

    # -- the Python engine's seal speaks one record per slot -------------------------------

    def record(self, j: int) -> Any:
        """Row ``j`` as the Python engine's seal takes it: AES-GCM ``(nonce, tag[, ident])``,
        xxh3 the digest, otherwise True; None where not valid."""
        if not self.valid[j]:
            return None
        if self.nonce.shape[1]:
            out = (int.from_bytes(self.nonce[j].tobytes(), "little"), self.tag[j].tobytes())
            return out + (self.ident[j].tobytes(),) if self.ident.shape[1] else out
        if self.digest.shape[1]:
            return int.from_bytes(self.digest[j].tobytes(), "little")
        return True

    def set_record(self, j: int, record: Any) -> None:
        """Row ``j`` from the Python engine's seal's form (``record``'s inverse)."""
        self.valid[j] = True
        if self.nonce.shape[1]:
            self.nonce[j] = np.frombuffer(record[0].to_bytes(NONCE_BYTES, "little"), np.uint8)
            self.tag[j] = np.frombuffer(record[1], np.uint8)
            if self.ident.shape[1]:
                self.ident[j] = np.frombuffer(record[2], np.uint8)
        elif self.digest.shape[1]:
            self.digest[j] = np.frombuffer(int(record).to_bytes(DIGEST_BYTES, "little"), np.uint8)


def nonce_ints(nonce: np.ndarray) -> list[int]:
    """Each row's nonce (little-endian, 12 bytes) as an int."""
    return [int.from_bytes(r.tobytes(), "little") for r in nonce]


def idents_of(generations: np.ndarray, keys: Sequence[bytes], key_bytes: int) -> np.ndarray:
    """A persistent store's identities, one row each: generation (8 bytes, little-endian),
    key length, key (zero padded to ``key_bytes``)."""
    out = np.zeros((len(keys), 9 + key_bytes), np.uint8)
    out[:, :8] = np.asarray(generations, "<u8").view(np.uint8).reshape(-1, 8)
    out[:, 8] = [len(k) for k in keys]
    if len(keys):
        out[:, 9:] = np.frombuffer(b"".join(k.ljust(key_bytes, b"\0") for k in keys), np.uint8).reshape(len(keys), -1)
    return out


def keys_of(ident: np.ndarray) -> list[bytes]:
    """Each identity's block key (``idents_of``'s inverse for the key)."""
    flat, lens = np.ascontiguousarray(ident[:, 9:]).tobytes(), ident[:, 8].tolist()
    width = ident.shape[1] - 9
    return [flat[width * i:width * i + k] for i, k in enumerate(lens)]


def generations_of(ident: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ident[:, :8]).view("<u8").ravel()


def optional_take(records: Optional[Records], rows: Any) -> Optional[Records]:
    return None if records is None else records.take(rows)
