"""`python -m kvoffload`: it checks the directory the backend will really use (--dir D puts
the slot file in D itself, with the backend's refusals), and every user mistake is one
line naming it, exit code 2, no traceback (class 12 of issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from faults import assert_dir_clean, symlinked_parent, world_writable_dir
from kvoffload.__main__ import main

pytestmark = pytest.mark.faults

SMALL = ["--mib", "4", "--tensors", "4", "--tensor-kib", "64"]


def one_line_error(capsys, argv: list[str], *names: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, f"exit code {rc} for {argv}: {err}"
    assert out == "" and err.count("\n") == 1 and err.startswith("python -m kvoffload: error: "), err
    for name in names:
        assert name in err, f"{name!r} not named in {err!r}"
    return err


def test_a_good_directory_holds_the_slot_file_itself(capsys, cache_dir):
    assert main(["--dir", str(cache_dir), *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"round trip in {cache_dir}:" in out and "bytes verified: True" in out
    assert_dir_clean(cache_dir)  # no private subdirectory, no file left


def test_missing_directory(capsys, tmp_path):
    one_line_error(capsys, ["--dir", str(tmp_path / "nope"), *SMALL], "--dir", "no such directory")


def test_file_as_directory(capsys, tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    one_line_error(capsys, ["--dir", str(tmp_path / "f"), *SMALL], "--dir", "not a directory")


def test_symlinked_directory_is_refused_as_the_backend_does(capsys, tmp_path):
    real, link = symlinked_parent(tmp_path)
    one_line_error(capsys, ["--dir", str(link), *SMALL], str(link), "is a symlink")
    assert_dir_clean(real)


def test_world_writable_directory_is_refused_as_the_backend_does(capsys, tmp_path):
    d = world_writable_dir(tmp_path / "open")
    one_line_error(capsys, ["--dir", str(d), *SMALL], str(d), "world-writable")
    assert_dir_clean(d)


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory nobody can create files in: a read-only tmpfs as root (root ignores
    permission bits), mode 0500 otherwise."""
    d = tmp_path / "ro"
    d.mkdir(mode=0o700)
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_unwritable_directory(capsys, unwritable_dir):
    err = one_line_error(capsys, ["--dir", str(unwritable_dir), *SMALL], str(unwritable_dir))
    assert "Read-only file system" in err or "Permission denied" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(capsys, cache_dir):
    one_line_error(capsys, ["--dir", str(cache_dir), "--device", "cuda", *SMALL], "--device cuda", "not available")


@pytest.mark.parametrize("argv,names", [
    (["--tensors", "0"], ["--tensors", "got '0'"]),
    (["--mib", "0"], ["--mib", "got '0'"]),
    (["--tensor-kib", "-1"], ["--tensor-kib", "got '-1'"]),
    (["--mib", "two"], ["--mib", "expected an integer >= 1, got 'two'"]),
    (["--mib", "1", "--tensors", "64", "--tensor-kib", "32"], ["--mib 1", "no whole block of 2048 KiB"]),
    (["--device", "tpu9"], ["--device 'tpu9'"]),
    (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
], ids=["tensors-0", "mib-0", "tensor-kib-negative", "mib-not-int", "mib-below-a-block", "bad-device", "unknown-flag"])
def test_bad_numbers_and_flags(capsys, cache_dir, argv, names):
    one_line_error(capsys, ["--dir", str(cache_dir), *argv], *names)
    assert_dir_clean(cache_dir)


def test_more_than_the_disk_holds_is_one_line_before_anything_is_allocated(capsys, cache_dir):
    """Issue 23: --mib 100000000 (95 TiB) was an allocator traceback."""
    err = one_line_error(capsys, ["--dir", str(cache_dir), "--mib", "100000000"], "not enough")
    assert "need" in err
    assert_dir_clean(cache_dir)


def test_the_process_prints_one_line_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvoffload", "--dir", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"python -m kvoffload: error: argument --dir: {tmp_path / 'missing'}: no such directory\n"
