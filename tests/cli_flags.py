"""Argument lists drawn from a parser's own flag table (issue 23's CLI property tests).

Every optional flag of a parser is looked up in its argparse table; what parses it (a
``kvoffload.cli_args`` check, ``choices``, or a switch) says which values are good and
which are mistakes: non-finite, below the minimum, sub-byte, beyond 2**63 bytes, not a
number, an unknown name, a missing path, a file where a directory belongs; and which are
huge (10**30 of something: the command must refuse it in one line or cope, never try).
A test gives small good values where the default good ones would make a slow run, and
strategies for its CLI's own custom types; a flag with neither fails the test, so a new
flag cannot go untested. Each drawn value comes with what it is (good, bad, huge), so a
test can demand exit 2 for any mistake. Flags that exclude each other (an argparse
mutually exclusive group) appear together only in a list marked bad; rules between
flags that argparse does not know (a minimum above a maximum) are each test's to model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

from hypothesis import strategies as st

from kvoffload import cli_args

GOOD, BAD, HUGE = "good", "bad", "huge"
Value = tuple[str, str]  # the text given, and which of those it is
HUGE_COUNTS = [str(10**30), str(2**63)]
NOT_NUMBERS = ["", "x", "1.5.2", "0x10", "--", "one"]
NON_FINITE = ["inf", "-inf", "nan", "Infinity", "1e400"]


def flag_table(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Each optional flag (its longest spelling) and what parses it: the ``type`` object,
    the ``choices`` tuple, or ``"switch"`` for one that takes no value."""
    out: dict[str, Any] = {}
    for action in parser._actions:  # argparse has no public list of its actions
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        out[flag] = "switch" if action.nargs == 0 else tuple(action.choices) if action.choices else action.type
    return out


def subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@dataclass
class Paths:
    """The paths a drawn argument list may name; made once per test."""

    directory: Path  # an existing, writable, empty directory
    file: Path  # an existing regular file

    @property
    def missing(self) -> Path:
        return self.directory / "missing" / "nowhere"


def _good_of(check: Any, paths: Paths) -> Optional[st.SearchStrategy[str]]:
    if isinstance(check, tuple):
        return st.sampled_from(check)
    if isinstance(check, cli_args.Integer):
        lo = check.minimum if check.minimum is not None else 0
        return st.integers(lo, lo + 3).map(str)
    if isinstance(check, cli_args.Number):
        lo = check.minimum if check.minimum is not None else (check.above or 0.0)
        return st.sampled_from([f"{lo + 0.25:g}", f"{lo + 1:g}"]).filter(lambda t: check.maximum is None
                                                                         or float(t) <= check.maximum)
    if isinstance(check, cli_args.Amount):  # a few small multiples, written exactly in the unit
        step = max(check.minimum, check.multiple)
        return st.integers(1, 4).map(lambda k: str(Decimal(step * k) / check.unit))
    if isinstance(check, cli_args.Size):
        return st.sampled_from(["8GiB", "100GB", "4096", "1.5 GiB"])
    if isinstance(check, cli_args.Names):
        return st.lists(st.sampled_from(check.allowed), min_size=1, unique=True).map(",".join)
    if isinstance(check, cli_args.Directory):
        return st.just(str(paths.directory))
    if isinstance(check, cli_args.InputFile):
        return st.just(str(paths.file))
    if isinstance(check, cli_args.OutputFile):
        return st.just(str(paths.directory / f"out{(check.suffixes or ('.txt',))[0]}"))
    return None


def _bad_of(check: Any, paths: Paths) -> Optional[st.SearchStrategy[str]]:
    if isinstance(check, tuple):
        return st.sampled_from(["bogus", check[0] + "x", ""])
    if isinstance(check, cli_args.Integer):
        below = [str(check.minimum - k) for k in (1, 2, 10**6)] if check.minimum is not None else []
        above = [str(check.maximum + 1)] if check.maximum is not None else []
        return st.sampled_from(below + above + NOT_NUMBERS + ["1.5", "inf", "nan", "1e3"])
    if isinstance(check, cli_args.Number):
        below = [f"{check.minimum - 1:g}"] if check.minimum is not None else []
        below += [f"{check.above:g}", f"{check.above - 1:g}"] if check.above is not None else []
        above = [f"{check.maximum * 2 + 1:g}"] if check.maximum is not None else []
        return st.sampled_from(below + above + NOT_NUMBERS + NON_FINITE)
    if isinstance(check, cli_args.Amount):
        sub = ["0", "-1", "1e-30"] + ([f"{(check.minimum - 1) / check.unit:.12f}"] if check.minimum > 1 else [])
        odd = [f"{(check.multiple + 1) / check.unit:.12f}"] if check.multiple > 1 else []
        return st.sampled_from(sub + odd + ["1e300", str(10**30)] + NOT_NUMBERS + NON_FINITE)
    if isinstance(check, cli_args.Size):
        return st.sampled_from(["0", "-1", "1e9", "lots", "1.5B", "9223372036854775808", "inf", "12 parsecs", ""])
    if isinstance(check, cli_args.Names):
        return st.sampled_from([check.allowed[0] + "x", "", ",", f"{check.allowed[0]},{check.allowed[0]}",
                                check.allowed[0][:-1]])
    if isinstance(check, cli_args.Directory):
        return st.sampled_from([str(paths.missing), str(paths.file)])
    if isinstance(check, cli_args.InputFile):
        return st.sampled_from([str(paths.missing), str(paths.directory)])
    if isinstance(check, cli_args.OutputFile):
        bad = [str(paths.missing), str(paths.directory)]
        if check.suffixes:
            bad.append(str(paths.directory / "out.bogus"))
        return st.sampled_from(bad)
    return None


def _huge_of(check: Any) -> Optional[st.SearchStrategy[str]]:
    """Values a check accepts that no machine can serve (counts and sizes without a maximum)."""
    if isinstance(check, cli_args.Integer) and check.maximum is None:
        return st.sampled_from(HUGE_COUNTS)
    if isinstance(check, cli_args.Amount):
        return st.just(f"{(2**62) / check.unit:.0f}")
    if isinstance(check, cli_args.Size):
        return st.just(str(2**62))
    return None


def arguments(parser: argparse.ArgumentParser, paths: Paths, good: dict[str, st.SearchStrategy[str]] | None = None,
              bad: dict[str, st.SearchStrategy[str]] | None = None, huge: dict[str, st.SearchStrategy[str]] | None = None,
              skip: tuple[str, ...] = ()) -> st.SearchStrategy[tuple[list[str], str]]:
    """(argv, what it holds) over ``parser``'s flags, ``skip`` left out: ``BAD`` if any value
    is a mistake, else ``HUGE`` if any is huge, else ``GOOD``.

    ``good``/``bad``/``huge``: a flag's values where the table's defaults do not fit (a
    workload that must stay small, a custom type, a flag whose huge value would run)."""
    good, bad, huge = dict(good or {}), dict(bad or {}), dict(huge or {})
    table = {f: c for f, c in flag_table(parser).items() if f not in skip}
    per_flag: dict[str, st.SearchStrategy[list[Value]]] = {}
    for flag, check in table.items():
        if check == "switch":
            per_flag[flag] = st.booleans().map(lambda on, f=flag: [(f, GOOD)] if on else [])
            continue
        g = good[flag] if flag in good else _good_of(check, paths)
        b = bad[flag] if flag in bad else _bad_of(check, paths)
        assert g is not None and b is not None, f"{flag}: no strategy for {check!r}; give one in good= and bad="
        kinds = [g.map(lambda t: (t, GOOD)), b.map(lambda t: (t, BAD))]
        h = huge[flag] if flag in huge else _huge_of(check)
        if h is not None:
            kinds.append(h.map(lambda t: (t, HUGE)))
        per_flag[flag] = st.one_of(kinds).map(lambda v, f=flag: [(f"{f}={v[0]}", v[1])])
    # Flags of one mutually exclusive group are drawn together only as a mistake of their
    # own, a clash (one list in ten where the parser has such a group; each flag given,
    # a switch on): argparse refuses the pair whatever the values, so a list of good
    # values holding both is not good.
    assert not any(g.required for g in parser._mutually_exclusive_groups), (
        f"{parser.prog}: a required mutually exclusive group; draw one of its flags in every list")
    groups = [[f for f in (max(a.option_strings, key=len) for a in g._group_actions if a.option_strings)
               if f in per_flag] for g in parser._mutually_exclusive_groups]
    group_of = {f: i for i, members in enumerate(groups) for f in members}
    clashes = [members for members in groups if len(members) > 1]
    chosen = (st.lists(st.sampled_from(sorted(per_flag)), unique_by=lambda f: group_of.get(f, f), max_size=6)
              if per_flag else st.just([]))
    clash = st.sampled_from(clashes).flatmap(st.permutations).map(lambda m: tuple(m[:2])) if clashes else None

    def present(flag: str) -> st.SearchStrategy[list[Value]]:
        """The flag given: a switch on, or one drawn value."""
        return st.just([(flag, GOOD)]) if table[flag] == "switch" else per_flag[flag]

    @st.composite
    def draw(draw_: Callable) -> tuple[list[str], str]:
        # 9, not 0: Hypothesis shrinks towards 0, so a failure shrinks to a list without a clash.
        pair = draw_(clash) if clash is not None and draw_(st.integers(0, 9)) == 9 else ()
        flags = [f for f in draw_(chosen) if not pair or group_of.get(f) != group_of[pair[0]]]
        argv: list[str] = []
        kinds = {BAD} if pair else set()
        for strategy in [*(per_flag[f] for f in flags), *(present(f) for f in pair)]:
            for text, kind in draw_(strategy):
                argv.append(text)
                kinds.add(kind)
        return argv, BAD if BAD in kinds else HUGE if HUGE in kinds else GOOD

    return draw()


@dataclass
class Result:
    rc: int
    out: str
    err: str


def run(main: Callable[[list[str]], int], argv: list[str]) -> Result:
    """``main(argv)`` in this process with stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return Result(rc, out.getvalue(), err.getvalue())


def assert_refused(r: Result, prog: str, argv: list[str]) -> None:
    """Exit 2, nothing on stdout, and exactly one line on stderr naming the program."""
    assert r.rc == 2, f"{argv}: exit {r.rc}, stderr {r.err!r}"
    assert r.out == "", f"{argv}: stdout {r.out[:300]!r}"
    assert r.err.count("\n") == 1 and r.err.startswith(f"{prog}: error: "), f"{argv}: stderr {r.err!r}"


def listing(*dirs: Path) -> dict[str, list[str]]:
    """What each directory holds (nothing may be left behind by a refused run)."""
    return {str(d): sorted(os.listdir(d)) for d in dirs}
