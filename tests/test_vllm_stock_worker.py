"""kvoffload's DiskBackend under vLLM 0.33's stock SimpleCPUOffloadWorker (only the backend swapped).

The stock worker has no error channel: it never asks for load errors and sizes
its pool from the unpadded block size. The backend's decision (docs/vllm.md,
"Under vLLM's own worker"): refuse at init a file that would exceed
``num_disk_slots * total_block_bytes`` (O_DIRECT padding), and make a failed load
raise from its job event (``UnreportedLoadError``) so the engine stops instead of
running the request on whatever the device blocks held.
"""

from __future__ import annotations

import errno
import os

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm.v1.simple_kv_offload.worker as stock_worker  # noqa: E402

from faults import FaultyOsCalls  # noqa: E402
from kvoffload.disk_backend import DiskBackend  # noqa: E402
from kvoffload.jobs import UnreportedLoadError  # noqa: E402
from kvoffload.slot_file import SlotFileError  # noqa: E402
from tests.vllm_harness import BLOCK_BYTES, BLOCK_SIZE, CpuEngine, EngineSpec, expected_output, prompt  # noqa: E402

SHARED = prompt(1, 5 * BLOCK_SIZE)


class SeamedDiskBackend(DiskBackend):
    """kvoffload's backend as the stock worker calls it (vLLM 0.33's positional
    ``init``), with the test's OS seam."""

    os_calls = None

    def init(self, *args, **kwargs) -> None:
        super().init(*args, os_calls=self.os_calls, **kwargs)


@pytest.fixture
def faulty(monkeypatch) -> FaultyOsCalls:
    osc = FaultyOsCalls()
    monkeypatch.setattr(SeamedDiskBackend, "os_calls", osc)
    monkeypatch.setattr(stock_worker, "DiskBackend", SeamedDiskBackend)
    return osc


def stock_engine(tmp_path, monkeypatch, use_page_cache: bool) -> CpuEngine:
    return CpuEngine(tmp_path, monkeypatch, EngineSpec(use_page_cache=use_page_cache,
                                                       connector="SimpleCPUOffloadConnector"))


def test_stock_worker_o_direct_padding_over_budget_is_refused(tmp_path, monkeypatch, faulty) -> None:
    # 18,432 B blocks pad to 20,480 B slots under O_DIRECT: the stock worker's
    # num_disk_slots * total_block_bytes cannot hold them, so init refuses.
    assert BLOCK_BYTES % 4096
    with pytest.raises(SlotFileError) as exc:
        stock_engine(tmp_path, monkeypatch, use_page_cache=False)
    assert exc.value.errno == errno.EFBIG
    assert faulty.calls["pwritev"] == 0
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_stock_worker_page_cache_file_fits_its_budget_and_hits(tmp_path, monkeypatch, faulty) -> None:
    eng = stock_engine(tmp_path, monkeypatch, use_page_cache=True)
    try:
        backend = eng.worker.worker_handler._backend
        assert isinstance(backend, SeamedDiskBackend)
        budget = eng.worker.worker_handler.num_cpu_blocks * BLOCK_BYTES
        assert all(os.fstat(f.fd).st_size <= budget for f in backend.files)
        eng.add("a", SHARED + prompt(2, 10), 2)
        eng.run()
        eng.reset_gpu_prefix_cache()
        tokens = SHARED + prompt(3, 20)
        eng.add("b", tokens, 2)
        eng.run()
        st = eng.stats["b"]
        assert (st.loads, st.computed, st.stale) == (1, 20 + 1, [])
        assert eng.output("b") == expected_output(tokens, 2)
    finally:
        eng.shutdown()


def test_stock_worker_failed_load_stops_the_engine(tmp_path, monkeypatch, faulty) -> None:
    eng = stock_engine(tmp_path, monkeypatch, use_page_cache=True)
    try:
        eng.add("a", SHARED + prompt(2, 10), 2)
        eng.run()
        eng.reset_gpu_prefix_cache()
        faulty.fail_from("preadv", 1)
        eng.add("b", SHARED + prompt(3, 20), 2)
        # The stock worker polls the load's event, which raises: the engine step
        # fails instead of the request running on the blocks the load never wrote.
        with pytest.raises(UnreportedLoadError, match="does not collect load errors"):
            eng.run()
        assert faulty.fired["preadv"] >= 1
        st = eng.stats["b"]
        assert st.loads == 1
        assert st.computed == 0 and st.stale == []
    finally:
        eng.shutdown()
