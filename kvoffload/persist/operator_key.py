"""What the operator gives a persistent pool: a key, and what the stored KV is of.

The key is read from a file only its owner can read, or from an environment variable,
and only ever held in memory; every refusal is one ``PersistError`` line that never
holds key material.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

OPERATOR_KEY_BYTES = 32


class PersistError(ValueError):
    """A persistent file set that start-up refuses; the message is one line and says what to do.
    Nothing was changed on disk."""


# Its name in logs and tracebacks is the package's, where callers import it from: a
# refusal reads "kvoffload.persist.PersistError: ..." whichever module raised it.
PersistError.__module__ = "kvoffload.persist"


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
