"""Benchmarks and measurement tools; nothing here runs in a deployment.

- ``python -m kvoffload.bench`` (``suite.py``): kvoffload next to the ceilings of the
  same machine (``ceilings.py``: raw file IO, pinned copies, host memcpy).
- ``ranks.py``: two ranks sharing one directory (``scripts/two_ranks.py``).
- ``dram_backend.py``: the same contract over pinned host memory, the DRAM row of the table.
"""
