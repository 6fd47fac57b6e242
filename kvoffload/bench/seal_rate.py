"""How fast a slot seal runs alone, on 1 and on N threads: does the library release the GIL?

Each thread seals its own buffer of one 2 MiB block again and again through the
backend's own ``SlotSeal.seal`` (for AES-GCM: ``AESGCM.encrypt_into`` in place, as
the IO threads call it). If the library held the GIL while it works, N threads
would move no more than one; ``scaling`` = rate(N) / rate(1) shows it, against an
ideal of min(N, CPUs).
"""

from __future__ import annotations

import time

from kvoffload import native_engine
from kvoffload.bench.ceilings import Timed, run_threads
from kvoffload.slot_seal import SEALS, TAG_BYTES

SEAL_BUFFER_BYTES = 2 << 20


def seal_rate(name: str, threads: int, seconds: float, impl: str = "python",
              buffer_bytes: int = SEAL_BUFFER_BYTES) -> Timed:
    """Bytes sealed per second by ``threads`` threads for ``seconds`` (at least one seal each):
    through the backend's ``SlotSeal`` (``impl="python"``, the Python path's), or, for
    AES-GCM, the native engine's own cipher (``"native"``, one cffi call per seal)."""
    seal = SEALS[name]()
    if impl == "native":
        cipher = native_engine.Cipher(seal.key)
        nonce, aad = seal.nonce_array([1])[0].tobytes(), seal.aad_array([0])[0].tobytes()

    def body(k: int, deadline: float) -> int:
        # The spare tail: sealing borrows the 16 bytes after the payload for the tag.
        mv = memoryview(bytearray(buffer_bytes + TAG_BYTES))
        moved = 0
        while True:
            if impl == "native":
                cipher.seal(nonce, aad, mv, buffer_bytes)
            else:
                seal.seal(k, mv, buffer_bytes)
            moved += buffer_bytes
            if time.perf_counter() >= deadline:
                return moved

    c0 = time.process_time()
    wall, moved = run_threads(threads, body, seconds)
    return Timed(sum(moved), wall, time.process_time() - c0,
                 {"threads": threads, "buffer_bytes": buffer_bytes, "seal": name, "impl": impl})
