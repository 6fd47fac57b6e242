"""Generated arguments (Hypothesis): every call is refused with one clear error that
leaves nothing behind, or it moves exactly the right bytes.

``launch_copy`` gets block ids of every type (ints, numpy and torch scalars and arrays
of any dtype and shape, one-element arrays, floats, bools, strings, None, sets, nested
lists, out of range, negative, huge), odd ``is_store``, ``event_idx`` and
``events_list``. ``init`` gets cache layouts that are views, transposes, partial
tensors (the K half of a KV tensor), strided or overlapping caches. What a caller
means by each argument is worked out here (``meaning``), independently of the
backend, and the backend must agree.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from faults import kvoffload_threads, wait_threads_gone
from kvoffload import DiskBackend
from kvoffload.device import BlockLayout

pytestmark = pytest.mark.faults

NUM_BLOCKS, NUM_SLOTS, BLOCK = 6, 8, 4096
ARGUMENT_WORDS = ("src_blocks", "dst_blocks", "is_store", "event_idx", "events_list", "slot", "device block")


# -- what a caller means --------------------------------------------------------


def scalar_id(x: Any) -> Optional[int]:
    """x as one block id, or None if it is not an integer (a bool, float, string, array...)."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point \
            and not x.dtype.is_complex and x.dtype != torch.bool:
        return int(x)
    return None


def meaning(ids: Any) -> Optional[list[int]]:
    """The ordered ids a caller means, or None when ``ids`` is not an ordered sequence of
    integers (a set or dict has no order to pair sources with destinations)."""
    if isinstance(ids, (np.ndarray, torch.Tensor)):
        if ids.ndim != 1:
            return None
        items = list(ids)  # 0-d elements, each judged like a scalar
    elif isinstance(ids, (list, tuple, range)):
        items = list(ids)
    else:
        return None
    out = [scalar_id(x) for x in items]
    return None if any(v is None for v in out) else out


def expected(src, dst, is_store, event_idx, events_list) -> Optional[tuple[list[int], list[int]]]:
    """(device blocks, slots) of the job a valid call asks for; None if it must be refused."""
    if not isinstance(is_store, bool) or isinstance(event_idx, (bool, np.bool_)):
        return None
    if not isinstance(event_idx, (int, np.integer)) or not hasattr(events_list, "append"):
        return None
    s, d = meaning(src), meaning(dst)
    if s is None or d is None or len(s) != len(d) or len(set(d)) != len(d):
        return None
    blocks, slots = (s, d) if is_store else (d, s)
    if not all(0 <= b < NUM_BLOCKS for b in blocks) or not all(0 <= x < NUM_SLOTS for x in slots):
        return None
    return blocks, slots


# -- strategies -------------------------------------------------------------------

INT_DTYPES_NP = [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64]
INT_DTYPES_TORCH = [torch.int64, torch.int32, torch.int16, torch.uint8]


def containers(ids: list[int]) -> st.SearchStrategy:
    """The same ids in every container a caller might use."""
    opts = [
        st.just(list(ids)),
        st.just(tuple(ids)),
        st.sampled_from(INT_DTYPES_NP).map(lambda dt: np.array(ids, dtype=dt)),
        st.sampled_from(INT_DTYPES_TORCH).map(lambda dt: torch.tensor(ids, dtype=dt)),
        st.just([np.int64(i) for i in ids]),
        st.just([torch.tensor(i) for i in ids]),
    ]
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        opts.append(st.just(range(ids[0], ids[0] + len(ids))))
    return st.one_of(opts)


ODD_ELEMENTS = st.one_of(
    st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none(),
    st.integers(max_value=-1), st.integers(min_value=NUM_BLOCKS, max_value=NUM_SLOTS + 2),
    st.integers(min_value=2**62, max_value=2**80),
    st.sampled_from([np.float64(1.0), np.bool_(True), torch.tensor(1.5), torch.tensor(True),
                     torch.tensor([2]), np.array([2]), [1], (1,)]),
)

ODD_IDS = st.one_of(
    st.builds(lambda xs, i, odd: xs[:i] + [odd] + xs[i:],
              st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3), st.integers(0, 3), ODD_ELEMENTS),
    ODD_ELEMENTS,
    st.sets(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3),
    st.dictionaries(st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3).map(lambda xs: [[x] for x in xs]),
    st.sampled_from([np.array([1.0, 2.0]), np.array([True]), np.array([[0, 1]]), np.array(1), np.array([1, 2], dtype=object),
                     torch.tensor([1.0]), torch.tensor([True, False]), torch.tensor([[0], [1]]), torch.tensor(2),
                     iter([0, 1])]),
)


@st.composite
def calls(draw):
    n = draw(st.integers(0, 4))
    is_store = draw(st.booleans())
    blocks = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=not is_store))
    slots = draw(st.lists(st.integers(0, NUM_SLOTS - 1), min_size=n, max_size=n, unique=is_store))
    src, dst = (blocks, slots) if is_store else (slots, blocks)
    src = draw(st.one_of(containers(src), ODD_IDS) if draw(st.integers(0, 4)) == 0 else containers(src))
    dst = draw(st.one_of(containers(dst), ODD_IDS) if draw(st.integers(0, 4)) == 0 else containers(dst))
    odd = draw(st.integers(0, 9)) == 0
    is_store = draw(st.sampled_from([1, 0, None, "True", np.bool_(True), torch.tensor(True)])) if odd else is_store
    event_idx = draw(st.one_of(st.integers(-5, 2**70), st.sampled_from([np.int64(3)])) if draw(st.integers(0, 9))
                     else st.sampled_from([1.0, True, None, "3", np.float64(2.0), [1]]))
    events_list = draw(st.sampled_from(["list"] * 8 + ["deque", "tuple", "none", "dict"]))
    return src, dst, is_store, event_idx, events_list


def make_events(kind: str):
    return {"list": [], "deque": collections.deque(), "tuple": (), "none": None, "dict": {}}[kind]


# -- the launch_copy test ------------------------------------------------------------


class Subject:
    """One backend for every example, and a model of what each slot holds."""

    def __init__(self, directory) -> None:
        g = torch.Generator().manual_seed(3)
        self.caches = {f"layer{i}": torch.randint(-128, 128, (NUM_BLOCKS, BLOCK // 2), dtype=torch.int8, generator=g)
                       for i in range(2)}
        self.g = g
        self.b = DiskBackend()
        self.b.init(self.caches, "cpu", None, None, str(directory / "kv.bin"), NUM_SLOTS, BLOCK, io_threads=2,
                    io_unit_bytes=2 * BLOCK, report_load_errors=True)
        self.slots: dict[int, bytes] = {}

    def block(self, b: int) -> bytes:
        return b"".join(t[b].numpy().tobytes() for t in self.caches.values())

    def device(self) -> list[bytes]:
        return [self.block(b) for b in range(NUM_BLOCKS)]

    def refill(self) -> None:
        for t in self.caches.values():
            t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=self.g))


@pytest.fixture(scope="module")
def subject(tmp_path_factory):
    s = Subject(tmp_path_factory.mktemp("args"))
    yield s
    s.b.shutdown()
    wait_threads_gone()


def wait(event) -> None:
    assert event.wait(10), "job never completed"


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(call=calls())
def test_generated_launch_copy_arguments(subject, call):
    src, dst, is_store, event_idx, kind = call
    events = make_events(kind)
    want = expected(src, dst, is_store, event_idx, events)
    before = subject.device()
    run = subject.b._run
    event("refused" if want is None else f"accepted {'store' if is_store else 'load'} of {len(want[0])}")
    if want is None:
        with pytest.raises((TypeError, ValueError)) as e:
            subject.b.launch_copy(src, dst, is_store, event_idx, events)
        assert any(w in str(e.value) for w in ARGUMENT_WORDS), f"unclear refusal: {e.value!r}"
        # Nothing is left behind: no event, no job, no byte moved, no error reported.
        assert events is None or len(events) == 0
        assert not run.open_jobs
        assert subject.device() == before
        assert subject.b.get_failed_store_slots() == set() and subject.b.get_block_ids_with_load_errors() == set()
        return
    blocks, slots = want
    subject.b.launch_copy(src, dst, is_store, event_idx, events)
    assert len(events) == 1 and events[0][0] is event_idx
    ev = events[0][1]
    wait(ev)
    if is_store:
        assert ev.ok and subject.b.get_failed_store_slots() == set()
        for b, s in zip(blocks, slots):
            subject.slots[s] = before[b]
        # Read each back into fresh device bytes: the store moved exactly these blocks.
        subject.refill()
        for b, s in zip(blocks, slots):
            back: list = []
            subject.b.launch_copy([s], [b], False, 0, back)
            wait(back[0][1])
            assert back[0][1].ok and subject.block(b) == subject.slots[s], f"slot {s} does not hold block {b}"
        return
    errors = subject.b.get_block_ids_with_load_errors()
    after = subject.device()
    for b, s in zip(blocks, slots):
        if s in subject.slots:
            assert after[b] == subject.slots[s], f"load of slot {s} put wrong bytes in block {b}"
        else:
            assert b in errors and after[b] == before[b], f"never-stored slot {s} served into block {b}"
    assert ev.ok == all(s in subject.slots for s in slots)
    untouched = set(range(NUM_BLOCKS)) - set(blocks)
    assert all(after[b] == before[b] for b in untouched), "a load wrote a block outside its job"


@pytest.mark.parametrize("array", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_one_element_arrays_of_id_0_move_their_block(subject, array):
    """Class 3 of issue 13: ``if not src_blocks`` took ``array([0])`` (falsy) for an empty
    job: the store wrote nothing, the load reported ok and the block kept its old bytes."""
    want = subject.block(0)
    ev: list = []
    subject.b.launch_copy(array([0]), array([0]), True, 0, ev)
    wait(ev[0][1])
    subject.slots[0] = want
    subject.refill()
    subject.b.launch_copy(array([0]), array([0]), False, 1, ev)
    wait(ev[1][1])
    assert ev[1][1].ok and subject.block(0) == want


# -- layouts -------------------------------------------------------------------------

LAYOUTS = ["whole", "view_with_offset", "first_of_two_outer", "k_half", "transposed", "expanded",
           "every_other_block", "same_tensor_twice", "overlapping_views", "not_a_tensor", "zero_dim"]
# Layouts whose blocks are dense, separate spans of bytes: the only ones that can be moved safely.
VALID_LAYOUTS = {"whole", "view_with_offset", "first_of_two_outer"}


def build_layout(kind: str, n: int, width: int, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """(caches, the storage under them): the storage is compared whole afterwards."""
    if kind == "whole":
        t = torch.zeros(n, width, dtype=dtype)
        return {"a": t}, t
    if kind == "view_with_offset":  # a contiguous slice in the middle of a bigger buffer
        base = torch.zeros(n + 2, width, dtype=dtype)
        return {"a": base[1 : n + 1]}, base
    if kind == "first_of_two_outer":  # [2, n, w]: K = kv[0] is contiguous, V must stay untouched
        kv = torch.zeros(2, n, width, dtype=dtype)
        return {"k": kv[0]}, kv
    if kind == "k_half":  # [n, 2, w]: K = kv[:, 0] interleaves with V
        kv = torch.zeros(n, 2, width, dtype=dtype)
        return {"k": kv[:, 0]}, kv
    if kind == "transposed":
        t = torch.zeros(width, n, dtype=dtype)
        return {"a": t.t()}, t
    if kind == "expanded":
        t = torch.zeros(width, dtype=dtype)
        return {"a": t.expand(n, width)}, t
    if kind == "every_other_block":
        t = torch.zeros(2 * n, width, dtype=dtype)
        return {"a": t[::2]}, t
    if kind == "same_tensor_twice":
        t = torch.zeros(n, width, dtype=dtype)
        return {"a": t, "b": t}, t
    if kind == "overlapping_views":  # b starts half a block into a
        base = torch.zeros(n + 1, width, dtype=dtype).view(-1)
        half = width // 2
        return {"a": base[: n * width].view(n, width), "b": base[half : half + n * width].view(n, width)}, base
    if kind == "not_a_tensor":
        return {"a": [[0] * width] * n}, torch.zeros(1)
    if kind == "zero_dim":
        t = torch.zeros((), dtype=dtype)
        return {"a": t}, t
    raise AssertionError(kind)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(LAYOUTS), n=st.integers(2, 5), width=st.sampled_from([16, 100, 2048]),
       dtype=st.sampled_from([torch.int8, torch.float16, torch.float32]), data=st.data())
def test_generated_layouts(tmp_path, kind, n, width, dtype, data):
    caches, storage = build_layout(kind, n, width, dtype)
    # What the caller believes a block holds: `width` elements of each cache.
    block_bytes = len(caches) * width * torch.empty(0, dtype=dtype).element_size()
    threads = set(kvoffload_threads())
    b = DiskBackend()
    try:
        if kind not in VALID_LAYOUTS:
            with pytest.raises((TypeError, ValueError)) as e:
                b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 4, block_bytes, io_threads=1,
                       use_page_cache=True, report_load_errors=True)
            assert "cache" in str(e.value), f"unclear refusal: {e.value!r}"
            assert b.closing and not list(tmp_path.iterdir()) and set(kvoffload_threads()) <= threads
            return
        b.init(caches, "cpu", None, None, str(tmp_path / "kv.bin"), 4, block_bytes, io_threads=1,
               use_page_cache=True, report_load_errors=True)
        # Random bytes everywhere in the storage, then: store block i, wipe it, load it back.
        flat = storage.view(-1).view(torch.int8)
        flat.copy_(torch.randint(-128, 128, flat.shape, dtype=torch.int8))
        before = flat.clone()
        i = data.draw(st.integers(0, n - 1))
        ev: list = []
        b.launch_copy([i], [3], True, 0, ev)
        wait(ev[0][1])
        for t in caches.values():
            t[i].view(torch.int8).zero_()
        b.launch_copy([3], [i], False, 1, ev)
        wait(ev[1][1])
        assert ev[1][1].ok
        # Every byte of the storage is as it was: block i came back, nothing else moved.
        assert torch.equal(flat, before), f"{kind}: bytes outside block {i} changed, or block {i} did not come back"
    finally:
        b.shutdown()


def test_layout_views_are_refused_with_the_reason():
    kv = torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="'k' is not contiguous"):
        BlockLayout.from_caches({"k": kv[:, 0]})
    base = torch.zeros(5 * 64).view(-1)
    with pytest.raises(ValueError, match="overlap"):
        BlockLayout.from_caches({"a": base[:256].view(4, 64), "b": base[32:288].view(4, 64)})


def test_float_block_id_is_refused_not_truncated(subject):
    """Class 7 of issue 13: a block id of 1.5 copied block 1."""
    events: list = []
    with pytest.raises(TypeError, match=r"src_blocks holds 1\.5"):
        subject.b.launch_copy([1.5], [0], True, 0, events)
    assert events == [] and not subject.b._run.open_jobs
