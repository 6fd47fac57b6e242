"""Attacks on the file path (symlinks, TOCTOU, parent, open directory), the file mode,
and kill -9: nothing outside the slot file is written, no KV byte is left under a name."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from faults import (
    FaultyOsCalls,
    KvChecker,
    SymlinkRace,
    Victim,
    assert_dir_clean,
    assert_mode_0600,
    make_caches,
    plant_symlink,
    symlinked_parent,
    wait_threads_gone,
    world_writable_dir,
)
from kvoffload import DiskBackend
from kvoffload.slot_file import SlotFileError

pytestmark = pytest.mark.faults
NAMED = pytest.mark.parametrize("named", [False, True], ids=["anonymous", "named"])


def start(d, named, osc=None, **kw):
    caches = make_caches("cpu", 4, [4096], seed=5)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, str(d / "kv.bin"), 8, 4096, named_file=named, io_threads=1,
           os_calls=osc, **kw, report_load_errors=True)
    return b, caches


def use(b, caches):
    """Store and load every slot, so any misdirected write would hit the victim."""
    ck = KvChecker(b, caches, None, 8)
    ck.attach()
    ck.store([0, 1, 2, 3], [0, 1, 2, 3])
    ck.store([0, 1, 2, 3], [4, 5, 6, 7])
    ck.load(list(range(4)), list(range(4)))
    ck.drain()
    assert ck.stats["store_fail"] == ck.stats["load_fail"] == 0


@NAMED
@pytest.mark.parametrize("live", [True, False], ids=["live", "dangling"])
def test_symlink_planted_at_the_path(fd_guard, tmp_path, cache_dir, named, live):
    victim = Victim.create(tmp_path / "victim") if live else None
    target = tmp_path / ("victim" if live else "nowhere")
    plant_symlink(cache_dir / "kv.bin", target)
    b, caches = start(cache_dir, named)
    try:
        assert os.fstat(b.files[0].fd).st_ino != os.stat(tmp_path).st_ino
        if live:
            assert os.fstat(b.files[0].fd).st_ino != victim.ino
        use(b, caches)
    finally:
        b.shutdown()
    if live:
        victim.assert_untouched()
    else:
        assert not os.path.lexists(target), "the dangling link's target was created"
    if named:
        assert_dir_clean(cache_dir)  # the link was unlinked (unlink never follows), not followed
    else:
        assert os.readlink(cache_dir / "kv.bin") == str(target)  # anonymous: the name is never touched


@NAMED
def test_hard_link_planted_at_the_path(fd_guard, tmp_path, cache_dir, named):
    victim = Victim.create(tmp_path / "victim")
    os.link(tmp_path / "victim", cache_dir / "kv.bin")
    victim = Victim.snapshot(tmp_path / "victim")
    b, caches = start(cache_dir, named)
    try:
        use(b, caches)
    finally:
        b.shutdown()
    assert Victim.snapshot(tmp_path / "victim").digest == victim.digest


@NAMED
def test_symlinked_parent_is_refused(fd_guard, tmp_path, named):
    real, link = symlinked_parent(tmp_path)
    with pytest.raises(SlotFileError, match=r"is a symlink; give its real path"):
        start(link, named)
    assert_dir_clean(real)
    wait_threads_gone()


@NAMED
@pytest.mark.parametrize("sticky", [False, True], ids=["no-sticky", "sticky"])
def test_world_writable_directory(fd_guard, tmp_path, named, sticky):
    d = world_writable_dir(tmp_path / "open", sticky=sticky)
    if not sticky:
        with pytest.raises(SlotFileError, match="world-writable without the sticky bit"):
            start(d, named)
    else:
        b, caches = start(d, named)
        use(b, caches)
        b.shutdown()
    assert_dir_clean(d)


@NAMED
def test_symlink_raced_in_right_after_the_stale_unlink(fd_guard, tmp_path, cache_dir, named):
    """TOCTOU made deterministic: the hook plants the link right after our unlink of the
    stale name. The slot file is created under a fresh random name, so the link is
    never opened; it stays, the attacker's own."""
    victim = Victim.create(tmp_path / "victim")
    osc = FaultyOsCalls()
    race = SymlinkRace(osc, cache_dir / "kv.bin", tmp_path / "victim", times=1)
    b, caches = start(cache_dir, named, osc)
    try:
        use(b, caches)
    finally:
        b.shutdown()
    victim.assert_untouched()
    if named:
        assert race.planted == 1 and osc.calls["unlink"] == 2  # the stale name, then our own
        assert_dir_clean(cache_dir, allow=["kv.bin"])
        assert os.path.islink(cache_dir / "kv.bin")
    else:
        assert race.planted == 0 and osc.calls["unlink"] == 0  # no name, no window


@NAMED
def test_symlink_planted_at_every_name_we_try_gives_up_cleanly(fd_guard, tmp_path, cache_dir, named):
    victim = Victim.create(tmp_path / "victim")
    osc = FaultyOsCalls()
    planted = []

    def plant(info):
        name = info.args[0]
        if info.kwargs.get("dir_fd") is not None and name.startswith(".kv.bin."):
            os.symlink(tmp_path / "victim", cache_dir / name)
            planted.append(name)

    osc.before("open", plant)
    if named:
        with pytest.raises(SlotFileError, match="could not create a fresh slot file .* in 3 attempts"):
            start(cache_dir, named, osc)
        assert len(planted) == 3
        assert_dir_clean(cache_dir, allow=planted)  # only the attacker's links
    else:
        b, caches = start(cache_dir, named, osc)
        use(b, caches)
        b.shutdown()
        assert planted == []
    victim.assert_untouched()
    wait_threads_gone()


@NAMED
def test_concurrent_inits_on_one_path_all_succeed(fd_guard, cache_dir, named):
    """Two backends starting on one path at once never remove each other's file."""
    import threading

    errors, backends = [], []

    def one():
        try:
            backends.append(start(cache_dir, named)[0])
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    for _ in range(10):
        ts = [threading.Thread(target=one) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        while backends:
            backends.pop().shutdown()
    assert errors == []
    assert_dir_clean(cache_dir)


# Each process starts its inits when the go file appears, so they overlap.
_INIT_LOOP = """
import os, sys, time
from kvoffload import DiskBackend
from kvoffload.device import random_caches
d, named, rounds, go = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4]
caches = random_caches("cpu", 2, [4096])
while not os.path.exists(go):
    time.sleep(0.001)
failed = 0
for _ in range(rounds):
    b = DiskBackend()
    try:
        b.init(caches, "cpu", None, None, os.path.join(d, "kv.bin"), 4, 4096, named_file=named, io_threads=1,
               report_load_errors=True)
    except OSError as e:
        failed += 1
        print(f"init failed: {e}", file=sys.stderr)
    b.shutdown()
print(failed)
"""


@NAMED
def test_concurrent_inits_in_processes_all_succeed(cache_dir, tmp_path, named):
    """Inits from several processes on one path (class 11: a few percent failed with
    "cannot secure ...: No such file or directory" when one removed the other's file)."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _INIT_LOOP, str(cache_dir), str(int(named)), "30", str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(0.5)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    failures = sum(int(out) for out, _ in results)
    assert failures == 0, "".join(err for _, err in results)[-3000:]
    assert_dir_clean(cache_dir)


@NAMED
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o277, 0o000])
def test_file_mode_is_0600(fd_guard, cache_dir, named, umask):
    old = os.umask(umask)
    try:
        b, caches = start(cache_dir, named)
    finally:
        os.umask(old)
    try:
        assert_mode_0600(b.files[0].fd)
        assert os.fstat(b.files[0].fd).st_nlink == 0
        use(b, caches)
    finally:
        b.shutdown()


# -- kill -9 -------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    from faults import Fault, FaultyOsCalls, make_caches
    from kvoffload import DiskBackend

    d, named, stage = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    osc = FaultyOsCalls()
    if stage == "store":
        osc.fail_from("pwritev", 1, Fault.delay(0.02))  # keep stores in flight
    else:  # stop in the named file's window: created, not yet unlinked
        def wait_here(info):
            if info.n == 2:
                print("window", flush=True)
                time.sleep(60)
        osc.before("unlink", wait_here)
    caches = make_caches("cpu", 8, [4096], seed=9)
    b = DiskBackend()
    b.init(caches, "cpu", None, None, d + "/kv.bin", 64, 4096, named_file=named, io_threads=2, os_calls=osc, report_load_errors=True)
    ev = []
    for i in range(2000):
        b.launch_copy([i % 8], [i % 64], True, i, ev)
    print("storing", b.files[0].fd, flush=True)
    time.sleep(60)
    """
)


def _spawn(d, named, stage):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(d), "1" if named else "0", stage],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@NAMED
def test_kill_9_mid_store_leaves_nothing(cache_dir, named):
    p = _spawn(cache_dir, named, "store")
    try:
        line = p.stdout.readline().split()
        assert line and line[0] == "storing", p.stderr.read()
        fd = int(line[1])
        time.sleep(0.2)  # stores are being written
        assert os.readlink(f"/proc/{p.pid}/fd/{fd}").endswith("(deleted)")
        assert os.listdir(cache_dir) == [], "KV data sits under a name while the process runs"
        p.send_signal(signal.SIGKILL)
        assert p.wait(10) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert os.listdir(cache_dir) == [], "kill -9 left a file behind"


def test_kill_9_in_the_named_window_leaves_an_empty_file_that_next_init_removes(cache_dir):
    p = _spawn(cache_dir, True, "window")
    try:
        assert p.stdout.readline().strip() == "window", p.stderr.read()
        [left] = os.listdir(cache_dir)
        assert left.startswith(".kv.bin.kvoffload-")
        st = os.lstat(cache_dir / left)
        # The name exists for a moment, but before any KV byte: empty, private.
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o600
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert os.path.getsize(cache_dir / left) == 0
    b, caches = start(cache_dir, True)  # the stale file is removed at the next start
    try:
        assert_dir_clean(cache_dir)
        use(b, caches)
    finally:
        b.shutdown()
    assert_dir_clean(cache_dir)


@pytest.mark.parametrize("name", [".kv.bin.kvoffload-0123456789abcdef", "kv.bin"], ids=["our-prefix", "disk-path"])
def test_a_stale_name_that_holds_data_is_left_alone(fd_guard, cache_dir, caplog, name):
    """Issue 23: the named start-up deleted a non-empty .kv.bin.kvoffload-<hex> file. Only
    empty leftovers (what a killed kvoffload start leaves) are removed; one with bytes is
    someone's data: it stays byte for byte, a warning names it, and the backend starts
    under its own random name anyway."""
    data = os.urandom(10_000)
    (cache_dir / name).write_bytes(data)
    (cache_dir / ".kv.bin.kvoffload-fedcba9876543210").write_bytes(b"")  # a killed start's: removed
    b, caches = start(cache_dir, True)
    try:
        use(b, caches)
    finally:
        b.shutdown()
    assert os.listdir(cache_dir) == [name] and (cache_dir / name).read_bytes() == data
    assert any(str(cache_dir / name) in r.getMessage() and "10000 bytes" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")


def test_a_stale_name_that_cannot_be_examined_is_left_alone(fd_guard, cache_dir):
    (cache_dir / ".kv.bin.kvoffload-0123456789abcdef").write_bytes(b"")
    osc = FaultyOsCalls().fail_from("lstat", 1)
    b, caches = start(cache_dir, True, osc)
    b.shutdown()
    assert os.listdir(cache_dir) == [".kv.bin.kvoffload-0123456789abcdef"]
    assert osc.calls["unlink"] == 1  # our own name only


@NAMED
@pytest.mark.parametrize("how", ["trailing-slash", "existing-directory", "dot"])
def test_disk_path_naming_a_directory_is_refused(fd_guard, tmp_path, cache_dir, named, how):
    """Class 6 of issue 13: '/mnt/nvme/' put the anonymous file in /mnt (the parent), and
    named mode failed with a misleading message."""
    path = {"trailing-slash": f"{cache_dir}/", "existing-directory": str(cache_dir),
            "dot": f"{cache_dir}/."}[how]
    before = sorted(os.listdir(tmp_path))
    b = DiskBackend()
    with pytest.raises(ValueError, match=r"names a directory; give a file path inside it"):
        b.init(make_caches("cpu", 2, [4096]), "cpu", None, None, path, 4, 4096, named_file=named,
               report_load_errors=True)
    assert b.closing
    assert sorted(os.listdir(tmp_path)) == before
    assert_dir_clean(cache_dir)
    wait_threads_gone()


class CreatesThenRefusesDirect(FaultyOsCalls):
    """A file system without O_DIRECT that creates the file, then fails the open with
    EINVAL (O_TMPFILE fails the same way, without a file)."""

    def open(self, path, flags, mode=0o600, *, dir_fd=None):
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:
                os.close(os.open(path, (flags & ~os.O_DIRECT) | os.O_RDWR, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().open(path, flags, mode, dir_fd=dir_fd)


@NAMED
def test_failed_start_without_o_direct_leaves_no_file(fd_guard, cache_dir, named):
    """Class 12 of issue 13: on a file system without O_DIRECT a failed start left an
    empty file at disk_path."""
    with pytest.raises(SlotFileError, match="does not support O_DIRECT; set use_page_cache=True"):
        start(cache_dir, named, CreatesThenRefusesDirect())
    assert_dir_clean(cache_dir)
    wait_threads_gone()
    b, caches = start(cache_dir, named, CreatesThenRefusesDirect(), use_page_cache=True)  # what the error says
    try:
        use(b, caches)
    finally:
        b.shutdown()
    assert_dir_clean(cache_dir)
