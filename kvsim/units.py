"""kvsim's one convention for sizes: binary units (KiB, MiB, GiB, TiB).

vLLM's sizes are binary (its CPU tier's 8 GiB default, ``--kv-offloading-size`` in GiB),
kvoffload's too (``disk_capacity_bytes`` 100 GiB), and so are the sources kvsim's
scenarios reproduce (vLLM PR #49644's 107374182400-byte disk, llm-d's 214748364800-byte
CPU tier): kvsim's scenarios name their tiers in GiB and its tables, titles and messages
print sizes in GiB. A size typed on the command line is kept as typed (``disk:1TB`` is
10**12 bytes and is labelled ``disk:1TB``); JSON gives bytes.
"""

from __future__ import annotations

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def size(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, one decimal: ``159.0 GiB``."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} B" if n else "0"
