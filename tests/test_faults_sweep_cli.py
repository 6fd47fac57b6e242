"""``python -m faults sweep``: one JSON object with --json, a table by call site without,
and every broken invariant counted (a backend that serves wrong bytes shows up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from faults.__main__ import main
from faults._invariants import KINDS
from kvoffload.slot_seal import AesGcmSeal

pytestmark = pytest.mark.faults

KEYS = ["points", "survived", "hangs", "lost_completions", "wrong_data", "leaked_files", "leaked_fds", "seconds"]
REDUCED = ["--calls", "fstat,close,preadv", "--file-modes", "anonymous,named", "--io", "direct", "--kinds", "transient"]


def test_json_is_one_object_with_every_point_survived(tmp_path):
    r = subprocess.run([sys.executable, "-m", "faults", "sweep", "--json", "--dir", str(tmp_path), *REDUCED],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)  # the whole of stdout is one object
    assert list(out) == KEYS
    assert out["points"] > 100 and out["survived"] == out["points"]
    assert all(out[k] == 0 for k in KINDS)
    assert list(tmp_path.iterdir()) == []  # the sweep's directory is gone


def test_table_by_call_site(tmp_path):
    r = subprocess.run([sys.executable, "-m", "faults", "sweep", "--dir", str(tmp_path), *REDUCED],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["call", "site", "points", "survived", *KINDS]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert set(rows) == {"fstat", "close", "preadv", "total"}
    assert rows["total"][0] == rows["total"][1] == str(sum(int(rows[c][0]) for c in ("fstat", "close", "preadv")))
    assert lines[-1].endswith(" s") and "fault points in" in lines[-1]


def test_a_backend_that_serves_wrong_bytes_is_counted(tmp_path, monkeypatch, capsys):
    """The counters can fail: a seal that corrupts what it opens and says it is fine."""
    real_open = AesGcmSeal.open

    def lying_open(self, slot, row, payload_bytes, record, dst=None):
        ok = real_open(self, slot, row, payload_bytes, record, dst)
        row[0] ^= 0xFF
        return ok

    monkeypatch.setattr(AesGcmSeal, "open", lying_open)
    monkeypatch.setenv("KVOFFLOAD_NATIVE_IO", "off")  # the lie is in the Python path's seal
    rc = main(["sweep", "--json", "--dir", str(tmp_path), "--calls", "fstat", "--file-modes", "anonymous",
               "--io", "direct", "--kinds", "transient"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert out["points"] >= 1 and out["survived"] == 0 and out["wrong_data"] == out["points"]


def test_usage_errors_name_the_choice(capsys):
    assert main(["sweep", "--calls", "pwritev,nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown 'nonsense'" in err and "expected a comma list of open, fchmod" in err


def test_a_missing_dir_is_a_usage_error_not_a_broken_point(capsys, tmp_path):
    """Issue 23: it was a traceback and exit code 1, which means a fault point broke."""
    assert main(["sweep", "--json", "--dir", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"python -m faults: error: argument --dir: {tmp_path / 'missing'}: no such directory\n")
