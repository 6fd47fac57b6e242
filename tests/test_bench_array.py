"""`python -m kvoffload.bench --make-array N`: RAM-backed drives built, used and always torn down.

The build tests need root, loop devices, losetup and mkfs.ext4 (skipped with the reason
otherwise); the refusals are checked everywhere.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvoffload.bench import ram_array
from kvoffload.bench import suite as bench
from kvoffload.bench.ram_array import ArrayError, RamArray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _why_no_array() -> str:
    if os.geteuid() != 0:
        return "needs root (losetup, mkfs, mount)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop device support (/dev/loop-control)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    st = os.statvfs(ram_array.SHM_DIR)
    if st.f_bavail * st.f_frsize < 2**30:
        return f"{ram_array.SHM_DIR} has less than 1 GiB free"
    return ""


needs_array = pytest.mark.skipif(bool(_why_no_array()), reason=_why_no_array() or "-")


def leftovers(made: list[dict], pid: int) -> list[str]:
    """Anything of an array still there: images, loop devices over them, mounts, mount points."""
    out = glob.glob(os.path.join(ram_array.SHM_DIR, f"{ram_array.IMAGE_PREFIX}{pid}-*"))
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    out += [line for line in loops.splitlines() if f"{ram_array.IMAGE_PREFIX}{pid}-" in line]
    with open("/proc/mounts") as fh:
        mounts = fh.read()
    for d in made:
        out += [d["mountpoint"]] if os.path.exists(d["mountpoint"]) or f" {d['mountpoint']} " in mounts else []
        out += [os.path.dirname(d["mountpoint"])] if os.path.exists(os.path.dirname(d["mountpoint"])) else []
    return out


@needs_array
def test_make_array_runs_one_drive_and_all_striped_then_tears_down(capsys):
    rc = bench.main(["--quick", "--json", "--device", "cpu", "--make-array", "2", "--array-gib", "0.25",
                     "--layouts", "llama", "--modes", "direct", "--seals", "aes-gcm", "--only", "disk,stripe"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"], out
    made = out["array"]["made"]
    assert out["array"]["teardown"] == "ok" and len(made) == 2
    assert [d["path"] for d in out["machine"]["dirs"]] == [d["mountpoint"] for d in made]
    assert {d["fs"] for d in out["machine"]["dirs"]} == {"ext4"}  # read from /proc/mounts while mounted
    rows = {r["case"]: r for r in out["cases"]}
    assert rows["llama direct aes-gcm cold-load"]["verified"] is True  # one drive alone
    assert rows["llama stripe 2 dirs aes-gcm cold-load"]["verified"] is True  # both striped
    assert rows["llama raw direct-read 2 dirs"]["detail"]["files"] == 2
    assert leftovers(made, os.getpid()) == []


@needs_array
def test_array_is_torn_down_after_an_error_inside():
    with pytest.raises(RuntimeError, match="boom"):
        with RamArray(1, 0.0625) as a:
            made = list(a.made)
            path = os.path.join(a.mountpoints[0], "x")
            with open(path, "wb") as fh:  # a file on the drive does not keep it
                fh.write(b"kv")
            raise RuntimeError("boom")
    assert a.teardown_errors == [] and leftovers(made, os.getpid()) == []


@needs_array
@pytest.mark.parametrize("cut", ["mkfs", "losetup", "mount"])
def test_ctrl_c_in_the_middle_of_building_undoes_what_was_built(monkeypatch, cut):
    """Ctrl-C on the second drive: during its mkfs, or right after its losetup or mount took
    effect but before the array recorded it. Teardown still finds and undoes everything."""
    real = ram_array._run
    calls: list[str] = []

    def run(cmd):
        calls.append(cmd[0])
        if cmd[0].startswith("mkfs") and cut == "mkfs" and calls.count(cmd[0]) == 2:
            raise KeyboardInterrupt
        out = real(cmd)
        if cmd[0] == cut and calls.count(cut) == 2:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(ram_array, "_run", run)
    a = RamArray(2, 0.0625)
    with pytest.raises(KeyboardInterrupt):
        with a:
            pass
    assert a.teardown_errors == [] and a.root is None
    attached = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert not any(f"{ram_array.IMAGE_PREFIX}{os.getpid()}-" in line for line in attached.splitlines())
    assert leftovers(a.made, os.getpid()) == []


def sigterm_bench(wait_for: str, *args: str) -> tuple[int, str, str]:
    """Run the bench on a 1-drive array, SIGTERM it once ``wait_for`` shows in its progress."""
    cmd = [sys.executable, "-m", "kvoffload.bench", "--make-array", "1", "--array-gib", "0.25", "--device", "cpu",
           "--layouts", "llama", "--modes", "direct", "--seals", "xxh3", "--only", "disk", "--gib", "0.0625", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    seen = ""
    try:
        deadline = time.monotonic() + 120
        while wait_for not in seen and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            seen += line
        assert wait_for in seen, seen
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    seen += err
    assert p.returncode == 130, seen  # not -6: no thread was left in torch code at exit
    assert "interrupted (signal 15)" in seen and "drives were removed" in seen
    mounts = re.findall(r"drive\(s\) of 0.25 GiB at (\S+)", seen)
    assert mounts, seen
    assert leftovers([{"mountpoint": mounts[0]}], p.pid) == []
    return p.returncode, out, seen


@needs_array
def test_sigterm_while_the_drive_is_filled_tears_the_array_down():
    sigterm_bench("raw scratch file", "--case-seconds", "120")


@needs_array
def test_sigterm_in_a_case_still_prints_the_cases_measured():
    _, out, _ = sigterm_bench("llama raw direct-write", "--json", "--case-seconds", "1", "--raw-seconds", "0.05")
    got = json.loads(out)
    assert got["interrupted"] == "signal 15" and got["ok"] is False
    assert got["cases"][0]["case"] == "llama raw direct-write" and got["array"]["teardown"] == "ok"


def test_refused_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ArrayError, match="needs root"):
        ram_array.preflight(2, 1.0, "ext4", 0)


def test_refused_without_mkfs(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "mkfs.xfs" else f"/usr/sbin/{tool}")
    assert bench.main(["--device", "cpu", "--make-array", "1", "--fs", "xfs", "--array-gib", "1"]) == 2
    assert capsys.readouterr().err == ("python -m kvoffload.bench: error: --make-array: mkfs.xfs not found on PATH "
                                       "(install xfsprogs, or use --fs ext4)\n")


def test_refused_when_shm_lacks_room(tmp_path):
    stale = tmp_path / f"{ram_array.IMAGE_PREFIX}999999999-d0.img"  # no such process
    stale.write_bytes(b"")
    with pytest.raises(ArrayError) as e:
        ram_array.check_room(10**6, 14, 0, shm_dir=str(tmp_path))
    msg = str(e.value)
    assert f"{tmp_path} has" in msg and "GiB free" in msg and str(stale) in msg


def test_refused_when_memory_for_the_cases_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(ram_array, "mem_available", lambda: 3 * 2**30)
    with pytest.raises(ArrayError, match=r"plus 3\.0 GiB for the cases exceed the 3\.0 GiB of memory"):
        ram_array.check_room(1, 1 / 1024, 3 * 2**30, shm_dir=str(tmp_path))


def test_sizing_fits_the_largest_case():
    from kvoffload.bench.sizing import GiB, MiB, disk_needs, largest_fit, misfit

    # Issue 14's failure: --gib 8 on four 14 GiB drives (2 MiB blocks).
    needs = disk_needs(8 * GiB, [2 * MiB], 4, 16384)
    assert needs[0] > 16 * GiB and needs[1:] == [needs[1]] * 3 and needs[1] < 3 * GiB
    dirs, have = ["/mnt/d0", "/mnt/d1"], [14 * GiB, 14 * GiB]
    assert "on /mnt/d0 but it has 14.00 GiB free" in misfit(8 * GiB, [2 * MiB], dirs, have, 16384)
    best = largest_fit([2 * MiB], dirs, have, 16384, 64 * GiB)
    assert misfit(best, [2 * MiB], dirs, have, 16384) is None
    assert misfit(best + MiB, [2 * MiB], dirs, have, 16384) is not None
