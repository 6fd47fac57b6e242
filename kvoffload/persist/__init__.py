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
16-byte AES-GCM key for the slots, a 32-byte key for the header's HMAC, and the
multipliers of the records' keyed checksums. Nothing derived from the key is written but MACs and tags.

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

from kvoffload.persist.forget import check_forget, forget, forget_targets
from kvoffload.persist.index_file import (
                                          FORMAT_VERSION,
                                          HEADER_COPY_BYTES,
                                          IDENT_BYTES,
                                          INDEX_SUFFIX,
                                          MAGIC,
                                          MAX_KEY_BYTES,
                                          MAX_SUMMARY_BYTES,
                                          RECORD_BYTES,
                                          RECORD_DTYPE,
                                          RECORDS_OFFSET,
                                          FileRecords,
                                          Header,
                                          PoolKeys,
                                          describe_mismatch,
                                          pack_records,
                                          read_header,
                                          read_records,
                                          record_checksums,
                                          write_headers,
)
from kvoffload.persist.keeper import PoolKeeper
from kvoffload.persist.operator_key import (
                                          OPERATOR_KEY_BYTES,
                                          Persist,
                                          PersistError,
                                          read_operator_key,
                                          summary,
)
from kvoffload.persist.pool import (
                                          IndexFile,
                                          Pool,
                                          Restored,
                                          agree,
                                          check_keys,
                                          read_pool,
                                          restorable,
)

__all__ = [
                                          "FORMAT_VERSION",
                                          "HEADER_COPY_BYTES",
                                          "IDENT_BYTES",
                                          "INDEX_SUFFIX",
                                          "MAGIC",
                                          "MAX_KEY_BYTES",
                                          "MAX_SUMMARY_BYTES",
                                          "OPERATOR_KEY_BYTES",
                                          "RECORDS_OFFSET",
                                          "RECORD_BYTES",
                                          "RECORD_DTYPE",
                                          "FileRecords",
                                          "Header",
                                          "IndexFile",
                                          "Persist",
                                          "PersistError",
                                          "Pool",
                                          "PoolKeeper",
                                          "PoolKeys",
                                          "Restored",
                                          "agree",
                                          "check_forget",
                                          "check_keys",
                                          "describe_mismatch",
                                          "forget",
                                          "forget_targets",
                                          "pack_records",
                                          "read_header",
                                          "read_operator_key",
                                          "read_pool",
                                          "read_records",
                                          "record_checksums",
                                          "restorable",
                                          "summary",
                                          "write_headers",
]
