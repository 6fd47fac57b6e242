"""Which IO engine a run gets: the one choice, made once per ``init``.

The native engine where its compiled core loads and implements the run's seal, else the
Python engine, the reference; ``native_io`` (or ``$KVOFFLOAD_NATIVE_IO``) turns the native
one off or requires it. Only this module names the engines (``engine.py`` is the
interface they share), and the reason it gives is what the start-up line says.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from kvoffload import native_engine, python_engine
from kvoffload.config import NATIVE_IO_ENV, parse_choice
from kvoffload.engine import Engine

# The seals the native engine implements; xxh3 checksums are the Python engine's only.
NATIVE_SEALS = ("aes-gcm", "off")


def from_environment() -> Optional[bool]:
    """``$KVOFFLOAD_NATIVE_IO``: on (the native engine, required), off (the Python engine), auto."""
    return parse_choice(os.environ.get(NATIVE_IO_ENV, ""), NATIVE_IO_ENV)


def choose(seal_name: str, requested: Optional[bool]) -> tuple[Callable[[Any], Engine], str]:
    """The one choice: (what makes the run's engine from the run; what the start-up line
    says of it). ``requested`` True where the native engine cannot run raises
    ``ValueError`` naming why."""
    why = None
    core = None
    if requested is False:
        why = f"turned off (native_io=off or {NATIVE_IO_ENV}=off)"
    elif seal_name not in NATIVE_SEALS:
        why = f"no native {seal_name} seal"
    else:
        core = native_engine.core()
        if core is None:
            why = native_engine.why_unavailable()
        elif seal_name == "aes-gcm" and core.gcm == "none":
            why = "this CPU has no AES-NI and PCLMULQDQ for the native AES-GCM"
    if why is None:
        return (lambda run: native_engine.NativeEngine(run, core)), f"native ({core.build}, AES-GCM {core.gcm})"
    if requested:
        raise ValueError(f"native_io=on: {why}")
    return python_engine.PythonEngine, f"Python ({why})"
