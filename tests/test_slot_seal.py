"""``open_block``: a slot read straight into its block opens there, and nowhere else.

The block sits between two others (other chunks of vLLM's primary, maybe in use): the
open must leave every byte outside it as it was, whatever the outcome, and a block that
fails its check ends zeroed. Records are the ones ``seal`` makes on the staging path.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.slot_seal import SEALS, TAG_BYTES

SIZES = [8192, 2 << 20, 4096 + 7, 15, 16, 17]  # aligned rows, and sizes that end mid cipher block


def sealed(seal, slot: int, size: int, seed: int = 0) -> tuple[bytes, bytes, object]:
    """(plaintext, disk form, record) of one slot, sealed as the staging path seals it."""
    plain = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    row = memoryview(bytearray(plain + bytes(TAG_BYTES)))  # staging keeps 16 spare bytes
    record = seal.seal(slot, row, size)
    assert bytes(row[size:]) == bytes(TAG_BYTES)  # the borrowed tail was put back
    return plain, bytes(row[:size]), record


def between_neighbours(disk: bytes) -> tuple[bytearray, memoryview]:
    """``disk`` in a block with a marked block of the same size either side."""
    n = len(disk)
    buf = bytearray(b"\xa5" * n + disk + b"\x5a" * n)
    return buf, memoryview(buf)[n : 2 * n]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(SEALS))
def test_open_block_restores_the_payload_in_place(name, size) -> None:
    seal = SEALS[name]()
    plain, disk, record = sealed(seal, 3, size)
    assert (disk == plain) is seal.disk_form_is_payload
    buf, block = between_neighbours(disk)
    assert seal.open_block(3, block, record)
    assert bytes(buf) == b"\xa5" * size + plain + b"\x5a" * size


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("damage", ["bit", "slot", "record"])
def test_a_block_failing_its_check_ends_zeroed_and_its_neighbours_untouched(damage, size) -> None:
    seal = SEALS["aes-gcm"]()
    plain, disk, record = sealed(seal, 3, size)
    _, _, other = sealed(seal, 3, size, seed=1)  # another write of the same slot: its nonce and tag
    buf, block = between_neighbours(disk)
    if damage == "bit":
        block[size // 2] ^= 0x10
    ok = seal.open_block(4 if damage == "slot" else 3, block, other if damage == "record" else record)
    assert not ok
    assert bytes(buf) == b"\xa5" * size + bytes(size) + b"\x5a" * size


def test_a_checksum_block_failing_its_check_ends_zeroed() -> None:
    seal = SEALS["xxh3"]()
    _, disk, record = sealed(seal, 0, 8192)
    buf, block = between_neighbours(disk)
    block[100] ^= 1
    assert not seal.open_block(0, block, record)
    assert bytes(buf) == b"\xa5" * 8192 + bytes(8192) + b"\x5a" * 8192
