"""The IO engine: what moves a job's units between the caller's blocks and the slot files.

One interface, two engines, chosen once per ``init`` (``engine_choice.choose``):

- ``python_engine.PythonEngine``, the reference: Python IO threads per lane, a unit's
  seals and file calls slot by slot in Python (``python_engine/store_path.py``,
  ``python_engine/load_path.py``).
- ``native_engine.NativeEngine``: C worker threads per lane that never take the GIL for a
  unit (``native_engine/engine.c``, ``store_unit.c``, ``load_unit.c``); Python touches a
  job when it is submitted and once when it is collected.

``Run`` (``run.py``) checks and registers a job, then ``Engine.submit`` queues its units;
the engine reports each finished part with ``Run.settle`` (one outcome per slot, the
records a store made, its time in file calls). Nothing outside an engine asks which one
runs: its ``name`` is for reports only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import numpy as np

from kvoffload.slot_records import Records

# One outcome per slot of a job (the native core's KVO_* codes, native_engine/unit_io.h,
# which a test holds equal), and the failure cause each is counted as.
OK, IO_ERROR, SHORT, INTEGRITY, CANCELLED, SKIP, DEVICE = range(7)
CAUSES = {IO_ERROR: "io_error", SHORT: "short", INTEGRITY: "integrity", CANCELLED: "closing",
          SKIP: "not_stored", DEVICE: "device"}


class Engine(Protocol):
    """What ``Run`` asks of an IO engine."""

    name: str  # "python" or "native": for reports (metrics, stats, the bench's JSON)

    def start(self, start_timeout: float) -> None:
        """Allocate staging, start the workers and wait (at most ``start_timeout`` s) until
        each has bound the device; raise if one could not."""

    def submit(self, job: Any, blocks: np.ndarray, slots: np.ndarray, wait_event: Any,
               records: Optional[Records]) -> None:
        """Queue ``job``'s units; never blocks. ``records``: a load's, what each slot is
        checked against; a persistent store's, each slot's identity (``ident``)."""

    def begin_close(self) -> None:
        """No new file call; every unit taken from now on ends without IO."""

    def fail(self) -> None:
        """A fatal failure was recorded: units taken from now on end as device failures."""

    def join(self, deadline: float, clock: Callable[[], float]) -> list[str]:
        """Wait until ``deadline`` for the workers to end; the ones still alive."""

    def wait_copies(self, deadline: float, clock: Callable[[], float]) -> None:
        """Wait until ``deadline`` for the device copies under way (into the caller's blocks)."""

    def end_writes(self) -> None:
        """From now on nothing is written into the caller's memory for any job."""

    def abandon(self, close: Callable[[], None]) -> None:
        """Workers outlived shutdown: ``close`` once the last of them ended."""

    def close(self) -> None:
        """Release what the engine holds (its key, its native state); no worker runs."""

    def queued(self) -> dict[tuple[str, int], int]:
        """Units waiting now per (direction, disk path index)."""

    def stage_seconds(self) -> dict[str, dict[str, float]]:
        """Worker seconds per stage (``wait``, ``device``, ``seal``, ``io``) and direction."""
