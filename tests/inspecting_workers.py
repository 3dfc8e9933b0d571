"""Test-only worker subclasses that let a test look inside a running worker (passed in with
PPOTrainer(worker_classes=...)); production workers carry no such methods. Pickled by value: the
Ray workers cannot import tests/."""

from __future__ import annotations

import sys
import time

import ray
import ray.cloudpickle
import torch

from rlflow.protocol import get_meta
from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.process import runs_beside_calls
from workers.rollout.worker import RolloutWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class MetaRecordingCritic(CriticWorker):
    """Keeps the BatchMeta of every shard of its last update."""

    def update(self, shards):
        self.last_seen_meta = [get_meta(shard) for shard in shards]
        return super().update(shards)

    def seen_meta(self):
        return self.last_seen_meta


class InspectableRollout(RolloutWorker):
    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The HF engine's current weights (to check a sync landed)."""
        assert self.engine_name == "hf", "the test reads the hf engine's model"
        return {k: v.detach().cpu().clone() for k, v in self.engine.model.state_dict().items()}


class SlowUpdateActor(ActorWorker):
    """Each update sleeps first (long enough for a tiny rollout to finish beside it) and keeps its
    wall-clock interval."""

    update_sleep_s = 1.5

    def update(self, shards):
        start = time.time()
        time.sleep(self.update_sleep_s)
        result = super().update(shards)
        self.intervals = [*getattr(self, "intervals", []), (start, time.time())]
        return result

    def update_intervals(self) -> list[tuple[float, float]]:
        return getattr(self, "intervals", [])


class _ThreadRecording:
    """Keeps (call, torch threads) for every forward call and every micro-batch of an update: the
    driver's per-phase share of the cores. `first_micro_sleep_s`: the first update's first
    micro-batch sleeps that long after it is recorded (time for a concurrent generation to end)."""

    first_micro_sleep_s = 0.0

    def _record(self, call: str) -> None:
        self.thread_log = [*getattr(self, "thread_log", []), (call, torch.get_num_threads())]

    def threads_seen(self) -> list[tuple[str, int]]:
        return getattr(self, "thread_log", [])

    @runs_beside_calls  # as WorkerBase's: beside the update it widens
    def widen_threads(self, num_threads: int, phase: int) -> None:
        self.widen_log = [*getattr(self, "widen_log", []), num_threads]
        super().widen_threads(num_threads, phase)

    def widens_told(self) -> list[int]:
        """The thread counts of every widen_threads call the driver made, in order."""
        return getattr(self, "widen_log", [])

    def update(self, shards):
        self._micro_index = 0
        self._updates = getattr(self, "_updates", 0) + 1
        return super().update(shards)

    def micro_loss(self, micro, meta):
        self._record("micro")
        if self._micro_index == 0 and self._updates == 1:
            time.sleep(self.first_micro_sleep_s)
        self._micro_index += 1
        return super().micro_loss(micro, meta)


class ThreadRecordingActor(_ThreadRecording, ActorWorker):
    def compute_log_prob(self, batch):
        self._record("compute_log_prob")
        return super().compute_log_prob(batch)


class SlowFirstMicroActor(ThreadRecordingActor):
    first_micro_sleep_s = 1.5


class ThreadRecordingRollout(RolloutWorker):
    """Records its threads per generate, which then sleeps first (so that a generation started
    with the next step's rollout is still running when that step's update begins)."""

    generate_sleep_s = 0.75

    def generate(self, batch, *args, **kwargs):
        self.thread_log = [*getattr(self, "thread_log", []), ("generate", torch.get_num_threads())]
        time.sleep(self.generate_sleep_s)
        return super().generate(batch, *args, **kwargs)

    def threads_seen(self) -> list[tuple[str, int]]:
        return getattr(self, "thread_log", [])


class SharesRecordingRollout(RolloutWorker):
    """Records every share of the cores the driver tells it (set_threads)."""

    def set_threads(self, num_threads: int, phase: int) -> None:
        self.thread_log = [*getattr(self, "thread_log", []), ("set", num_threads)]
        super().set_threads(num_threads, phase)

    def threads_seen(self) -> list[tuple[str, int]]:
        return getattr(self, "thread_log", [])


INSPECTABLE = {"critic": MetaRecordingCritic, "rollout": InspectableRollout}
