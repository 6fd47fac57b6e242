"""Benchmarks and measurement tools; nothing here runs in a deployment.

- ``python -m kvoffload.bench`` (``suite.py``): kvoffload next to the ceilings of the
  same machine (``ceilings.py``: raw file IO, pinned copies, host memcpy; ``seal_rate.py``:
  the slot seals alone), on cases sized to fit the drives (``sizing.py``), optionally on a
  RAM-backed drive array it builds and removes (``ram_array.py``). ``workload.py``: the
  layouts, caches and jobs it moves; ``report.py``: its tables, and
  ``python -m kvoffload.bench.report`` for a compact table of several ``--json`` runs.
- ``ranks.py``: two ranks sharing one directory (``scripts/two_ranks.py``).
- ``dram_backend.py``: the same contract over pinned host memory, the DRAM row of the table.
"""
