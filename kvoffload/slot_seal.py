"""What a slot's bytes carry besides the KV: confidentiality, integrity, or just validity.

Before a store writes a slot, ``seal`` turns the staging row's payload into what goes
to disk and returns the record the run keeps in memory for that slot; after a load
reads it, ``open`` checks the bytes against the record (and restores the payload).
The records live only in process memory, exactly as long as the file they describe.

Both work in place on the staging row, or out of place when the blocks are host
memory themselves (``HostDevice``: vLLM's CPU tier): ``seal`` then reads the payload
from the block and ``open`` writes it into the block, and the copy between block and
staging, a whole pass over host memory, is folded into the cipher's own pass. Where a
slot is read straight into its block (aligned host blocks under O_DIRECT),
``open_block`` opens it there, touching no byte outside the block.

- ``AesGcmSeal`` (the default): AES-128-GCM with a key made at init and never
  written anywhere. The file, and the raw device under it, hold only ciphertext,
  so no prompt survives the process (``shutdown``, ``kill -9``, a stolen drive);
  the tag replaces the checksum, so one pass gives both. Staging only ever holds
  plaintext between the device copy and the cipher's pass over it.
- ``ChecksumSeal``: xxh3-64 of the payload; integrity only, plaintext on disk.
- ``ValiditySeal``: neither; only "this slot holds a completed store".
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import numpy as np
import xxhash

TAG_BYTES = 16
NONCE_SPACE = 2**96  # AES-GCM's 96-bit nonces
COUNTER_SPACE = 2**64  # the most nonces one run takes


class SlotSeal(Protocol):
    name: str  # aes-gcm | xxh3 | off
    label: str  # for the start-up log line
    # The disk form is the payload itself (checksums, validity): ``seal`` only reads it,
    # so a store may write straight from the block. AES-GCM's is ciphertext: a copy.
    disk_form_is_payload: bool
    aad_bytes: int  # what each slot is authenticated to, in bytes (0: nothing)

    def aad_array(self, slots: Sequence[int], idents: Optional[np.ndarray] = None) -> np.ndarray:
        """Each slot's associated data, one row of ``aad_bytes`` per slot (the native engine's
        form); ``idents``: each slot's identity, one row each, where the seal is persistent
        (``AesGcmSeal.persist``)."""

    def seal(self, slot: int, row: memoryview, payload_bytes: int, src: Optional[memoryview] = None,
             ident: bytes = b"") -> Any:
        """Write the disk form of the payload to ``row[:payload_bytes]``; return its record.

        The payload is ``row``'s own bytes, or ``src`` when given. ``row`` may be
        followed by 16 more bytes of the same buffer: they are restored before return.
        ``ident``: what the slot holds, for a persistent seal (authenticated, and kept in
        the record).
        """

    def open(self, slot: int, row: memoryview, payload_bytes: int, record: Any,
             dst: Optional[memoryview] = None) -> bool:
        """Check the slot read into ``row`` against ``record`` and restore the payload, in
        place or into ``dst``; False if it is not what was sealed (``dst`` is then zeroed:
        it never keeps unverified bytes)."""

    def open_block(self, slot: int, block: memoryview, record: Any) -> bool:
        """Check the slot read straight into ``block`` (exactly the payload) and restore the
        payload in place, writing no byte outside ``block``; False, with ``block`` zeroed,
        if it is not what was sealed."""


class ChecksumSeal:
    # xxh3_64 measured 44 GiB/s against crc32c's 28 GiB/s, and releases the GIL.
    name = "xxh3"
    label = "checksums (xxh3)"
    disk_form_is_payload = True
    aad_bytes = 0

    def aad_array(self, slots: Sequence[int], idents: Optional[np.ndarray] = None) -> np.ndarray:
        return np.zeros((len(slots), 0), np.uint8)

    def digest(self, payload: memoryview) -> Any:
        return xxhash.xxh3_64_intdigest(payload)

    def seal(self, slot: int, row: memoryview, payload_bytes: int, src: Optional[memoryview] = None,
             ident: bytes = b"") -> Any:
        if src is not None:
            _copy(row[:payload_bytes], src)
        return self.digest(row[:payload_bytes])

    def open(self, slot: int, row: memoryview, payload_bytes: int, record: Any,
             dst: Optional[memoryview] = None) -> bool:
        ok = self.digest(row[:payload_bytes]) == record
        if dst is not None and ok:
            _copy(dst, row[:payload_bytes])
        elif dst is not None:
            zero(dst)
        return ok

    def open_block(self, slot: int, block: memoryview, record: Any) -> bool:
        ok = self.digest(block) == record
        if not ok:
            zero(block)
        return ok


class ValiditySeal(ChecksumSeal):
    name = "off"
    label = "no checks"

    def digest(self, payload: memoryview) -> Any:
        return True


class AesGcmSeal:
    """AES-128-GCM per slot: a fresh 96-bit nonce per write, the slot index as
    associated data (a ciphertext moved to another slot fails to open).

    ``persist`` turns it into a persistent pool's seal: the key derived from the
    operator's, nonces counted from a random start, and the associated data the pool's
    fingerprint, the slot and the slot's identity (generation and block key), which the
    record then carries as its third field."""

    name = "aes-gcm"
    label = "encrypted (AES-GCM)"
    disk_form_is_payload = False

    def __init__(self) -> None:
        # The key never leaves process memory: it is held here, for the Python path's
        # cipher and for the native core's (expanded by it, wiped at close), never written anywhere.
        self._set_key(os.urandom(16))
        # One counter for every write under this key, on either path: a nonce is never reused.
        self._nonce_lock = threading.Lock()
        self._next_nonce = 1
        self._start = 0  # added to the counter: a persistent pool's random start (``persist``)
        self._prefix = b""  # associated data before the slot index: the pool's fingerprint
        self.ident_bytes = 0  # associated data after it: the slot's identity (set by ``persist``)
        self.aad_bytes = 8  # the slot index (_aad)

    def _set_key(self, key: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import algorithms
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise RuntimeError(f"encryption needs the 'cryptography' package (>= 50): {e}") from e
        self.key = key
        self._aead = AESGCM(key)
        self._aes = algorithms.AES(key)  # the same key, for the streaming decryptor of open_block

    def persist(self, key: bytes, fingerprint: bytes, ident_bytes: int) -> None:
        """Seal for a persistent pool from now on (before any slot is sealed): ``key`` derived
        from the operator's, and the associated data ``fingerprint || slot || ident``.

        The key outlives the process (every start of the pool, and any copy of its files,
        derives it again), so its nonces must not come from anything the files hold: each
        start counts from a fresh random start R, uniform below 2**96 - 2**64, so a run's
        nonces R + 1 .. R + q never wrap. Two starts collide only if their ranges overlap:
        for N starts sealing Q blocks in all, with probability at most N * Q / 2**95
        (docs/design.md, "Nonces")."""
        self._set_key(key)
        with self._nonce_lock:
            self._start, self._next_nonce = secrets.randbelow(NONCE_SPACE - COUNTER_SPACE), 1
        self._prefix, self.ident_bytes = fingerprint, ident_bytes
        self.aad_bytes = len(fingerprint) + 8 + ident_bytes

    @property
    def identified(self) -> bool:
        """Whether each slot is authenticated to an identity, which its record then carries."""
        return self.ident_bytes > 0

    def reserve_nonces(self, n: int) -> int:
        """The first of ``n`` fresh nonces (a unit's stores take theirs in one call)."""
        with self._nonce_lock:
            first = self._next_nonce
            self._next_nonce += n
            if self._next_nonce >= COUNTER_SPACE:  # keeps R + counter below 2**96
                raise RuntimeError("kvoffload: this run sealed 2**64 slots; restart it for a new nonce start")
        return self._start + first

    def aad(self, slot: int, ident: bytes = b"") -> bytes:
        """What slot ``slot`` holding ``ident`` is authenticated to."""
        return self._prefix + _aad(slot) + ident

    def aad_array(self, slots: Sequence[int], idents: Optional[np.ndarray] = None) -> np.ndarray:
        """``aad`` of each slot (a test holds the two forms equal)."""
        index = np.ascontiguousarray(np.asarray(slots, "<u8")).view(np.uint8).reshape(-1, 8)
        if not self.identified:
            return index
        out = np.empty((len(index), self.aad_bytes), np.uint8)
        out[:, : len(self._prefix)] = np.frombuffer(self._prefix, np.uint8)
        out[:, len(self._prefix) : len(self._prefix) + 8] = index
        out[:, len(self._prefix) + 8 :] = idents
        return out

    def nonce_rows(self, n: int) -> np.ndarray:
        """``n`` fresh nonces (one reservation), one row of 12 bytes each (``_nonce``'s form)."""
        first = self.reserve_nonces(n)
        lo = np.uint64(first & (COUNTER_SPACE - 1)) + np.arange(n, dtype=np.uint64)
        hi = np.full(n, first >> 64, np.uint64) + (lo < np.uint64(first & (COUNTER_SPACE - 1)))  # the carry
        out = np.empty((n, 12), np.uint8)
        out[:, :8] = lo.astype("<u8").view(np.uint8).reshape(-1, 8)
        out[:, 8:] = hi.astype("<u4").view(np.uint8).reshape(-1, 4)
        return out

    @staticmethod
    def nonce_array(nonces: Sequence[int]) -> np.ndarray:
        """``_nonce`` of each nonce, one row of 12 bytes each (a test holds the two forms equal)."""
        out = np.zeros((len(nonces), 12), np.uint8)
        low = [x & (2**64 - 1) for x in nonces]
        out[:, :8] = np.asarray(low, "<u8").view(np.uint8).reshape(-1, 8)
        out[:, 8:] = np.asarray([x >> 64 for x in nonces], "<u4").view(np.uint8).reshape(-1, 4)
        return out

    def seal(self, slot: int, row: memoryview, payload_bytes: int, src: Optional[memoryview] = None,
             ident: bytes = b"") -> Any:
        n = payload_bytes
        nonce = self.reserve_nonces(1)
        # encrypt_into writes ciphertext || tag, and (cryptography 51 on) never over its
        # own input: a block sealed in place goes through this thread's scratch; one from
        # ``src`` is written into the row, the tag landing in the 16 bytes after the
        # payload (padding, the next row, or the buffer's spare tail), put back once read.
        if src is None:
            out = _scratch(n + TAG_BYTES)
            self._aead.encrypt_into(_nonce(nonce), row[:n], self.aad(slot, ident), out)
            _copy(row[:n], out[:n])
            tag = bytes(out[n:])
        else:
            saved = bytes(row[n : n + TAG_BYTES])
            self._aead.encrypt_into(_nonce(nonce), src, self.aad(slot, ident), row[: n + TAG_BYTES])
            tag = bytes(row[n : n + TAG_BYTES])
            row[n : n + TAG_BYTES] = saved
        return (nonce, tag, ident) if self.identified else (nonce, tag)

    def open(self, slot: int, row: memoryview, payload_bytes: int, record: Any,
             dst: Optional[memoryview] = None) -> bool:
        from cryptography.exceptions import InvalidTag

        n = payload_bytes
        nonce, tag = record[:2]
        saved = bytes(row[n : n + TAG_BYTES])
        row[n : n + TAG_BYTES] = tag
        # Opened in place, the plaintext goes through this thread's scratch (decrypt_into
        # never writes over its input) and reaches the row only once the tag is checked.
        out = _scratch(n) if dst is None else dst
        try:
            self._aead.decrypt_into(_nonce(nonce), row[: n + TAG_BYTES], self._record_aad(slot, record), out)
        except InvalidTag:
            # decrypt_into has already written the unverified plaintext: wipe it.
            zero(out)
            return False
        finally:
            row[n : n + TAG_BYTES] = saved
        if dst is None:
            _copy(row[:n], out)
        return True

    def open_block(self, slot: int, block: memoryview, record: Any) -> bool:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        # decrypt_into needs ciphertext || tag in one buffer, and the 16 bytes after a
        # block are the next block's (another chunk, maybe being read): the streaming
        # decryptor takes the tag from the record instead, and checks it in finalize.
        # Same key, nonce, associated data and tag as seal: any sealed slot opens here.
        # update_into never writes over its input (cryptography 51 on) and its output must
        # hold len(data) + 15 bytes (AES's block less one): the plaintext goes to this
        # thread's scratch, and into the block only once finalize has checked the tag.
        nonce, tag = record[:2]
        n = len(block)
        out = _scratch(n + TAG_BYTES - 1)
        ok = False
        try:
            d = Cipher(self._aes, modes.GCM(_nonce(nonce), tag)).decryptor()
            d.authenticate_additional_data(self._record_aad(slot, record))
            d.update_into(block, out)
            d.finalize()
            _copy(block, out[:n])
            ok = True
        except InvalidTag:
            zero(out)
        finally:
            if not ok:  # a block that fails its check is never served: it ends zeroed
                zero(block)
        return ok

    def _record_aad(self, slot: int, record: Any) -> bytes:
        return self.aad(slot, record[2] if len(record) > 2 else b"")


_THREAD = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """``nbytes`` of this thread's own buffer, for a cipher's output beside its input (IO
    threads seal and open at once; each keeps one buffer of its largest block)."""
    buf = getattr(_THREAD, "scratch", None)
    if buf is None or len(buf) < nbytes:
        buf = _THREAD.scratch = bytearray(nbytes)
    return memoryview(buf)[:nbytes]


def _copy(dst: memoryview, src: memoryview) -> None:
    # numpy releases the GIL for the copy; a memoryview slice assignment holds it.
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def zero(dst: memoryview) -> None:
    """Fill ``dst`` with zeros."""
    np.frombuffer(dst, np.uint8).fill(0)


def _nonce(n: int) -> bytes:
    return n.to_bytes(12, "little")


def _aad(slot: int) -> bytes:
    return slot.to_bytes(8, "little")


SEALS = {"aes-gcm": AesGcmSeal, "xxh3": ChecksumSeal, "off": ValiditySeal}


def make_seal(encrypt: bool, checksums: bool) -> SlotSeal:
    if encrypt:
        return AesGcmSeal()
    return ChecksumSeal() if checksums else ValiditySeal()
