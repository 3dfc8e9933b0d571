"""One supervised pool of Ray processes: what the reward pool (rlflow/rewards/pool.py) and the
environment pool (rlflow/agents/pool.py) are built on.

``ProcessPool`` keeps ``num_workers`` Ray actor processes of one ``PoolWorker`` subclass and
supervises them; what their calls are, and what the answers mean, is a ``Request``'s (one batch of
samples, one reset or step of the environments). The pool does the rest:

- Start: each process next to the driver (soft node affinity), reserving no Ray CPU
  (``num_cpus=0``: it never waits for, nor holds up, the trainer's placement groups), and never
  restarted by Ray (``max_restarts=0``): the pool replaces it itself, so it knows which call was lost.
- Start-up check: the worker's ``__init__`` loads the user's code with ``PoolWorker.load``, which
  keeps the error (an actor whose ``__init__`` raises would only be reported dead), and ``ready()``
  hands it to the driver, which raises it. A process that dies while starting, or does not answer
  within ``startup_timeout_s``, raises the worker's ``error_type`` naming what it was loading.
- Calls: each process has one clock, ``Slot.since``, which the request restarts whenever the process
  begins a call as the driver sees it. ``run`` waits for the first answer or the first clock to run
  out (``timeout_s``; ``startup_timeout_s`` while the process starts) and hands the request the
  processes that answered and those overdue. An overdue call is stopped by killing its process (a
  hung Python call cannot be interrupted reliably from another thread): the request calls
  ``replace``, which starts a new process in the slot.
- Failure: an error leaving ``run`` (Ctrl-C too) kills the processes first, so none goes on
  working for an abandoned request; the next request starts new ones.
- Errors that cross processes: ``PoolWorker.portable`` makes a worker's exception travel with its
  traceback as a note; ``death_detail`` and ``error_line`` put what Ray says of a failure in a line.

Why not a library: ray.util.ActorPool neither stops a call that runs past its timeout nor replaces
a dead actor; concurrent.futures, loky and pebble run processes on this machine, not Ray actors of
the cluster, and hand a task to any process, while an environment lives in one process.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["PoolWorker", "ProcessPool", "ProcessPoolOwner", "Request", "Slot", "death_detail", "error_line"]


# -- in the processes ------------------------------------------------------------------------------

class PoolWorker:
    """Base of a pool's actor class. A subclass names its processes (``process_name``, as in
    "raised in the reward process") and the error an exception that does not pickle becomes
    (``error_type``), and loads the user's code in ``__init__`` with ``load``."""

    process_name = "pool process"
    error_type: type[Exception] = RuntimeError

    def __init__(self, sys_path: list[str]):
        # the user's code imports what it would import in the driver (e.g. modules next to the script)
        sys.path.extend(entry for entry in sys_path if entry not in sys.path)
        self.error: BaseException | None = None

    def load(self, loader: Callable, *args):
        """``loader(*args)``, or None with the error kept for ``ready()`` (the driver raises it)."""
        try:
            return loader(*args)
        except Exception as err:  # noqa: BLE001 - any error of the user's code: re-raised in the driver
            self.error = self.portable(err)
            return None

    def ready(self) -> tuple[int, BaseException | None]:
        """(pid, the error that loading raised, or None): the driver's start-up check."""
        return os.getpid(), self.error

    def portable(self, err: BaseException) -> BaseException:
        """The exception as the driver will see it: with this process's traceback as a note, or an
        ``error_type`` with its type and message where the exception does not pickle."""
        where = f"raised in the {self.process_name} (pid {os.getpid()}):\n" + "".join(
            traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:  # noqa: BLE001 - any exception type can fail to pickle
            err = self.error_type(f"{type(err).__name__}: {err}")
        if hasattr(err, "add_note"):  # python >= 3.11
            err.add_note(where)
        return err


# -- what Ray says of a failure, in a line ---------------------------------------------------------

def death_detail(err: Exception) -> str:
    """What Ray knows of a dead process, in a line: its exit code when it reports one."""
    text = " ".join(str(err).split())
    code = re.search(r"exits with an exit code (-?\d+)", text)
    if code:
        return f"exit code {code.group(1)}"
    if "killed by `ray.kill`" in text:
        return "killed by ray.kill"
    detail = re.search(r"Worker exit detail: (.*?\.)", text)
    return f"exit code unknown; Ray: {detail.group(1) if detail else text[:200]}"


def error_line(err: BaseException) -> str:
    """The error as "Type: the first line of its message" (Ray's errors run to many lines)."""
    first_line = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first_line}"


# -- in the driver ---------------------------------------------------------------------------------

@dataclass
class Slot:
    """One process of the pool: its actor, its ready() call while it starts (None once started), and
    its clock: when it started, or when it began its current call as the driver knows it. A pool's
    subclass adds what the process is doing for the request."""

    actor: object = None
    starting: object = None
    since: float = 0.0

    def forget(self) -> None:
        """A new process takes the slot: a subclass drops what it knew of the old one."""


class Request:
    """One request's work for the pool's processes; ``ProcessPool.run`` drives it."""

    def send(self, slot: Slot) -> None:
        """Gives a started process the calls it can take now (if any), restarting its clock when it
        was idle."""
        raise NotImplementedError

    def waits_on(self, slot: Slot) -> bool:
        """Whether the request still needs the process: its start, or a call it runs. ``run`` ends
        when it needs none."""
        raise NotImplementedError

    def call(self, slot: Slot):
        """The Ray call (an ObjectRef, or a streaming generator) of a started process that the
        driver waits on."""
        raise NotImplementedError

    def answered(self, slot: Slot) -> None:
        """That call has answered: take its result (its ray.get raises where the process died)."""
        raise NotImplementedError

    def overdue(self, slot: Slot) -> None:
        """That call ran past timeout_s: settle it and ``replace`` the process (which kills it)."""
        raise NotImplementedError


class ProcessPool:
    """``num_workers`` processes of ``worker_cls`` (a PoolWorker), each created with
    ``worker_args()`` (evaluated at each start: the driver's sys.path and folder as they are then)
    and ``actor_options`` (ray.remote's, over num_cpus=0: e.g. num_gpus),
    each call bounded by ``timeout_s`` and each start by ``startup_timeout_s``. ``loading`` says
    what a process loads, for the start-up errors; ``load_error`` turns the error that loading
    raised in a process into the one to raise (default: that error itself).

    The processes start on ``fill()`` (Ray must be running); ``close()`` kills them. Not
    thread-safe: one request at a time."""

    def __init__(self, worker_cls: type[PoolWorker], worker_args: Callable[[], tuple], num_workers: int,
                 timeout_s: float, startup_timeout_s: float = 900.0, slot_cls: type[Slot] = Slot,
                 loading: str = "its code", load_error: Callable[[BaseException], BaseException] | None = None,
                 actor_options: dict | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        # actor_options: more of ray.remote's options (e.g. num_gpus for a pool whose processes need one)
        self.actor_cls = ray.remote(**{"num_cpus": 0, **(actor_options or {}), "max_restarts": 0})(worker_cls)
        self.worker_args = worker_args
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.slot_cls = slot_cls
        self.error_type = worker_cls.error_type
        self.process = _with_article(worker_cls.process_name)  # "a reward process"
        self.loading = loading
        self.load_error = load_error
        self.slots: list[Slot] = []
        self.num_replaced = 0  # processes killed after a timeout or found dead

    # -- processes ---------------------------------------------------------------------------------
    def fill(self) -> None:
        """Starts processes until there are num_workers (the first request's, and after close())."""
        while len(self.slots) < self.num_workers:
            self.slots.append(self.slot_cls())
            self.start(self.slots[-1])

    def start(self, slot: Slot) -> None:
        # next to the driver (soft: elsewhere if this node cannot take it)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        slot.actor = self.actor_cls.options(scheduling_strategy=here).remote(*self.worker_args())
        slot.starting, slot.since = slot.actor.ready.remote(), time.monotonic()
        slot.forget()

    def replace(self, slot: Slot) -> None:
        """Kills the slot's process (if it is not dead already) and starts another in its place."""
        _kill(slot.actor)
        self.num_replaced += 1
        self.start(slot)

    def close(self) -> None:
        for slot in self.slots:
            _kill(slot.actor)
        self.slots = []

    # -- a request ---------------------------------------------------------------------------------
    def run(self, request: Request) -> None:
        """Drives ``request`` until it waits on no process: sends work to the started processes,
        waits for the first answer or the first clock to run out, and hands the request the
        processes that answered, then those overdue. An error kills the processes and is raised."""
        try:
            while True:
                for slot in self.slots:
                    if slot.starting is None:
                        request.send(slot)
                needed = [slot for slot in self.slots if request.waits_on(slot)]
                if not needed:
                    return
                watched = {(slot.starting if slot.starting is not None else request.call(slot)): slot
                           for slot in needed}
                wait_s = max(0.0, min(map(self._deadline, needed)) - time.monotonic())
                ready, _ = ray.wait(list(watched), num_returns=1, timeout=wait_s)
                for ref in ready:
                    slot = watched[ref]
                    if slot.starting is not None:
                        self._check_start(slot)
                    else:
                        request.answered(slot)
                self._stop_overdue(request)
        except BaseException:
            self.close()  # no process goes on working for this request (the next one starts afresh)
            raise

    def _deadline(self, slot: Slot) -> float:
        return slot.since + (self.startup_timeout_s if slot.starting is not None else self.timeout_s)

    def _check_start(self, slot: Slot) -> None:
        try:
            _, error = ray.get(slot.starting)
        except ray.exceptions.RayActorError as err:
            raise self.error_type(f"{self.process} died while loading {self.loading}: {death_detail(err)}") from err
        if error is not None:
            if self.load_error is None:
                raise error  # e.g. the FileNotFoundError naming the file that the driver's own load gives
            raise self.load_error(error) from error
        slot.starting, slot.since = None, time.monotonic()  # idle, not overdue: send() restarts the clock

    def _stop_overdue(self, request: Request) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if not request.waits_on(slot) or now < self._deadline(slot):
                continue
            if slot.starting is not None:
                raise self.error_type(f"{self.process} did not start within trainer.startup_timeout_s="
                                      f"{self.startup_timeout_s:g} s")
            request.overdue(slot)


class ProcessPoolOwner:
    """What a pool built on a ProcessPool (``self.procs``) shows of it."""

    procs: ProcessPool

    @property
    def slots(self) -> list[Slot]:
        return self.procs.slots

    @property
    def num_replaced(self) -> int:
        """Processes killed after a timeout or found dead."""
        return self.procs.num_replaced

    @property
    def timeout_s(self) -> float:
        return self.procs.timeout_s


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead, or Ray already shut down
        pass


def _with_article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
