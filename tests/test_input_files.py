"""Every input file parser, fed malformed records (issue 23).

A good file is mutated (a field removed, replaced by any JSON value, an unknown field,
a line that is not JSON or not UTF-8) and parsed. It either parses, and what reads it
next does not fail, or the error is one line that starts with the file name and the
line of the bad record or field. Never an AttributeError, KeyError or TypeError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cli_args import read_json
from kvsim.calibrate import BenchError, bench_cases, ceilings, check_bench
from kvsim.profile import PROFILE_DIR, load_profile
from kvsim.trace import TraceError, read_trace

DATA = Path(__file__).parent / "data"
RUNS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
GOOD_RECORD = {"timestamp": 5, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.integers(2**63, 2**70) | st.text(max_size=4)
    | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=6,
)


def one_line_at(e: Exception, path: Path) -> int:
    """The line number an error names; it must be one line starting ``PATH:LINE:``."""
    text = str(e)
    assert "\n" not in text, text
    assert text.startswith(f"{path}:"), text
    line = text[len(str(path)) + 1:].split(":", 1)[0]
    assert line.isdigit(), text
    return int(line)


# -- traces (jsonl) ----------------------------------------------------------------------

record_lines = st.one_of(
    # a field removed or replaced by any JSON value, or one added
    st.tuples(st.sampled_from(sorted(GOOD_RECORD) + ["arrival_us", "block_tokens", "phase"]), json_values,
              st.booleans()).map(lambda t: json.dumps({k: v for k, v in {**GOOD_RECORD, t[0]: t[1]}.items()
                                                       if not (t[2] and k == t[0])}).encode()),
    st.binary(max_size=20),  # not JSON, often not UTF-8
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),  # deeply nested
)


@RUNS
@given(line=record_lines)
def test_trace_records(tmp_path, line):
    path = tmp_path / "t.jsonl"
    good = json.dumps(GOOD_RECORD).encode()
    path.write_bytes(good + b"\n" + line.replace(b"\n", b" ") + b"\n" + good.replace(b"5", b"7", 1) + b"\n")
    try:
        requests = read_trace(str(path))
    except TraceError as e:
        line = one_line_at(e, path)
        # The bad record's line, or the next one's: after a record in the far future, the
        # good record that follows goes back in time.
        assert line == 2 or (line == 3 and "arrival goes backwards" in str(e)), str(e)
    else:
        assert all(r.input_length >= 1 and len(r.hash_ids) >= 1 for r in requests)


def test_a_trace_that_is_not_utf8_names_its_file_and_line(tmp_path):
    """Issue 23: the decode error named neither."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD_RECORD).encode() + b"\n" + b'{"timestamp": 6, "x": "\xff"}\n')
    with pytest.raises(TraceError, match=rf"^{path}:2: not UTF-8 text \(byte 0xff at column 24\)$"):
        read_trace(str(path))


# -- hardware profiles (JSON) -----------------------------------------------------------

PROFILE = json.loads((PROFILE_DIR / "h200_disk.json").read_text())
FIELDS = [(k,) for k in PROFILE] + [(k, sub) for k, v in PROFILE.items() if isinstance(v, dict) for sub in v]


def expected_line(text: str, field: tuple[str, ...]) -> int:
    """The line of ``field`` in ``json.dumps(..., indent=1)`` output."""
    lines = text.splitlines()
    at = 0
    for depth, key in enumerate(field, 1):
        at = next(i for i in range(at, len(lines)) if lines[i].startswith(" " * depth + f'"{key}":'))
    return at + 1


@RUNS
@given(field=st.sampled_from(FIELDS), value=json_values, drop=st.booleans())
def test_profile_fields(tmp_path, field, value, drop):
    doc = json.loads(json.dumps(PROFILE))
    parent = doc if len(field) == 1 else doc[field[0]]
    if drop:
        del parent[field[-1]]
    else:
        parent[field[-1]] = value
    text = json.dumps(doc, indent=1)
    path = tmp_path / "hw.json"
    path.write_text(text)
    try:
        profile = load_profile(str(path))
    except ValueError as e:
        line = one_line_at(e, path)
        parts = str(e).split(": ")
        named = parts[2].split()[0] if len(parts) > 2 and parts[1].startswith("profile") else None
        if not drop and named == ".".join(field):  # the line of the very field
            assert line == expected_line(text, field), (str(e), field)
        elif not drop and named and named.startswith(".".join(field) + "."):  # a field inside the value
            assert line > expected_line(text, field), (str(e), field)
    else:
        assert profile.drives >= 1 and profile.seal_ns_per_byte("aes-gcm") > 0


def test_a_profile_with_a_wrong_type_names_the_field_and_line(tmp_path):
    """Issue 23: a list where the seal rates belong gave an AttributeError."""
    doc = json.loads(json.dumps(PROFILE))
    doc["seal_gib_s"] = [9.4, 44.0]
    text = json.dumps(doc, indent=1)
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}:{expected_line(text, ('seal_gib_s',))}: .*seal_gib_s must be an "
                                         r"object of rates by seal"):
        load_profile(str(path))


# -- bench JSON for kvsim calibrate -----------------------------------------------------

BENCH = json.loads((DATA / "bench_h200_disk.json").read_text())


def bench_fields() -> st.SearchStrategy[tuple[Any, ...]]:
    """A path into the bench document: a case's field or detail field, or a config or machine field."""
    cases = st.integers(0, len(BENCH["cases"]) - 1).flatmap(lambda i: st.one_of(
        st.sampled_from(sorted(BENCH["cases"][i])).map(lambda k: ("cases", i, k)),
        st.sampled_from(sorted(BENCH["cases"][i]["detail"])).map(lambda k: ("cases", i, "detail", k))))
    other = st.sampled_from([("machine", "cpus"), ("machine", "dirs"), ("config", "layouts"), ("config", "job_bytes"),
                             ("config", "io_threads"), ("config", "io_unit_bytes"), ("config", "layouts", "llama"),
                             ("config", "layouts", "llama", "block_bytes"), ("cases",), ("machine",), ("config",)])
    return st.one_of(cases, other)


@RUNS
@given(field=bench_fields(), value=json_values, drop=st.booleans())
def test_bench_fields(tmp_path, field, value, drop):
    doc = json.loads(json.dumps(BENCH))
    parent = doc
    for key in field[:-1]:
        parent = parent[key]
    if drop:
        del parent[field[-1]]
    else:
        parent[field[-1]] = value
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc, indent=1))
    bench = read_json(str(path))
    try:
        check_bench(bench, str(path))
    except BenchError as e:
        one_line_at(e, path)
        return
    # Accepted: what calibration reads from it next must not fail on a type or a missing key.
    try:
        ceilings(bench, "x", str(path))
        assert bench_cases(bench)
    except BenchError as e:  # a case calibration needs is gone: said in one line
        assert "\n" not in str(e) and "the bench has no" in str(e), str(e)
    except ValueError as e:  # a figure the fitted profile cannot hold (a rate of 0): one line naming it
        assert "\n" not in str(e) and "profile 'x'" in str(e), str(e)


def test_a_bench_with_malformed_cases_names_the_case_and_line(tmp_path):
    """Issue 23: a case without its detail gave a KeyError from calibrate."""
    doc = json.loads(json.dumps(BENCH))
    del doc["cases"][3]["detail"]
    text = json.dumps(doc, indent=1)
    path = tmp_path / "bench.json"
    path.write_text(text)
    lines = text.splitlines()
    case_lines = [i + 1 for i in range(lines.index(' "cases": ['), len(lines)) if lines[i] == "  {"]
    with pytest.raises(BenchError, match=rf"^{path}:{case_lines[3]}: a case must be an object with"):
        check_bench(read_json(str(path)), str(path))
