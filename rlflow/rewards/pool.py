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
and they score while those workers wait for the reward. Starting, checking, replacing and
stopping the processes is ``rlflow.procpool.ProcessPool``'s; a batch is a ``Request`` to it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import ray
from ray import cloudpickle

from rlflow.procpool import PoolWorker, ProcessPool, ProcessPoolOwner, Request, Slot, death_detail, error_line
from rlflow.rewards import Outcome, RewardError, RewardManager, compute_score, evaluate, load_custom_reward_fn

__all__ = ["RewardPool", "RewardWorker", "pickle_reward_fn"]

# A chunk is about this much scoring (one Ray call, ~2 ms here), and at most an equal share of the
# batch: cheap rule rewards go in one call per process, slow ones in small chunks that balance the load.
CHUNK_S = 0.1


def _reward_fn(path: str | None, name: str, fn_bytes: bytes | None):
    """The function a process scores with: the driver's callable (unpickled once sys.path is the
    driver's), ``name`` from the reward file, or the built-in compute_score."""
    if fn_bytes is not None:
        fn = cloudpickle.loads(fn_bytes)
        # a callable that holds a model (the judge, rlflow/rewards/judge.py) loads it here, once per
        # process, within the start-up timeout: not on its first sample, within reward.timeout_s
        load = getattr(fn, "load_in_process", None)
        return load() if callable(load) else fn
    return load_custom_reward_fn(path, name) if path else compute_score


class RewardWorker(PoolWorker):
    """One pool process: loads the reward function once, then scores chunks of samples."""

    process_name = "reward process"
    error_type = RewardError

    def __init__(self, path: str | None, name: str, sys_path: list[str], fn_bytes: bytes | None = None):
        super().__init__(sys_path)
        self.fn = self.load(_reward_fn, path, name, fn_bytes)

    def _evaluate(self, item: tuple) -> Outcome:
        try:
            outcome = evaluate(self.fn, *item)
        except BaseException as err:  # noqa: BLE001 - e.g. sys.exit() in the function: that sample's error
            outcome = Outcome("raised", what="reward function failed", detail=f": {type(err).__name__}: {err}", exc=err)
        if outcome.exc is not None:
            outcome.exc = self.portable(outcome.exc)
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


def pickle_reward_fn(fn) -> bytes:
    """``fn`` pickled for the pool's processes (cloudpickle: a function of ``__main__``, e.g. a
    notebook's, a lambda or a closure goes by value), or a TypeError naming reward_fn."""
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
class _Slot(Slot):
    """A process scoring a chunk (``stream``; ``todo``: the chunk's samples not scored yet) or idle.
    ``since`` is the clock of todo[0]; ``named``: whether todo[0] is known to be the sample running
    (named by the process, or alone in its chunk)."""

    stream: object = None
    todo: list[int] = field(default_factory=list)
    named: bool = False
    sent_at: float = 0.0  # when the chunk was sent, and its size: how long samples take
    size: int = 0

    def forget(self) -> None:
        self.stream, self.todo, self.named = None, [], False


class _Batch(Request):
    """One batch's samples, handed out in chunks to the pool's processes."""

    def __init__(self, pool: RewardPool, items: list[tuple], chunk_size: int):
        self.pool = pool
        self.items = items
        self.chunk_size = chunk_size
        self.outcomes: list[Outcome | None] = [None] * len(items)
        self.queue = list(range(len(items)))  # sample indices waiting for a process, ascending
        self.stop_at = len(items)  # the first sample whose outcome stops the batch (len(items): none yet)
        self.alone: set[int] = set()  # samples to score one per call (to name a culprit)
        self.timed = [0.0, 0]  # seconds and samples of whole chunks

    def record(self, index: int, outcome: Outcome) -> None:
        if self.pool.label != "reward function" and outcome.what.startswith("reward function"):
            outcome.what = self.pool.label + outcome.what[len("reward function"):]  # "judge failed on sample 3 ..."
        self.outcomes[index] = outcome
        if self.pool.stops(outcome):
            self.stop_at = min(self.stop_at, index)

    def has_work(self) -> bool:
        return bool(self.queue) and self.queue[0] < self.stop_at

    def take(self) -> list[int]:
        """The next chunk: up to chunk_size samples from the front of the queue, or one to score alone."""
        if self.queue[0] in self.alone:
            return [self.queue.pop(0)]
        chunk = []
        while (self.queue and len(chunk) < self.chunk_size and self.queue[0] < self.stop_at
               and self.queue[0] not in self.alone):
            chunk.append(self.queue.pop(0))
        return chunk

    # -- the Request -------------------------------------------------------------------------------
    def send(self, slot: _Slot) -> None:
        if slot.stream is None and self.has_work():
            slot.todo = self.take()
            slot.stream = slot.actor.score.options(num_returns="streaming").remote(
                [self.items[i] for i in slot.todo], self.pool.poll_s)
            slot.since, slot.named = time.monotonic(), len(slot.todo) == 1
            slot.sent_at, slot.size = slot.since, len(slot.todo)

    def waits_on(self, slot: _Slot) -> bool:
        """A process scoring a sample the batch still needs, or one starting while samples wait."""
        if slot.starting is not None:
            return self.has_work()
        return slot.stream is not None and slot.todo[0] < self.stop_at

    def call(self, slot: _Slot):
        return slot.stream

    def answered(self, slot: _Slot) -> None:
        try:
            outcomes, running = ray.get(next(slot.stream))
        except StopIteration:  # not expected: a chunk ends with its last outcomes
            slot.stream = None
            return
        except ray.exceptions.RayActorError as err:  # the process died, on the sample it was on
            self._lose(slot, Outcome("died", what="the reward process died", detail=f": {death_detail(err)}"))
            return
        except Exception as err:  # noqa: BLE001 - the stream itself failed: the same, with Ray's error
            self._lose(slot, Outcome("died", what="the reward process failed", detail=f": {error_line(err)}"))
            return
        for outcome in outcomes:
            self.record(slot.todo.pop(0), outcome)
        slot.since, slot.named = time.monotonic(), running or len(slot.todo) == 1
        if not slot.todo:
            slot.stream = None  # idle: the generator has nothing left to yield
            self.timed[0] += slot.since - slot.sent_at
            self.timed[1] += slot.size

    def overdue(self, slot: _Slot) -> None:
        self._lose(slot, Outcome(
            "timeout", what=f"{self.pool.label} did not return within reward.timeout_s={self.pool.timeout_s:g} s",
            detail=" and was stopped (its reward process was killed)"))

    def _lose(self, slot: _Slot, outcome: Outcome) -> None:
        """The process is replaced. Where it had named the sample it was on, that sample gets
        ``outcome``; otherwise the chunk's unscored samples are rerun one per call, to name it."""
        if slot.named:
            self.record(slot.todo.pop(0), outcome)
        else:
            self.alone.update(slot.todo)
        self.queue = sorted(self.queue + slot.todo)
        self.pool.procs.replace(slot)


class RewardPool(RewardManager, ProcessPoolOwner):
    """Scores batches in ``num_workers`` Ray processes that load ``name`` from the reward file
    at ``path`` (None: the built-in ``compute_score``), or that run ``fn``, a Python callable
    pickled to them (it replaces ``path``; one with a ``load_in_process()`` method is loaded by it in
    each process, e.g. the judge's model); each sample may run ``timeout_s`` seconds.
    ``actor_options``: ray.remote options of the processes (num_gpus); ``label`` names the function
    in the samples' errors ("judge failed on sample 3 ...").

    The processes start on the first batch (Ray must be running); ``close()`` kills them. Not
    thread-safe: one batch at a time."""

    def __init__(self, path: str | os.PathLike | None = None, name: str = "compute_score", num_workers: int = 2,
                 timeout_s: float = 30.0, on_error: str = "raise", startup_timeout_s: float = 900.0,
                 max_logged_errors: int = 5, fn=None, actor_options: dict | None = None,
                 label: str = "reward function"):
        super().__init__(None, on_error, max_logged_errors)
        self.label = label  # what the samples' errors name: "reward function", "judge"
        self.fn_bytes = None if fn is None else pickle_reward_fn(fn)
        self.fn_name = None if fn is None else getattr(fn, "__qualname__", repr(fn))
        self.path = os.path.abspath(os.fspath(path)) if path else None
        self.name = name
        self.procs = ProcessPool(RewardWorker, self._worker_args, num_workers, timeout_s, startup_timeout_s,
                                 slot_cls=_Slot, loading=f"the {label} ({self._source()})",
                                 actor_options=actor_options)
        self.poll_s = min(0.05, self.timeout_s / 4)  # how often a busy process reports
        self.sample_s: float | None = None  # seconds per sample in the last batch's whole chunks

    def _worker_args(self) -> tuple:
        return self.path, self.name, list(sys.path), self.fn_bytes

    def _source(self) -> str:
        if self.fn_bytes is not None:
            return f"reward_fn {self.fn_name}"
        return self.path or "built-in compute_score"

    def close(self) -> None:
        self.procs.close()

    def outcomes(self, items: list[tuple]) -> list[Outcome | None]:
        """The outcome of every sample up to the first that stops the batch (None after it)."""
        batch = _Batch(self, items, self._chunk_size(len(items)))
        self.procs.fill()
        self.procs.run(batch)
        for slot in self.slots:  # still on samples after the one that stops the batch: not needed
            if slot.stream is not None:
                self.procs.replace(slot)
        if batch.timed[1]:
            self.sample_s = batch.timed[0] / batch.timed[1]
        return batch.outcomes

    def _chunk_size(self, num_samples: int) -> int:
        share = math.ceil(num_samples / self.procs.num_workers)
        if self.sample_s is None:  # nothing timed yet: two chunks per process
            return max(1, math.ceil(share / 2))
        return max(1, min(share, int(CHUNK_S / max(self.sample_s, 1e-9))))
