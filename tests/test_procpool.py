"""The supervised process pool (rlflow/procpool.py) on its own: a call that kills its process, one
that hangs past timeout_s, a process that fails to start (raises, dies, or never answers), and a
replacement that serves the later calls. Real Ray actors (the session's Ray); the worker and the
request below are the smallest a pool can have: one call per item, one at a time per process."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import ray
import ray.cloudpickle

from rlflow.procpool import PoolWorker, ProcessPool, Request, Slot, death_detail, error_line

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import tests/


class EchoError(RuntimeError):
    pass


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def _load(mode: str) -> str:
    """What an Echo process loads at start: mode "raise", "unpicklable", "exit" and "slow" fail to."""
    if mode == "raise":
        raise KeyError("no such key")
    if mode == "unpicklable":
        raise Unpicklable()
    if mode == "exit":
        os._exit(5)
    if mode == "slow":
        time.sleep(60)
    return mode


class Echo(PoolWorker):
    process_name = "echo process"
    error_type = EchoError

    def __init__(self, sys_path: list[str], mode: str = "ok"):
        super().__init__(sys_path)
        self.mode = self.load(_load, mode)

    def run(self, item: str) -> tuple[str, int]:
        """(item, pid); "hang" never returns, "exit" kills the process."""
        if item == "hang":
            while True:
                time.sleep(1)
        if item == "exit":
            os._exit(3)
        return item, os.getpid()


@dataclass
class _Slot(Slot):
    index: int | None = None  # the item it runs, and its call
    ref: object = None

    def forget(self) -> None:
        self.index, self.ref = None, None


class Calls(Request):
    """run(item) for each item, on whichever process is idle. results[i]: ("ok", item, pid),
    ("died", detail) or ("timeout",)."""

    def __init__(self, procs: ProcessPool, items: list[str]):
        self.procs, self.items = procs, items
        self.queue = list(range(len(items)))
        self.results: list[tuple | None] = [None] * len(items)

    def send(self, slot: _Slot) -> None:
        if slot.ref is None and self.queue:
            slot.index = self.queue.pop(0)
            slot.ref = slot.actor.run.remote(self.items[slot.index])
            slot.since = time.monotonic()

    def waits_on(self, slot: _Slot) -> bool:
        return slot.ref is not None or (slot.starting is not None and bool(self.queue))

    def call(self, slot: _Slot):
        return slot.ref

    def answered(self, slot: _Slot) -> None:
        try:
            self.results[slot.index] = ("ok", *ray.get(slot.ref))
        except ray.exceptions.RayActorError as err:
            self.results[slot.index] = ("died", death_detail(err))
            self.procs.replace(slot)
            return
        slot.index, slot.ref = None, None

    def overdue(self, slot: _Slot) -> None:
        self.results[slot.index] = ("timeout",)
        self.procs.replace(slot)


def _pool(mode: str = "ok", **kwargs) -> ProcessPool:
    options = {"num_workers": 1, "timeout_s": 1.0, "startup_timeout_s": 60.0, "slot_cls": _Slot,
               "loading": f"the echo ({mode})", **kwargs}
    return ProcessPool(Echo, lambda: (list(sys.path), mode), **options)


def _run(pool: ProcessPool, items: list[str]) -> list[tuple]:
    calls = Calls(pool, items)
    pool.fill()
    pool.run(calls)
    return calls.results


def _gone(pid: int, within_s: float = 20.0) -> bool:
    """Whether the process has exited (a killed actor's process may take a moment)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_call_that_kills_its_process_and_the_replacement_serves_later_calls(ray_session):
    pool = _pool(num_workers=1, timeout_s=30.0)
    try:
        first, died, after = _run(pool, ["a", "exit", "b"])
        assert first[:2] == ("ok", "a") and after[:2] == ("ok", "b")
        assert died[0] == "died" and died[1].startswith("exit code "), died  # 3, or unknown if Ray sees the socket first
        assert after[2] != first[2] and first[2] != os.getpid()  # b ran on the replacement
        assert pool.num_replaced == 1 and len(pool.slots) == 1
        assert _run(pool, ["c", "d"]) == [("ok", "c", after[2]), ("ok", "d", after[2])]  # and serves on
    finally:
        pool.close()
    assert pool.slots == [] and _gone(after[2])


def test_a_call_that_hangs_past_timeout_s_is_stopped_by_killing_its_process(ray_session):
    pool = _pool(num_workers=2, timeout_s=1.0)
    try:
        pool.fill()
        before = {ray.get(slot.actor.ready.remote())[0] for slot in pool.slots}  # started: time the call alone
        start = time.monotonic()
        results = _run(pool, ["a", "hang", "b", "c", "d"])  # one process takes "a", the other "hang"
        elapsed = time.monotonic() - start
        assert results[1] == ("timeout",)
        assert [r[:2] for r in results[:1] + results[2:]] == [("ok", item) for item in "abcd"]
        assert 1.0 <= elapsed < 1.0 + 10.0, elapsed  # not before timeout_s; the kill and a new start after
        assert pool.num_replaced == 1 and len(pool.slots) == 2
        after = {ray.get(slot.actor.ready.remote())[0] for slot in pool.slots}
        hung = (before - {results[0][2]}).pop()
        assert before & after == {results[0][2]} and _gone(hung)  # the hung one was killed, and replaced
        assert {r[2] for r in _run(pool, ["e"] * 4)} <= after
    finally:
        pool.close()


@pytest.mark.parametrize("mode", ["raise", "unpicklable"])
def test_a_process_whose_start_raises_raises_that_error(ray_session, mode):
    pool = _pool(mode, num_workers=2)
    with pytest.raises(KeyError if mode == "raise" else EchoError) as err:
        _run(pool, ["a"])
    expected = "'no such key'" if mode == "raise" else "Unpicklable: holds a lock"  # where it cannot travel as it is
    assert str(err.value) == expected
    assert any(note.startswith("raised in the echo process (pid ") for note in err.value.__notes__)
    assert pool.slots == []  # the failed request killed the processes
    wrapped = _pool(mode, load_error=lambda error: EchoError(f"does not load: {type(error).__name__}"))
    with pytest.raises(EchoError, match="^does not load: ") as err:
        _run(wrapped, ["a"])
    assert err.value.__cause__ is not None


def test_a_process_that_dies_or_hangs_while_starting(ray_session):
    with pytest.raises(EchoError, match=r"^an echo process died while loading the echo \(exit\): exit code "):
        _run(_pool("exit"), ["a"])
    pool = _pool("slow", startup_timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(EchoError, match=r"^an echo process did not start within trainer\.startup_timeout_s=1\.5 s$"):
        _run(pool, ["a"])
    assert 1.5 <= time.monotonic() - start < 1.5 + 5.0
    assert pool.slots == []


def test_errors_in_a_line_and_settings_checked():
    assert death_detail(RuntimeError("The actor died. Worker exits with an exit code 3.\n more")) == "exit code 3"
    assert death_detail(RuntimeError("The actor was killed by `ray.kill` call")) == "killed by ray.kill"
    assert death_detail(RuntimeError("Worker exit detail: It ended. Later lines.")) == "exit code unknown; Ray: It ended."
    assert error_line(ValueError("\n first line\nsecond")) == "ValueError: first line"
    for bad in ({"num_workers": 0}, {"timeout_s": 0.0}, {"timeout_s": float("inf")}):
        with pytest.raises(ValueError, match="must be"):
            _pool(**bad)
    # in the process, a load error is kept for ready(), with the process's traceback as a note
    pid, error = Echo([], "unpicklable").ready()
    assert pid == os.getpid() and isinstance(error, EchoError) and "Unpicklable" in error.__notes__[0]
