"""The Ray actor behind every rank: a process that hosts one worker object (a role's rank).

A worker group (controllers/worker_group.py) starts these processes and calls the worker's methods
through them by name. The process outlives its worker: after a run it can host a rank of any role
and any worker class in a later run (IdleWorkers), so a later run pays no new process's imports.
"""

from __future__ import annotations

import ray

# the Ray concurrency group of the calls that run beside the call in progress (WorkerBase.widen_threads)
BESIDE = "control"


def runs_beside_calls(method):
    """Marks a worker method that the group calls in its own thread, beside the call in progress
    (every other call runs in order, one at a time)."""
    method.runs_beside_calls = True
    return method


def calls_beside(worker_cls, method: str) -> bool:
    return getattr(getattr(worker_cls, method, None), "runs_beside_calls", False)


class WorkerProcess:
    """One rank's process: builds `worker_cls(*args)` and runs its methods by name (`call`, in the
    BESIDE concurrency group for a method marked runs_beside_calls)."""

    def __init__(self, worker_cls, *args):
        self.worker = worker_cls(*args)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def release(self) -> bool:
        """The run is over: the worker drops all it built. False: this process cannot host another
        rank (its worker said so), and the group stops it."""
        reusable = self.worker.release()  # WorkerBase.release collects what the worker held
        self.worker = None
        return reusable

    def host(self, worker_cls, *args) -> None:
        """After release(): a rank of a later run, of any role and worker class."""
        self.worker = worker_cls(*args)


# one Ray actor class for every worker class: the class is an argument, not the process's identity
RemoteWorkerProcess = ray.remote(concurrency_groups={BESIDE: 1})(WorkerProcess)
