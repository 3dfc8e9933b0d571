"""Long runs: going on after a lost worker, stopping cleanly when told to, saving beside the steps.

Recovery (trainer.max_failures > 0). A worker lost mid-step (its process died, or a call hung past
trainer.remote_timeout_s: WorkerError.lost_worker) stops the step; the driver stops the lost
roles' groups and starts them again (Ray places them where there is room: on other nodes when one
is gone); the other groups drop what they built and host their roles again in the same processes
(or stop and start too, when they cannot: still busy after RELEASE_WAIT_S, say in a collective
with a lost peer). Then it restores the newest restore point and runs again from its step.
Restore points, newest wins:
- the run's start (step 0: the workers as they start, the driver's state; a resumed run's start is
  the checkpoint it resumed from),
- every checkpoint this run saved,
- an in-memory snapshot every trainer.snapshot_freq steps (the trained roles' full state in the
  driver's memory: as much as a checkpoint holds, without the disk).
A restored run repeats the lost steps exactly as they ran (the checkpoint resume rule), so with
trainer.deterministic it ends as the run without the fault would have. An exception a worker raised
(a bug, bad data, NaN) is not recovered from: a restart would raise it again. Every recovery is a
line on stderr and in <run_dir>/recoveries.jsonl (role, rank, call, cause, the step lost, the
step restored, seconds), and trainer/recoveries counts them in every step's metrics. A checkpoint
that cannot be written (a full disk) counts as a failure too: the run goes on without it.

Preemption. SIGTERM or SIGINT to the driver (`ray job stop` sends SIGTERM) lets the running step
finish, saves a checkpoint of it and stops fit() with a line saying how to resume; the command
exits 0. A second signal stops at once (SIGINT: KeyboardInterrupt, SIGTERM: SystemExit(143)).

Asynchronous saving (trainer.async_save). The state is collected at the step boundary, as for a
synchronous save; writing it (files, fsync, checksums, the atomic rename and `latest`) runs in a
thread while the next steps train. A save waits for the one before it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from controllers import checkpoint
from controllers.worker_group import WorkerError

RECOVERIES_FILE = "recoveries.jsonl"


class Recovery:
    """The restore points of a fit and what it does when a worker is lost."""

    def __init__(self, cfg, run_dir: str):
        self.cfg = cfg
        self.max_failures = cfg.trainer.max_failures
        self.snapshot_freq = cfg.trainer.snapshot_freq
        self.failures = 0
        self.log_path = os.path.join(run_dir, RECOVERIES_FILE)
        self.point: checkpoint.Snapshot | str | None = None  # a snapshot in memory, or a checkpoint folder
        self.point_step = -1
        self.phases: dict[str, float] = {}  # the last restart's seconds: stop, start, restore

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    def metrics(self) -> dict:
        return {"trainer/recoveries": float(self.failures)} if self.enabled else {}

    # -- restore points ------------------------------------------------------------------------
    def started(self, trainer, step: int) -> None:
        """The run's first restore point: the checkpoint it resumed from, or its start."""
        if not self.enabled:
            return
        if trainer.resumed_from is not None:
            self._keep(trainer.resumed_from, step)
        else:
            self._keep(checkpoint.collect(trainer, step, workers=False), step)

    def snapshot_due(self, steps_done: int) -> bool:
        return self.enabled and self.snapshot_freq > 0 and steps_done % self.snapshot_freq == 0

    def snapshotted(self, snapshot: checkpoint.Snapshot) -> None:
        self._keep(snapshot, snapshot.step)

    def saved(self, folder: str, steps_done: int) -> None:
        """A checkpoint of this run is on disk: it replaces an older restore point (a snapshot's memory
        goes with it); a snapshot of the same step is kept (restored without reading the disk)."""
        if self.enabled and (steps_done > self.point_step
                             or (steps_done == self.point_step and not isinstance(self.point, checkpoint.Snapshot))):
            self._keep(folder, steps_done)

    def describe_point(self) -> str:
        if isinstance(self.point, str):
            return self.point
        return "the run's start" if self.point.roles is None else "the snapshot in memory"

    def _keep(self, point, step: int) -> None:
        self.point, self.point_step = point, step

    # -- failures ------------------------------------------------------------------------------
    def save_failed(self, err: checkpoint.SaveError, steps_done: int) -> None:
        """A checkpoint could not be written: the run goes on without it while failures are left."""
        if self.failures >= self.max_failures:
            raise err
        self.failures += 1
        self._log({"step": steps_done, "cause": "save", "error": str(err), "restored_step": None, "seconds": 0.0})
        print(f"rlflow: {err}; the run goes on without it (failure {self.failures} of trainer.max_failures="
              f"{self.max_failures})", file=sys.stderr, flush=True)

    def recover(self, trainer, step: int, err: WorkerError) -> int:
        """After a lost worker in step (0-based): restart and restore; returns the step to run next.
        Raises the error (naming the step) when it cannot: not a lost worker, or no failures left."""
        total = self.cfg.trainer.total_steps
        named = f"step {step + 1} (of {total}): {err}"
        if not (self.enabled and err.lost_worker) or self.failures >= self.max_failures:
            used = f"; trainer.max_failures={self.max_failures} recoveries used" if self.failures else ""
            raise WorkerError(named + used, call=err.call, cause=err.cause, lost_worker=err.lost_worker,
                              lost_roles=err.lost_roles) from err
        detected = time.time()
        trainer.wait_for_save()  # a checkpoint still being written may be the newest restore point
        lost_roles = err.lost_roles
        while True:
            self.failures += 1
            source = self.describe_point()
            print(f"rlflow: {named.splitlines()[0]}; restarting the workers and going on from step "
                  f"{self.point_step} ({source}) (failure {self.failures} of trainer.max_failures={self.max_failures})",
                  file=sys.stderr, flush=True)
            try:
                restored = self._restart(trainer, lost_roles)
                break
            except WorkerError as again:
                if not again.lost_worker or self.failures >= self.max_failures:
                    raise WorkerError(f"{named}; then restarting the workers failed: {again}", call=again.call,
                                      cause=again.cause, lost_worker=again.lost_worker,
                                      lost_roles=again.lost_roles) from again
                named, lost_roles = f"restarting after step {step + 1}: {again}", again.lost_roles
        seconds = time.time() - detected
        call = err.call
        self._log({"step": step + 1, "role": call.role if call else None, "rank": call.rank if call else None,
                   "call": call.method if call else None, "cause": err.cause, "error": str(err).splitlines()[0],
                   "restored_step": restored, "restored_from": source, "detected": detected, "seconds": seconds,
                   **self.phases})
        print(f"rlflow: recovered in {seconds:.1f} s; running step {restored + 1} again", file=sys.stderr, flush=True)
        return restored

    def _restart(self, trainer, lost_roles) -> int:
        """Stop the lost roles' groups, release the others (those that cannot stop too), start, restore;
        the seconds of each and the roles whose processes were kept go in self.phases."""
        clock = time.monotonic()
        kept, stopped = trainer.release_worker_groups(lost_roles)
        self.phases = {"stop_s": time.monotonic() - clock, "kept": sorted(kept)}
        clock = time.monotonic()
        trainer.start_workers(kept, stopped)
        self.phases["start_s"] = time.monotonic() - clock
        clock = time.monotonic()
        snapshot = checkpoint.read(self.point, self.cfg) if isinstance(self.point, str) else self.point
        restored = checkpoint.restore(trainer, snapshot)
        self.phases["restore_s"] = time.monotonic() - clock
        return restored

    def _log(self, record: dict) -> None:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")


class Preemption:
    """While fit's steps run (in the main thread; from arm() to the end of the with block): the first
    SIGTERM / SIGINT asks for a stop at the next step boundary; a second one stops at once. Before
    arm() (the workers starting) a signal does what it did before."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> "Preemption":
        return self

    def arm(self) -> None:
        """Take the signals over; after Ray has started (ray.init sets its own SIGTERM handler)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous.setdefault(sig, signal.signal(sig, self._handle))

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            print(f"rlflow: {name}: the run stops after this step, with a checkpoint of it (a second signal stops "
                  "at once)", file=sys.stderr, flush=True)
            return
        self._restore()
        print(f"rlflow: {name} again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


class AsyncSaver:
    """Writes collected snapshots in a thread, one at a time; the driver's thread learns how each
    write ended from finished()."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._result: tuple[int, str | None, BaseException | None] | None = None

    def submit(self, snapshot: checkpoint.Snapshot, run_dir: str, cfg, model_path) -> None:
        def run():
            try:
                self._result = (snapshot.step, checkpoint.write(snapshot, run_dir, cfg, model_path), None)
            except BaseException as err:  # noqa: BLE001 - handed to the driver's thread
                self._result = (snapshot.step, None, err)

        self._thread = threading.Thread(target=run, name=f"rlflow-save-step_{snapshot.step}", daemon=True)
        self._thread.start()

    def finished(self, wait: bool) -> tuple[int, str] | None:
        """(step, folder) of a write that ended since the last call (None: none; wait: waits for the
        one in progress); a failed write raises its error here."""
        if self._thread is None or (not wait and self._thread.is_alive()):
            return None
        self._thread.join()
        self._thread = None
        step, folder, err = self._result
        self._result = None
        if err is not None:
            raise err
        return step, folder
