"""The ranges kvsim takes numbers in, from its flags and from the files it reads.

Every figure is checked where it is parsed: a flag by its ``type=`` (a
``kvoffload.cli_args`` check, one line naming the flag, exit 2), a field of a trace, a
``calibrate gpu`` measurements file, a hardware profile or a bench JSON by
``integer_in``/``number_in`` where the file is read (one line naming the file and the
line, exit 2). Each bound is far beyond any real deployment, and low enough that the
arithmetic it feeds cannot overflow: Python's integers never do, but the floats they
meet (overflow past 1.8e308, an ``int`` too large to convert), numpy's int64 (the GEMM
tile counts of gpu.py wrap past 2**63, and their powers turn complex) and the C longs
of ``islice`` and ``range`` do.
"""

from __future__ import annotations

from typing import Any, Optional

from kvoffload import cli_args

# Tokens: of a prompt, an output, a prefill chunk, a step, a block, a decode context,
# vLLM's token budget. The longest context a model serves today is ~10**7 tokens (Llama
# 4 Scout's 10M); 10**9 is a hundred times that. Bounded so, the products kvsim forms
# stay finite and exact: tokens x KV bytes per token (<= 2**30) <= 2**60, attention FLOPs
# (~tokens**2 x layers x hidden) ~1e27 as a float, a GEMM's tiles (tokens / 64 x width /
# 64 x split-K 8) ~1e14 in gpu.py's int64 (10**41 tokens overflowed it; 2**62 wrapped it
# negative and made its times complex).
MAX_TOKENS = 10**9
# Requests and sequences: a decode batch, --max-num-seqs, --concurrency, --limit,
# contexts, groups, prompts, requests. vLLM runs hundreds to a few thousand sequences at
# once; a trace of 10**9 requests would not fit in memory (each holds its hash ids).
MAX_COUNT = 10**9
# KV bytes per token: Llama-3-405B's is ~0.5 MiB in bf16; 1 GiB is two thousand times that.
MAX_KV_BYTES_PER_TOKEN = 2**30
# Seeds: --sample hashes with a 64-bit xxh64 seed, which takes a larger one modulo 2**64
# (--seed 2**64 would sample exactly as --seed 0).
MAX_SEED = 2**64 - 1
# Arrival times, as the trace's ms or us become ns: int64 nanoseconds (292 years), so an
# epoch timestamp of this century fits.
MAX_ARRIVAL_NS = 2**63 - 1
# Request rates of the reload scenario (requests/s): one every 11.6 days to a million a
# second. A slower rate's gap between arrivals (1e9 / rate ns) overflowed a float.
MIN_RATE, MAX_RATE = 1e-6, 1e6
# The router's scorer weights are relative: a million to one is one scorer alone already.
MAX_WEIGHT = 1e6
# GPUs per replica (tensor parallelism): one host's NVLink domain, as --tp takes.
MAX_TP = 8
# Drives of a hardware profile, a bench case's paths and IO threads: each is simulated
# one by one (as tiers.py bounds a tier's threads=, paths=); far more than a host has.
MAX_DRIVES = cli_args.MAX_IO_THREADS
MAX_THREADS = cli_args.MAX_IO_THREADS
# IOs in flight per thread (a bench's queue depths; a tier's ios-per-thread= takes as many).
MAX_QUEUE_DEPTH = 1024
# A host's cores (a profile's or a bench's cpus): the largest hosts have a few hundred.
MAX_CPUS = 2**16
# Rates of a profile or a bench, GiB/s: 1 KiB/s to a PiB/s, a thousand times an HBM's.
# A slower rate's IO times overflowed a float, a faster one's underflowed to zero.
MIN_GIB_S, MAX_GIB_S = 1e-6, 1e6
# A fixed cost of a profile (microseconds per IO, per call, per row, per MiB): up to 1000 s.
MAX_US = 1e9
# A time measured (a step's milliseconds, an all-reduce's microseconds): no GPU work
# takes less than a nanosecond or more than 11.6 days; past either the fit's logs and
# least squares lose every digit.
MIN_MS, MAX_MS = 1e-6, 1e9
# Bytes a file states (a GPU's memory, an all-reduce, a bench case, block, job, IO, unit):
# a PiB, a thousand times any GPU's or host's memory.
MAX_BYTES = 2**50
# Blocks a bench case moves (its bytes over its layout's block): calibration replays each
# case dozens of times, block by block; 64 times the bench's default --max-blocks (16384).
MAX_BENCH_BLOCKS = 2**20
# Rows per call of a bench's seam case: its unit is that many slots.
MAX_ROWS = 2**20

# -- flags (argparse ``type=``) -------------------------------------------------------

TOKENS = cli_args.Integer(1, MAX_TOKENS)
TOKENS_OR_NONE = cli_args.Integer(0, MAX_TOKENS)  # 0: none (--output-len), the whole prompt (--router-prefix-tokens)
COUNT = cli_args.Integer(1, MAX_COUNT)
SEED = cli_args.Integer(0, MAX_SEED)
KV_BYTES_PER_TOKEN = cli_args.Integer(1, MAX_KV_BYTES_PER_TOKEN)
RATE = cli_args.Number(minimum=MIN_RATE, maximum=MAX_RATE,
                       want_text=f"a rate in [{MIN_RATE:g}, {MAX_RATE:g}] requests/s")
WEIGHT = cli_args.Number(above=0.0, maximum=MAX_WEIGHT, want_text=f"a weight in (0, {MAX_WEIGHT:g}]")
DRIVES = cli_args.Integer(1, MAX_DRIVES)


# -- fields of input files ---------------------------------------------------------------


def integer_in(value: Any, minimum: int, maximum: int) -> bool:
    """An int (not a bool) in [minimum, maximum]."""
    return cli_args.integer_at_least(value, minimum) and value <= maximum


def number_in(value: Any, minimum: float, maximum: float, above: Optional[float] = None) -> bool:
    """A finite int or float (not a bool) in [minimum, maximum] (> ``above`` too, if given)."""
    return (cli_args.finite_number(value) and minimum <= value <= maximum
            and (above is None or value > above))


def integer_range(minimum: int, maximum: int) -> str:
    """``an integer in [1, 1000000000]``: what an ``integer_in`` check asks for, said."""
    return f"an integer in [{minimum}, {maximum}]"


def number_range(minimum: float, maximum: float) -> str:
    return f"a number in [{minimum:g}, {maximum:g}]"


def shown(value: Any, limit: int = 40) -> str:
    """``value`` for an error message: a number of 10**40 digits is not printed whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
