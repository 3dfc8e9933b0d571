"""Test-only worker subclasses, passed in with PPOTrainer(worker_classes=...).

Nothing here ships: the negative controls (a worker that normalises every micro-batch by its own
counts, a worker whose gradient of one tensor is doubled) exist only in tests, so no user config
or environment variable can turn them on. The Ray workers cannot import tests/, so this module is
pickled by value.
"""

from __future__ import annotations

import os
import sys

import ray.cloudpickle
import torch

from workers.actor import ActorWorker
from workers.critic import CriticWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DOUBLED_TENSOR = "model.layers.1.mlp.down_proj.weight"


def initial_weights_path(run_dir: str, role: str) -> str:
    return os.path.join(run_dir, f"initial_{role}.pt")


class RecordInitialWeights:
    """Writes the weights the role starts from (rank 0) next to the run: the tests scale their
    parameter tolerance to the change from these."""

    def init_model(self, model_path: str, total_steps: int) -> int:
        count = super().init_model(model_path, total_steps)
        weights = self.get_weights()  # a collective under FSDP2: every rank calls
        if self.rank == 0:
            os.makedirs(self.cfg.trainer.default_local_dir, exist_ok=True)
            torch.save(weights, initial_weights_path(self.cfg.trainer.default_local_dir, self.role))
        return count


class LocalNormalisation:
    """The bug rlflow prevents (verl #6957): ignore the driver's BatchMeta, so every loss term of
    every micro-batch divides by its own token / sequence count and dp_size is not multiplied back
    (a term given meta None normalises locally, with dp_size 1)."""

    def _loss_meta(self, meta):
        return None


class DoubleOneGradient:
    """One parameter tensor's gradient counted twice (a tied weight reduced twice, one FSDP bucket
    scaled wrong): diluted in the global grad norm, invisible in parameters after Adam."""

    def init_model(self, model_path: str, total_steps: int) -> int:
        count = super().init_model(model_path, total_steps)
        dict(self.model.named_parameters())[DOUBLED_TENSOR].register_hook(lambda grad: grad * 2)
        return count


class RecordingActor(RecordInitialWeights, ActorWorker):
    pass


class RecordingCritic(RecordInitialWeights, CriticWorker):
    pass


class LocalNormActor(LocalNormalisation, RecordingActor):
    pass


class LocalNormCritic(LocalNormalisation, RecordingCritic):
    pass


class DoubledGradientActor(DoubleOneGradient, RecordingActor):
    pass


RECORDING = {"actor": RecordingActor, "critic": RecordingCritic}
LOCAL_NORMALISATION = {"actor": LocalNormActor, "critic": LocalNormCritic}
DOUBLED_GRADIENT = {"actor": DoubledGradientActor, "critic": RecordingCritic}
