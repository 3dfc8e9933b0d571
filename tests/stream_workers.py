"""Test-only rollout worker for partial rollout: a response provably crosses a weight sync.

`WaitsForSync` is the rollout worker whose stream, once every response in flight belongs to the
groups of the second step (uid >= data.train_batch_size) and has tokens already, samples its next
chunk only after the next weight load: the first step trains on the other groups, its sync lands,
and those responses go on under the new weights. The Ray workers cannot import tests/, so this
module is pickled by value.
"""

from __future__ import annotations

import sys
import time

import ray.cloudpickle

from workers.rollout.worker import RolloutWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class WaitsForSync(RolloutWorker):
    def stream_open(self, version, max_rows, seed):
        super().stream_open(version, max_rows, seed)
        stream, runner = self._stream.stream, self._stream
        first_step_groups = self.cfg.data.train_batch_size
        step, held = stream.step, {"done": False}

        def step_after_a_sync(version, guard=None, pause=None):
            rows = list(stream.active)
            if (not held["done"] and rows and all(row.group >= first_step_groups and row.tokens for row in rows)):
                held["done"] = True
                self._engine_lock.lock.release()  # let the sync in
                try:
                    deadline = time.monotonic() + 60
                    while runner.version == version and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    self._engine_lock.lock.acquire()
                version = runner.version
            step(version, guard, pause)

        stream.step = step_after_a_sync
