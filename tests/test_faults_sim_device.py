"""SimDevice: copies complete only when the test (or the virtual clock) says so."""

from __future__ import annotations

import threading

import pytest
import torch

from kvoffload.device import BlockLayout, alloc_host

from faults.sim_device import SimDevice


def _setup(dev: SimDevice, num_blocks: int = 4, rows: int = 4):
    caches = {"k": torch.arange(num_blocks * 8, dtype=torch.int8).view(num_blocks, 8),
              "v": -torch.arange(num_blocks * 4, dtype=torch.int8).view(num_blocks, 4)}
    layout = BlockLayout.from_caches(caches)
    host = alloc_host(rows * layout.block_bytes, 64)
    host = host.view(rows, layout.block_bytes)
    host.zero_()
    dev.bind_thread()
    dev.pin(host)
    return caches, layout, host


def test_bytes_move_only_at_completion():
    dev = SimDevice()
    caches, layout, host = _setup(dev)
    ev = dev.copy_to_host(None, layout, [2], host, [1])
    assert not ev.query() and dev.num_pending() == 1
    assert host[1].count_nonzero() == 0  # nothing moved yet
    assert dev.complete_next() is ev and ev.query()
    assert torch.equal(host[1, :8].view(torch.int8), caches["k"][2])
    assert torch.equal(host[1, 8:12].view(torch.int8), caches["v"][2])
    assert dev.complete_next() is None
    assert dev.log == [("launch", 0, "to_host"), ("complete", 0, "to_host")]


def test_reusing_a_row_whose_load_is_in_flight_corrupts_the_block():
    # Goal: the bug this device exists to expose. The device block receives the row's
    # bytes as they are at completion, not at launch, and busy() flags the row.
    dev = SimDevice()
    caches, layout, host = _setup(dev)
    host[0].fill_(7)
    ev = dev.copy_to_device(None, layout, host, [0], [3])
    row_bytes = host.stride(0)
    assert dev.busy(host.data_ptr(), row_bytes) == ["to_device"]
    assert dev.busy(host.data_ptr() + row_bytes, row_bytes) == []
    host[0].fill_(9)  # the premature reuse
    dev.complete_all()
    assert ev.query()
    assert (caches["k"][3] == 9).all()


def test_stream_order_and_wait_events():
    dev = SimDevice()
    caches, layout, host = _setup(dev)
    s1, s2 = object(), object()
    a = dev.copy_to_host(s1, layout, [0], host, [0])
    b = dev.copy_to_host(s1, layout, [1], host, [1], wait_event=None)
    c = dev.copy_to_host(s2, layout, [2], host, [2], wait_event=b)  # waits on b
    d = dev.copy_to_device(s2, layout, host, [3], [3])  # behind c on s2
    assert dev.complete_next() is a
    assert dev.complete_next() is b
    assert dev.complete_next() is c
    assert dev.complete_next() is d


def test_a_copy_whose_wait_event_never_fires_cannot_complete():
    dev = SimDevice()
    _c, layout, host = _setup(dev)
    blocker = SimDevice()  # an event from a device nobody drives
    _c2, layout2, host2 = _setup(blocker)
    never = blocker.copy_to_host(None, layout2, [0], host2, [0])
    dev.copy_to_host(None, layout, [0], host, [0], wait_event=never)
    with pytest.raises(RuntimeError, match="none may complete"):
        dev.complete_next()


def test_virtual_delay_and_clock():
    dev = SimDevice(delay_ns=100)
    _c, layout, host = _setup(dev)
    e1 = dev.copy_to_host(None, layout, [0], host, [0])
    assert dev.advance_to(50) == 0
    e2 = dev.copy_to_host(None, layout, [1], host, [1])
    assert dev.advance_to(99) == 0 and not e1.query()
    assert dev.advance_to(120) == 1 and e1.query() and not e2.query()
    assert e1.done_at_ns == 100 and dev.now_ns == 120
    assert dev.advance_to(150) == 1 and e2.done_at_ns == 150
    with pytest.raises(ValueError, match="backwards"):
        dev.advance_to(10)


def test_strict_checks():
    dev = SimDevice()
    caches, layout, host = _setup(dev)
    loose = torch.zeros_like(host)
    with pytest.raises(RuntimeError, match="unpinned"):
        dev.copy_to_host(None, layout, [0], loose, [0])
    errors = []

    def unbound():
        try:
            dev.copy_to_host(None, layout, [0], host, [0])
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=unbound)
    t.start()
    t.join()
    assert errors and "bind_thread" in errors[0]
    dev.copy_to_host(None, layout, [0], host, [0])
    with pytest.raises(RuntimeError, match="in flight"):
        dev.unpin(host)
    with pytest.raises(ValueError, match="delay_ns must be >= 0"):
        SimDevice(delay_ns=-1)
    with pytest.raises(RuntimeError, match="needs a SimDevice built with delay_ns"):
        SimDevice().advance_to(1)


def test_synchronize_waits_for_the_test_thread():
    dev = SimDevice(sync_timeout=5.0)
    _c, layout, host = _setup(dev)
    ev = dev.copy_to_host(None, layout, [0], host, [0])
    t = threading.Timer(0.05, dev.complete_all)
    t.start()
    ev.synchronize()
    assert ev.query()
    ev2 = dev.copy_to_host(None, layout, [1], host, [1])
    with pytest.raises(TimeoutError, match="never completed it"):
        ev2.synchronize(timeout=0.05)


def test_disk_backend_store_waits_for_the_device_copy(tmp_path):
    # Goal: with the real backend, a store's event stays pending while its device
    # copy is in flight (the file write must not run before it), and the file then
    # holds the bytes the copy delivered.
    disk_backend = pytest.importorskip("kvoffload.disk_backend")
    dev = SimDevice(sync_timeout=10.0)
    g = torch.Generator().manual_seed(0)
    caches = {"k": torch.randint(-128, 128, (8, 4096), dtype=torch.int8, generator=g)}
    b = disk_backend.DiskBackend()
    b.init(caches, torch.device("cpu"), None, None, str(tmp_path / "kv.bin"), 8, 4096,
           io_threads=1, device_impl=dev, report_load_errors=True)
    try:
        events: list = []
        b.launch_copy([1, 2], [5, 6], True, 0, events)
        assert dev.wait_pending(1)
        assert not events[0][1].query()
        assert b.stats()["bytes_written"] == 0  # nothing written before the copy completed
        while not events[0][1].query():
            dev.complete_next() or dev.wait_pending(1, timeout=0.01)
        assert events[0][1].ok
        assert b.stats()["bytes_written"] >= 2 * 4096
        before = caches["k"][1].clone()
        caches["k"][1].zero_()
        events = []
        b.launch_copy([5], [1], False, 1, events)
        assert dev.wait_pending(1)
        assert not events[0][1].query() and (caches["k"][1] == 0).all()
        while not events[0][1].query():
            dev.complete_next() or dev.wait_pending(1, timeout=0.01)
        assert torch.equal(caches["k"][1], before)
    finally:
        b.shutdown()
