"""``JobEvent``'s done callbacks and ``block_ids``' fast paths."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvoffload.jobs import JobEvent, block_ids


def test_a_done_callback_runs_once_when_the_job_ends_or_at_once_if_it_has() -> None:
    e, calls = JobEvent(), []
    e.add_done_callback(lambda: calls.append("before"))
    assert calls == []
    assert e.complete(True)
    assert not e.complete(False)  # a second end is ignored, and so calls nothing
    e.add_done_callback(lambda: calls.append("after"))
    assert calls == ["before", "after"]


def test_done_callbacks_race_with_the_end_and_each_runs_exactly_once() -> None:
    for _ in range(200):
        e, calls = JobEvent(), []
        ender = threading.Thread(target=e.complete, args=(True,))
        ender.start()
        for i in range(5):
            e.add_done_callback(lambda i=i: calls.append(i))
        ender.join()
        assert sorted(calls) == list(range(5))


@pytest.mark.parametrize("ids", [
    [3, 1, 2], (3, 1, 2), range(3), np.array([3, 1, 2], np.int64), np.array([3, 1, 2], np.uint16),
    np.array([3, 1, 2], np.int8), torch.tensor([3, 1, 2]), torch.tensor([3, 1, 2], dtype=torch.int32),
])
def test_integer_sequences_give_python_ints_in_order(ids) -> None:
    out = block_ids("src_blocks", ids)
    assert out == list(ids.tolist() if hasattr(ids, "tolist") else ids)
    assert all(type(i) is int for i in out)


@pytest.mark.parametrize("ids, message", [
    ([1, True], "not bools"), ([1, 2.0], "are integers"), (np.array([1.0, 2.0]), "are integers"),
    (np.array([True, False]), "not bools"), (torch.tensor([1.5]), "are integers"),
    (torch.tensor([True]), "not bools"), (np.ma.array([1, 2], mask=[0, 1]), "are integers"),
])
def test_non_integer_ids_are_refused_however_they_come(ids, message) -> None:
    with pytest.raises(TypeError, match=message):
        block_ids("src_blocks", ids)


def test_a_callback_that_raises_is_logged_and_the_others_still_run(caplog) -> None:
    e, calls = JobEvent(), []

    def bad() -> None:
        raise RuntimeError("callback failed")

    e.add_done_callback(bad)
    e.add_done_callback(lambda: calls.append(1))
    with caplog.at_level("ERROR", logger="kvoffload"):
        assert e.complete(True)  # the thread that ends the job never sees the error
        e.add_done_callback(bad)  # nor does a caller registering after the end
    assert calls == [1] and e.done and e.ok
    assert sum("done callback" in r.getMessage() for r in caplog.records) == 2


def test_a_callback_must_be_callable() -> None:
    with pytest.raises(TypeError, match="needs a callable"):
        JobEvent().add_done_callback("not a function")
