"""Test-only worker subclasses, passed in with PPOTrainer(worker_classes=...).

Nothing here ships: the negative controls (a worker that normalises every micro-batch by its own
counts, a worker whose gradient of one tensor is doubled) exist only in tests, so no user config
or environment variable can turn them on. The Ray workers cannot import tests/, so this module is
pickled by value.
"""

from __future__ import annotations

import os
import sys

import dataclasses

import ray.cloudpickle
import torch

from workers.actor import ActorWorker
from workers.critic import CriticWorker
from workers.sequence import SequenceLayout, pack_micro_batch

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


class SpLocalNormalisation:
    """The sequence-parallel form of the bug (verl #2857, DeepSpeed #5248): each sp rank divides its
    loss by the counts of the response tokens its own slice of the packed row predicts, instead of
    the driver's BatchMeta."""

    def micro_loss(self, micro, meta):
        packed = pack_micro_batch(micro, self.sequence_parallel)
        mask = micro["response_mask"][packed.rows, packed.columns] > 0
        local = dataclasses.replace(meta, batch_num_tokens=int(mask.sum()),
                                    global_batch_size=int(packed.rows[mask].unique().numel()))
        return super().micro_loss(micro, local)


class _UnreducedLayout(SequenceLayout):
    """Gathers the sp ranks' outputs (an all-reduce) but leaves out the all-reduce of their
    gradient in the backward: each rank keeps only its own loss's share of its slice's gradient."""

    def gather(self, values, packed, shape):
        full = super().gather(values, packed, shape)
        local = values.new_zeros(shape).index_put((packed.rows, packed.columns), values)
        return local + (full - local).detach()


class SpUnreducedGradient:
    def sequence_layout(self, model):
        layout = super().sequence_layout(model)
        return _UnreducedLayout(layout.packs, layout.sp)


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


class SpLocalNormActor(SpLocalNormalisation, RecordingActor):
    pass


class SpLocalNormCritic(SpLocalNormalisation, RecordingCritic):
    pass


class SpUnreducedActor(SpUnreducedGradient, RecordingActor):
    pass


class SpUnreducedCritic(SpUnreducedGradient, RecordingCritic):
    pass


RECORDING = {"actor": RecordingActor, "critic": RecordingCritic}
LOCAL_NORMALISATION = {"actor": LocalNormActor, "critic": LocalNormCritic}
DOUBLED_GRADIENT = {"actor": DoubledGradientActor, "critic": RecordingCritic}
SP_LOCAL_NORMALISATION = {"actor": SpLocalNormActor, "critic": SpLocalNormCritic}
SP_UNREDUCED_GRADIENT = {"actor": SpUnreducedActor, "critic": SpUnreducedCritic}
