"""One way for every command line to refuse a mistake: one line on stderr, exit code 2.

``python -m kvoffload``, ``kvoffload.bench``, ``kvoffload.bench.tier``, ``kvsim`` and
``faults`` all parse with ``Parser`` and run through ``main``. Each flag's ``type=`` is
one of the checks below, so a value is refused where argparse parses it, before
anything is made: no file, no half-written output, no loop device. Checks are objects
whose fields say what they accept, which is what the CLI property tests generate
argument lists from. Input files are read with ``read_lines`` and ``read_json``,
whose errors name the file and the line. Never imports torch (kvsim uses it).

Ctrl-C is one line too: ``main`` turns the first SIGINT into a ``KeyboardInterrupt``
that unwinds the command (its ``finally`` blocks and context managers remove its
files and directories), ignores any further one so that cleanup is not cut short, and
ends with ``PROG: interrupted`` on stderr and exit code 130. ``Progress`` is the one
line that long work rewrites on a terminal, and writes nothing into a pipe.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import difflib
import json
import json.scanner
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Optional

from kvoffload.config import MAX_SIZE, parse_size

# Exit codes every command shares: 1 is the job's own failure (a byte that differs, a
# fault point that broke), so a mistake in the arguments needs its own.
EXIT_USAGE = 2
# As a shell reports a command killed by SIGPIPE (128 + 13): its reader left before the end.
EXIT_BROKEN_PIPE = 141
# As a shell reports a command killed by SIGINT (128 + 2): Ctrl-C.
EXIT_INTERRUPTED = 130
# Columns of output that is not a terminal (a pipe, a file), unless COLUMNS says otherwise.
PIPE_WIDTH = 100
# Threads per lane (or per tier direction) a flag may ask for: far more than any host has
# cores, and few enough that a mistyped 1000000 is refused rather than started.
MAX_IO_THREADS = 1024


class UsageError(Exception):
    """A user mistake (a flag, a path, an input file): one line naming it, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error`` raises ``UsageError`` instead of printing
    the usage and exiting, for subcommands too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # Python 3.11's argparse drops a "--" given as an option's value ("--gib=--") and
        # then skips the type check, handing the command an empty list instead of a value.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument")
        return super()._get_values(action, arg_strings)

    def add_subparsers(self, **kwargs: Any) -> Any:
        kwargs.setdefault("parser_class", Parser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # Unknown options are named before argparse matches positionals: it sets them
        # aside, so a mistyped flag's value became the positional (``--tirr disk:1TB``
        # was "trace: disk:1TB: no such file") or the command went missing.
        args = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_options(args)
        return super().parse_known_args(args, namespace)

    def _refuse_unknown_options(self, args: list[str]) -> None:
        """``unrecognized arguments: --tirr (did you mean --tier?)`` for every option this
        parser does not know; a subcommand's arguments are its own parser's to check."""
        commands = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        known = self._option_string_actions
        unknown = []
        for arg in args:
            if arg == "--":
                break
            if not arg.startswith(tuple(self.prefix_chars)) or len(arg) < 2:
                if commands:
                    break  # the command: what follows is its parser's
                continue
            if self._negative_number_matcher.match(arg) and not self._has_negative_number_optionals:
                continue  # a value such as -1
            name = arg.split("=", 1)[0]
            if name in known or (not name.startswith("--") and name[:2] in known):  # -ofile is -o file
                continue
            if self.allow_abbrev and name.startswith("--") and any(o.startswith(name) for o in known):
                continue  # an abbreviation argparse resolves (or calls ambiguous)
            close = difflib.get_close_matches(name, [o for o in known if o.startswith("--")], n=1)
            unknown.append(name + (f" (did you mean {close[0]}?)" if close else ""))
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")


def main(prog: str, run: Callable[[], int], errors: tuple[type[BaseException], ...] = ()) -> int:
    """``run()``'s exit code, or 2 after one line ``PROG: error: ...`` on stderr for a
    ``UsageError`` or one of ``errors`` (the input errors a command names, such as a bad
    trace record), or 130 after one line ``PROG: interrupted`` on Ctrl-C (SIGINT), once
    everything ``run`` was inside has unwound: its files are removed by then."""
    restore = _interrupt_once()
    try:
        return run()
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted" + (f" ({one_line(e)})" if str(e) else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout left (``| head``): not an error of the command's. Python's
        # own flush of stdout at exit would raise again, so stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (UsageError, *errors) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        restore()


def _interrupt_once() -> Callable[[], None]:
    """Until the function returned is called, the first SIGINT raises ``KeyboardInterrupt``
    (as Python's own handler does) and every later one is ignored: a second Ctrl-C would
    otherwise land in the cleanup the first one started and leave files behind (Ctrl-\\
    still quits at once). Nothing changes off the main thread, or where SIGINT is not
    Python's default handler (ignored, as in a job started with ``&``, or the caller's)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return lambda: None

    def interrupted(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if _held[0]:
            _held[1] = True  # raised where the held steps end (``held``)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


# [depth of ``held`` blocks, whether a Ctrl-C came during one]
_held: list = [0, False]


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Steps that a Ctrl-C must not split, such as making a file and recording it for its
    cleanup: under ``main``, an interrupt that comes inside is raised when the block ends.
    (Python handles a signal between any two bytecodes of the main thread, so without
    this a directory could be made and never recorded.)"""
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1
    if _held[0] == 0 and _held[1]:
        _held[1] = False
        raise KeyboardInterrupt


def private_dir(made: list[str], prefix: str, parent: Optional[str] = None) -> str:
    """A new directory only its owner can enter (``tempfile.mkdtemp``), appended to ``made``
    in the same step (``held``): a cleanup over ``made`` finds every directory made."""
    with held():
        d = tempfile.mkdtemp(prefix=prefix, dir=parent)
        made.append(d)
    return d


def output_width(file: Any = None) -> int:
    """Columns a table written to ``file`` (stdout by default) may fill: COLUMNS when set,
    else the terminal's, else ``PIPE_WIDTH``."""
    file = sys.stdout if file is None else file
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) >= 20:
        return int(cols)
    try:
        if file.isatty():
            cols_now = os.get_terminal_size(file.fileno()).columns
            if cols_now >= 20:  # a pseudo-terminal nobody sized says 0
                return cols_now
    except (AttributeError, OSError, ValueError):
        pass
    return PIPE_WIDTH


class Progress:
    """One line on stderr that long work rewrites in place (``progress("storing 10/40 MiB")``),
    only where stderr is a terminal: into a pipe or a file nothing is written, so output
    there is the command's own. A new ``phase`` is shown at once, updates within it at most
    every ``interval`` seconds. The line is erased on leaving the ``with`` block, however
    it is left, so what follows (a result, an error, ``interrupted``) starts on a clean line."""

    def __init__(self, prog: str, stream: Any = None, interval: float = 0.2) -> None:
        self.prog = prog
        self.stream = sys.stderr if stream is None else stream
        try:
            self.on = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.on = False
        self.interval = interval
        self.phase: Optional[str] = None
        self.last = 0.0
        self.shown = False

    def __call__(self, text: str, phase: Optional[str] = None) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if phase == self.phase and now - self.last < self.interval:
            return
        self.phase, self.last = phase, now
        line = f"{self.prog}: {text}"
        width = output_width(self.stream) - 1  # never the last column: a wrapped line cannot be rewritten
        self._write("\r\x1b[K" + (line if len(line) <= width else line[: max(0, width - 3)] + "..."))
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self._write("\r\x1b[K")
            self.shown = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the work goes on without it
            self.on = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.clear()


@contextlib.contextmanager
def usage_errors(*types: type[BaseException]) -> Iterator[None]:
    """Errors of ``types`` raised inside become a ``UsageError``: for the refusals of the
    code a command drives (the backend's "not enough space ..."), which are the user's
    mistake too."""
    try:
        yield
    except types as e:
        raise UsageError(one_line(e)) from None


def one_line(e: BaseException) -> str:
    text = str(e.strerror if isinstance(e, OSError) and e.strerror and not e.filename else e)
    return " ".join(text.split("\n")) or type(e).__name__


# -- flag checks (argparse ``type=``) ------------------------------------------------


def _decimal(text: str, want: str) -> Decimal:
    """``text`` as an exact decimal number; anything else (or inf, nan) is refused."""
    try:
        if not text.isascii():  # Decimal and int take other scripts' digits too
            raise ValueError(text)
        d = Decimal(text.strip())
    except (InvalidOperation, ValueError):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if not d.is_finite():
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return d


@dataclass(frozen=True)
class Integer:
    """An integer in [minimum, maximum]."""

    minimum: Optional[int] = None
    maximum: Optional[int] = None

    @property
    def want(self) -> str:
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            return f"an integer in [{lo}, {hi}]"
        return f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}" if hi is not None else "an integer"

    def __call__(self, text: str) -> int:
        try:
            if not text.isascii():
                raise ValueError(text)
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.want}, got {text!r}") from None
        if (self.minimum is not None and v < self.minimum) or (self.maximum is not None and v > self.maximum):
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text!r}")
        return v


@dataclass(frozen=True)
class Number:
    """A finite number > ``above`` or >= ``minimum``, and <= ``maximum``; the error names
    the bound that was missed."""

    minimum: Optional[float] = None
    above: Optional[float] = None
    maximum: Optional[float] = None
    want_text: str = ""

    @property
    def want(self) -> str:
        if self.want_text:
            return self.want_text
        lower = f"> {self.above:g}" if self.above is not None else (
            f">= {self.minimum:g}" if self.minimum is not None else "")
        return " ".join(["a number", lower]).strip()

    def __call__(self, text: str) -> float:
        v = float(_decimal(text, self.want))  # 1e400 is finite as a decimal, inf as a float
        if not math.isfinite(v) or (self.above is not None and not v > self.above) or (
                self.minimum is not None and v < self.minimum):
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text!r}")
        if self.maximum is not None and v > self.maximum:
            raise argparse.ArgumentTypeError(f"must be {self.want_text or f'at most {self.maximum:g}'}, got {text!r}")
        return v


FRACTION = Number(above=0.0, maximum=1.0, want_text="a fraction in (0, 1]")


@dataclass(frozen=True)
class Amount:
    """A number of ``unit``s (``--gib 0.5``) as whole bytes, exactly (a decimal, never a
    float; rounded down to the byte), at least ``minimum`` bytes, a multiple of
    ``multiple``, and at most 2**63 - 1."""

    unit: int
    unit_name: str
    minimum: int = 1
    multiple: int = 1

    @property
    def want(self) -> str:
        return (f"a number of {self.unit_name}, at least {self.minimum} byte{'' if self.minimum == 1 else 's'}"
                + (f" and a multiple of {self.multiple} bytes" if self.multiple > 1 else ""))

    def __call__(self, text: str) -> int:
        d = _decimal(text, self.want)
        # The exponent is bounded before exact arithmetic, so "1e999999999" costs nothing:
        # above 1e25 of a unit is beyond 2**63 bytes, below 1e-25 less than a byte.
        if d > 0 and d.adjusted() > 25:
            raise argparse.ArgumentTypeError(f"{text} {self.unit_name} is more than 2**63 - 1 bytes")
        exact = Fraction(d) * self.unit if d > 0 and d.adjusted() >= -25 else Fraction(0)
        if exact > MAX_SIZE:
            raise argparse.ArgumentTypeError(f"{text} {self.unit_name} is more than 2**63 - 1 bytes")
        n = math.floor(exact)  # rounded down to the byte
        if n < self.minimum or n % self.multiple:
            raise argparse.ArgumentTypeError(f"must be {self.want}, got {text!r}"
                                             + (f" ({float(exact):g} bytes)" if exact else ""))
        return n


@dataclass(frozen=True)
class Size:
    """Bytes by kvoffload's size rules (``8GiB``, ``100GB``, ``4096``): exact, > 0."""

    def __call__(self, text: str) -> int:
        try:
            return parse_size("size", text, positive=True)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Names:
    """A comma list of names from ``allowed`` (at least one, none twice); a typo gets a
    did-you-mean. Returns the names in the order given."""

    allowed: tuple[str, ...]

    def __call__(self, text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in self.allowed]
        if bad or not names or len(set(names)) != len(names):
            hint = ""
            close = difflib.get_close_matches(bad[0], self.allowed, n=1) if bad else []
            if close:
                hint = f" (did you mean {close[0]!r}?)"
            what = f"unknown {', '.join(map(repr, bad))}{hint}; " if bad else (
                "a name given twice; " if names else "")
            raise argparse.ArgumentTypeError(f"{what}expected a comma list of {', '.join(self.allowed)}, "
                                             f"got {text!r}")
        return names


@dataclass(frozen=True)
class Directory:
    """An existing directory (a symlink to one too), writable unless ``writable`` is False
    (then whoever uses it says why it cannot)."""

    writable: bool = True

    def __call__(self, path: str) -> str:
        if not os.path.exists(path):
            raise argparse.ArgumentTypeError(f"{path}: no such directory" + (
                " (a dangling symlink)" if os.path.islink(path) else ""))
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{path}: not a directory")
        if self.writable and not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{path}: directory not writable")
        return path


@dataclass(frozen=True)
class InputFile:
    """An existing, readable regular file."""

    def __call__(self, path: str) -> str:
        if not os.path.exists(path):
            raise argparse.ArgumentTypeError(f"{path}: no such file")
        if not os.path.isfile(path):
            raise argparse.ArgumentTypeError(f"{path}: not a regular file")
        if not os.access(path, os.R_OK):
            raise argparse.ArgumentTypeError(f"{path}: not readable")
        return path


@dataclass(frozen=True)
class OutputFile:
    """A file that can be written: its directory exists and is writable, and the path is
    not a directory; ``suffixes``, when given, are the endings it may have."""

    suffixes: tuple[str, ...] = ()

    def __call__(self, path: str) -> str:
        parent = os.path.dirname(os.path.abspath(path))
        if self.suffixes and not path.lower().endswith(self.suffixes):
            raise argparse.ArgumentTypeError(f"{path!r}: name a file ending in {', '.join(self.suffixes)}")
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{path}: is a directory; name a file")
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{path}: no such directory {parent}")
        if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{path}: not writable")
        return path


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file in the same
    directory, renamed over it once complete (an error halfway leaves nothing)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def free_bytes(directory: str) -> int:
    """What an unprivileged user may still write on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


# -- input files: every error names the file and the line ----------------------------


class InputError(ValueError):
    """A bad input file or record; the message starts ``FILE:LINE:``."""


def read_lines(path: str, error: type[InputError] = InputError) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 text file; a line that is not UTF-8 is
    an ``error`` naming the file and the line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                            f"{e.start + 1})") from None


class Located(dict):
    """A JSON object from ``read_json``: ``line`` is where it starts, ``lines[key]`` where
    each key's value does."""

    line: int = 0
    lines: dict[str, int]


class LocatedList(list):
    """A JSON array from ``read_json``: ``line`` is where it starts, ``lines[i]`` where
    each item does."""

    line: int = 0
    lines: list[int]


def read_json(path: str) -> Any:
    """A JSON document whose objects and arrays are ``Located``/``LocatedList``, so a
    check can say on which line a bad value is (``where``). ``NaN`` and ``Infinity``
    parse, as Python's json has them; the checks refuse non-finite figures."""
    text = "".join(line for _, line in read_lines(path))
    try:
        return _LocatingDecoder(text).decode(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{e.lineno}: not JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise InputError(f"{path}: not JSON this program reads: nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        limit = sys.get_int_max_str_digits()
        long = re.search(r"\d{%d,}" % (limit + 1), text) if limit else None
        line = f":{text.count(chr(10), 0, long.start()) + 1}" if long else ""
        raise InputError(f"{path}{line}: not JSON this program reads: an integer of more than {limit} digits") from None


class _LocatingDecoder(json.JSONDecoder):
    """The pure-Python scanner (the C one calls no Python hook), its object and array
    parsers wrapped to note where each value starts."""

    def __init__(self, doc: str) -> None:
        super().__init__()
        newlines = [i for i, c in enumerate(doc) if c == "\n"]

        def line(index: int) -> int:
            return bisect.bisect_left(newlines, index) + 1

        def noting(scan_once, starts: list[int]):
            def scan(s: str, idx: int):
                starts.append(idx)  # JSONObject and JSONArray scan each value through here
                return scan_once(s, idx)
            return scan

        obj, arr = self.parse_object, self.parse_array

        def parse_object(state, strict, scan_once, object_hook, object_pairs_hook, *rest):
            starts: list[int] = []
            pairs, end = obj(state, strict, noting(scan_once, starts), None, list, *rest)
            out = Located(pairs)
            out.line, out.lines = line(state[1]), {k: line(i) for (k, _), i in zip(pairs, starts)}
            return out, end

        def parse_array(state, scan_once, *rest):
            starts: list[int] = []
            items, end = arr(state, noting(scan_once, starts), *rest)
            out = LocatedList(items)
            out.line, out.lines = line(state[1]), [line(i) for i in starts]
            return out, end

        self.parse_object, self.parse_array = parse_object, parse_array
        self.scan_once = json.scanner.py_make_scanner(self)


def where(path: str, container: Any, key: Any = None) -> str:
    """``FILE:LINE`` of ``container[key]`` (or of ``container`` itself) from ``read_json``;
    ``FILE`` alone where the line is not known."""
    line = getattr(container, "line", 0)
    lines = getattr(container, "lines", None)
    if key is not None and lines is not None:
        try:
            line = lines[key]
        except (KeyError, IndexError, TypeError):
            pass
    return f"{path}:{line}" if line else path


def finite_number(value: Any) -> bool:
    """An int or float that is finite (not a bool, whose True would read as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require(ok: bool, path: str, container: Any, key: Any, message: str,
            error: type[InputError] = InputError) -> None:
    """Raise ``error`` ``FILE:LINE: message`` (the line of ``container[key]``) unless ``ok``."""
    if not ok:
        raise error(f"{where(path, container, key)}: {message}")


def integer_at_least(value: Any, minimum: int) -> bool:
    """An int (not a bool) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
