"""Reward functions off the driver: a pool of Ray processes, with a timeout per sample.

``RewardPool`` is a ``RewardManager`` whose samples are scored by ``num_workers`` Ray actors
(``RewardWorker``), each of which loads the reward file itself (or unpickles the Python callable
it was given: ``RewardPool(fn=...)``, pickled with cloudpickle, by value where not importable).
A batch is cut into chunks that are handed to idle processes. A process scores its chunk one sample after the other and streams
the outcomes back (a Ray streaming generator): all of them when the chunk is done, the ones so far
every ``poll_s`` while it is not, and, as soon as one sample has run ``poll_s``, a message that
names it as the one running. Fast rule rewards thus cost one message per chunk, and the driver
always knows which sample a slow process is on.

The timeout: a sample's ``timeout_s`` clock starts when its process begins it, as the driver sees
it: when the sample is sent to an idle process alone, when the message that names it running
arrives (at most ``2 * poll_s`` after it began), or when the outcomes before it arrive and it is the
last of its chunk. So a sample runs at least ``timeout_s`` (less only the few ms a call takes to
reach an idle process) and is stopped within ``timeout_s + 2 * poll_s`` plus Ray's latency and the
kill (measured: 2.1 s for timeout_s=2). One that runs past ``timeout_s`` is stopped by
killing its process (a hung Python function cannot be interrupted reliably from another thread),
so it gets a "timeout" outcome, its process is replaced, and the chunk's unscored samples go back
to the queue with fresh clocks. A process that dies on a sample (``os._exit``, a segfault, the
OOM killer) is handled the same way, as a "died" outcome. Both then follow ``on_error`` like a
raising function: ``raise`` stops the run naming the sample, ``zero`` scores it 0 and counts it.

When the process stops answering before any sample was named running (it died at once, or a C
call holds the GIL so it cannot even send a message) the driver does not know which sample of the
chunk did it: it then reruns the chunk's unscored samples one per call, which names it exactly
(at the cost of running it, and its timeout, a second time).

Scores equal the serial ``RewardManager``'s: the processes run the same ``evaluate`` and the
driver the same ``assemble``, in sample order. The pool's processes reserve no Ray CPU
(``num_cpus=0``): they never wait for, nor hold up, the placement groups of the trainer's workers,
and they score while those workers wait for the reward.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from rlflow.rewards import Outcome, RewardError, RewardManager, compute_score, evaluate, load_custom_reward_fn

__all__ = ["RewardPool", "RewardWorker", "pickle_reward_fn"]

# A chunk is about this much scoring (one Ray call, ~2 ms here), and at most an equal share of the
# batch: cheap rule rewards go in one call per process, slow ones in small chunks that balance the load.
CHUNK_S = 0.1


class RewardWorker:
    """One pool process: loads the reward function once, then scores chunks of samples."""

    def __init__(self, path: str | None, name: str, sys_path: list[str], fn_bytes: bytes | None = None):
        # the reward file imports what it would import in the driver (e.g. modules next to the script)
        sys.path.extend(entry for entry in sys_path if entry not in sys.path)
        self.error = None
        try:
            if fn_bytes is not None:  # a callable of the driver's, unpickled once sys.path is the driver's
                from ray import cloudpickle

                self.fn = cloudpickle.loads(fn_bytes)
            else:
                self.fn = load_custom_reward_fn(path, name) if path else compute_score
        except Exception as err:  # noqa: BLE001 - re-raised in the driver by RewardPool
            self.fn, self.error = None, _portable(err)

    def ready(self) -> tuple[int, BaseException | None]:
        """(pid, the error that loading the reward function raised, or None)."""
        return os.getpid(), self.error

    def _evaluate(self, item: tuple) -> Outcome:
        try:
            outcome = evaluate(self.fn, *item)
        except BaseException as err:  # noqa: BLE001 - e.g. sys.exit() in the function: that sample's error
            outcome = Outcome("raised", what="reward function failed", detail=f": {type(err).__name__}: {err}", exc=err)
        if outcome.exc is not None:
            outcome.exc = _portable(outcome.exc)
        return outcome

    def score(self, items: list[tuple], poll_s: float):
        """Scores (data_source, solution_str, ground_truth, extra_info) items in order on a thread
        of their own, and yields (outcomes, running) messages: the outcomes of the next samples,
        and whether the sample after them is running for poll_s or more. Every sample's outcome
        is in exactly one message; a message comes every poll_s while outcomes accumulate."""
        outcomes: list[Outcome] = []
        starts: list[float] = []

        def run():
            for item in items:
                starts.append(time.monotonic())
                outcomes.append(self._evaluate(item))

        thread = threading.Thread(target=run, name="rlflow-reward", daemon=True)
        thread.start()
        sent, sent_at, named = 0, time.monotonic(), -1
        while True:
            thread.join(poll_s)
            done = len(outcomes)  # read once: the thread keeps appending
            if done == len(items):
                yield outcomes[sent:], False
                return
            now = time.monotonic()
            running = done != named and len(starts) > done and now - starts[done] >= poll_s
            if running or (done > sent and now - sent_at >= poll_s):
                yield outcomes[sent:done], running
                sent, sent_at = done, now
                if running:
                    named = done


def _portable(err: BaseException) -> BaseException:
    """The exception as the driver will see it: with the reward process's traceback as a note, or
    a RewardError with its type and message where the exception does not pickle."""
    where = f"raised in the reward process (pid {os.getpid()}):\n" + "".join(traceback.format_exception(err)).rstrip()
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any exception type can fail to pickle
        err = RewardError(f"{type(err).__name__}: {err}")
    if hasattr(err, "add_note"):  # python >= 3.11
        err.add_note(where)
    return err


def pickle_reward_fn(fn) -> bytes:
    """``fn`` pickled for the pool's processes (cloudpickle: a function of ``__main__``, e.g. a
    notebook's, a lambda or a closure goes by value), or a TypeError naming reward_fn."""
    from ray import cloudpickle

    try:
        return cloudpickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - TypeError, PicklingError, ... from what it captures
        raise TypeError(
            f"reward_fn {getattr(fn, '__qualname__', fn)!r} cannot be pickled to the reward processes "
            f"(reward.num_workers > 0): {type(err).__name__}: {err}. Define it at module level without "
            f"unpicklable state (locks, open files, clients: create them inside the function), or score "
            f"in the driver with reward.num_workers=0"
        ) from err


@dataclass
class _Slot:
    """One process of the pool and what it is doing: starting (``starting``: its ready() call),
    scoring a chunk (``stream``; ``todo``: the chunk's samples not scored yet) or idle.
    ``since``: when the driver last heard of it (the clock of todo[0]); ``named``: whether todo[0]
    is known to be the sample running (named by the process, or alone in its chunk)."""

    actor: object = None
    starting: object = None
    stream: object = None
    todo: list[int] = field(default_factory=list)
    since: float = 0.0
    named: bool = False
    sent_at: float = 0.0  # when the chunk was sent, and its size: how long samples take
    size: int = 0


@dataclass
class _Batch:
    items: list[tuple]
    outcomes: list
    queue: list[int]  # sample indices waiting for a process, ascending
    stop_at: int  # the first sample whose outcome stops the batch (len(items): none yet)
    alone: set[int] = field(default_factory=set)  # samples to score one per call (to name a culprit)
    timed: list[float] = field(default_factory=lambda: [0.0, 0])  # seconds and samples of whole chunks

    def record(self, index: int, outcome: Outcome, stops: bool) -> None:
        self.outcomes[index] = outcome
        if stops:
            self.stop_at = min(self.stop_at, index)

    def has_work(self) -> bool:
        return bool(self.queue) and self.queue[0] < self.stop_at

    def needs(self, slot: _Slot) -> bool:
        """Whether the slot is scoring a sample this batch still needs."""
        return slot.stream is not None and slot.todo[0] < self.stop_at

    def take(self, size: int) -> list[int]:
        """The next chunk: up to ``size`` samples from the front of the queue, or one to score alone."""
        if self.queue[0] in self.alone:
            return [self.queue.pop(0)]
        chunk = []
        while self.queue and len(chunk) < size and self.queue[0] < self.stop_at and self.queue[0] not in self.alone:
            chunk.append(self.queue.pop(0))
        return chunk


class RewardPool(RewardManager):
    """Scores batches in ``num_workers`` Ray processes that load ``name`` from the reward file
    at ``path`` (None: the built-in ``compute_score``), or that run ``fn``, a Python callable
    pickled to them (it replaces ``path``); each sample may run ``timeout_s`` seconds.

    The processes start on the first batch (Ray must be running); ``close()`` kills them. Not
    thread-safe: one batch at a time."""

    def __init__(self, path: str | os.PathLike | None = None, name: str = "compute_score", num_workers: int = 2,
                 timeout_s: float = 30.0, on_error: str = "raise", startup_timeout_s: float = 900.0,
                 max_logged_errors: int = 5, fn=None):
        super().__init__(None, on_error, max_logged_errors)
        self.fn_bytes = None if fn is None else pickle_reward_fn(fn)
        self.fn_name = None if fn is None else getattr(fn, "__qualname__", repr(fn))
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.path = os.path.abspath(os.fspath(path)) if path else None
        self.name = name
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.poll_s = min(0.05, self.timeout_s / 4)  # how often a busy process reports
        self.startup_timeout_s = float(startup_timeout_s)
        self.slots: list[_Slot] = []
        self.num_replaced = 0  # processes killed after a timeout or found dead
        self.sample_s: float | None = None  # seconds per sample in the last batch's whole chunks

    # -- processes ---------------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # next to the driver (soft: elsewhere if this node cannot take it); no CPU reserved
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        actor = ray.remote(RewardWorker).options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote(
            self.path, self.name, list(sys.path), self.fn_bytes)
        slot.actor, slot.starting, slot.stream, slot.todo = actor, actor.ready.remote(), None, []
        slot.since, slot.named = time.monotonic(), False

    def _replace(self, slot: _Slot) -> None:
        import ray

        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.num_replaced += 1
        self._start(slot)

    def _started(self, slot: _Slot) -> None:
        import ray

        try:
            _, error = ray.get(slot.starting)
        except ray.exceptions.RayActorError as err:
            raise RewardError(f"a reward process died while loading the reward function "
                              f"({self._source()}): {_death_detail(err)}") from err
        if error is not None:
            raise error  # the error the driver's own load gives, e.g. FileNotFoundError naming the file
        slot.starting = None

    def _source(self) -> str:
        if self.fn_bytes is not None:
            return f"reward_fn {self.fn_name}"
        return self.path or "built-in compute_score"

    def close(self) -> None:
        import ray

        for slot in self.slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray already shut down
                pass
        self.slots = []

    # -- a batch -----------------------------------------------------------------------------------
    def outcomes(self, items: list[tuple]) -> list[Outcome | None]:
        """The outcome of every sample up to the first that stops the batch (None after it)."""
        import ray

        n = len(items)
        batch = _Batch(items, [None] * n, list(range(n)), n)
        share = math.ceil(n / self.num_workers)
        if self.sample_s is None:  # nothing timed yet: two chunks per process
            chunk_size = max(1, math.ceil(share / 2))
        else:
            chunk_size = max(1, min(share, int(CHUNK_S / max(self.sample_s, 1e-9))))
        while len(self.slots) < self.num_workers:
            self.slots.append(_Slot())
            self._start(self.slots[-1])
        try:
            while True:
                for slot in self.slots:  # chunks to the idle processes
                    if slot.starting is None and slot.stream is None and batch.has_work():
                        slot.todo = batch.take(chunk_size)
                        slot.stream = slot.actor.score.options(num_returns="streaming").remote(
                            [items[i] for i in slot.todo], self.poll_s)
                        slot.since, slot.named = time.monotonic(), len(slot.todo) == 1
                        slot.sent_at, slot.size = slot.since, len(slot.todo)
                busy = [slot for slot in self.slots if batch.needs(slot)]
                if not busy and not batch.has_work():
                    break
                starting = [slot for slot in self.slots if slot.starting is not None]
                waiting = {**{slot.stream: slot for slot in busy}, **{slot.starting: slot for slot in starting}}
                deadline = min([slot.since + self.timeout_s for slot in busy]
                               + [slot.since + self.startup_timeout_s for slot in starting])
                ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                for ref in ready:
                    slot = waiting[ref]
                    if slot.starting is not None:
                        self._started(slot)
                    else:
                        self._next_message(slot, batch)
                self._stop_overdue(batch)
        except BaseException:
            self.close()  # no process keeps working on this batch (the next one starts afresh)
            raise
        for slot in self.slots:  # still on samples after the one that stops the batch: not needed
            if slot.stream is not None:
                self._replace(slot)
        if batch.timed[1]:
            self.sample_s = batch.timed[0] / batch.timed[1]
        return batch.outcomes

    def _next_message(self, slot: _Slot, batch: _Batch) -> None:
        import ray

        try:
            outcomes, running = ray.get(next(slot.stream))
        except StopIteration:  # not expected: a chunk ends with its last outcomes
            slot.stream = None
            return
        except ray.exceptions.RayActorError as err:  # the process died, on the sample it was on
            self._lose(slot, batch, Outcome("died", what="the reward process died", detail=f": {_death_detail(err)}"))
            return
        except Exception as err:  # noqa: BLE001 - the stream itself failed: the same, with Ray's error
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            self._lose(slot, batch, Outcome("died", what="the reward process failed",
                                            detail=f": {type(err).__name__}: {first_line}"))
            return
        for outcome in outcomes:
            batch.record(slot.todo.pop(0), outcome, self.stops(outcome))
        slot.since, slot.named = time.monotonic(), running or len(slot.todo) == 1
        if not slot.todo:
            slot.stream = None  # idle: the generator has nothing left to yield
            batch.timed[0] += slot.since - slot.sent_at
            batch.timed[1] += slot.size

    def _stop_overdue(self, batch: _Batch) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if batch.needs(slot) and now - slot.since >= self.timeout_s:
                self._lose(slot, batch, Outcome(
                    "timeout", what=f"reward function did not return within reward.timeout_s={self.timeout_s:g} s",
                    detail=" and was stopped (its reward process was killed)"))
            elif slot.starting is not None and now - slot.since >= self.startup_timeout_s:
                raise RewardError(f"a reward process did not start within trainer.startup_timeout_s="
                                  f"{self.startup_timeout_s:g} s")

    def _lose(self, slot: _Slot, batch: _Batch, outcome: Outcome) -> None:
        """The process is replaced. Where it had named the sample it was on, that sample gets
        ``outcome``; otherwise the chunk's unscored samples are rerun one per call, to name it."""
        if slot.named:
            batch.record(slot.todo.pop(0), outcome, self.stops(outcome))
        else:
            batch.alone.update(slot.todo)
        batch.queue = sorted(batch.queue + slot.todo)
        self._replace(slot)


def _death_detail(err: Exception) -> str:
    """What Ray knows of a dead process, in a line: its exit code when it reports one."""
    text = " ".join(str(err).split())
    code = re.search(r"exits with an exit code (-?\d+)", text)
    if code:
        return f"exit code {code.group(1)}"
    if "killed by `ray.kill`" in text:
        return "killed by ray.kill"
    detail = re.search(r"Worker exit detail: (.*?\.)", text)
    return f"exit code unknown; Ray: {detail.group(1) if detail else text[:200]}"
