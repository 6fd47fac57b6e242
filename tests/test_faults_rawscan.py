"""No prompt at rest: after shutdown() and after kill -9, no KV byte can be read back from
the block device, in the default configuration, in both file modes, with O_DIRECT and
with the page cache. A loop-mounted ext4 is scanned raw for a marker the stored blocks
carry; the same run with encrypt=False finds the marker, which proves the scan works.
Root only (loop devices, mount); skipped with the reason otherwise."""

from __future__ import annotations

import secrets

import pytest

from faults._rawscan import LoopExt4, LoopSetupError, count_marker, run_child

pytestmark = pytest.mark.faults

SLOTS, BLOCK = 64, 64 << 10
MARKERS_STORED = SLOTS * BLOCK // 16


@pytest.mark.parametrize("end", ["shutdown", "kill"], ids=["shutdown", "kill9"])
@pytest.mark.parametrize("page_cache", [False, True], ids=["direct", "pagecache"])
@pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])
def test_no_kv_byte_on_the_raw_device(end, page_cache, named):
    why = LoopExt4.unavailable()
    if why:
        pytest.skip(f"raw-device scan needs a loop-mounted ext4: {why}")
    marker = secrets.token_bytes(16)
    try:
        with LoopExt4() as fs:
            run_child(fs.mnt, marker, end, named, page_cache, encrypt=True, slots=SLOTS, block_bytes=BLOCK)
            fs.unmount()
            found = count_marker(fs.image, marker)
            print(f"{end}, {'named' if named else 'anonymous'}, {'page cache' if page_cache else 'O_DIRECT'}: "
                  f"default config {found} of {MARKERS_STORED} markers", end="")
            assert found == 0, f"{found} plaintext markers readable from the device"
            # Control, on the same file system: without encryption the bytes are there to find.
            fs.mount()
            run_child(fs.mnt, marker, end, named, page_cache, encrypt=False, slots=SLOTS, block_bytes=BLOCK)
            fs.unmount()
            control = count_marker(fs.image, marker)
            print(f"; encrypt=False {control}")
            assert control >= MARKERS_STORED // 2, f"the scan found only {control} markers of a plaintext run"
    except LoopSetupError as e:  # raised only while setting the file system up
        pytest.skip(f"raw-device scan needs a loop-mounted ext4: {e}")
