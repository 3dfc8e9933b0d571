"""Gradient checkpointing (actor.model.gradient_checkpointing, critic.model.gradient_checkpointing)
changes what is stored for the backward, not the gradient: real fits (Ray workers, gloo, the tiny
model) replaying one recorded rollout take bitwise the same gradient at every optimizer step (the
gradient probes), log the same metrics and end at the same weights with and without it, for the
actor and the critic, on one rank, under FSDP2 and under DDP at dp=2.

Bitwise, because nothing in the arithmetic changes: transformers' checkpointing (use_reentrant=False)
recomputes each decoder layer's forward in the backward with the same ops on the same inputs, and
the CPU kernels are deterministic (trainer.deterministic). A test-only worker counts the decoder
layers that went through the checkpoint function in each update, so a setting that silently does
nothing (eval mode, a wrapper that drops the flag) fails here.
"""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle

import exactness_workers
from exactness_helpers import build_varied_length_model, compare_fits, run_fit
from rlflow.metrics import Aggregation, Metric
from workers.actor import ActorWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHECKPOINTED = "checkpointed_layer_calls"  # <role>/<this>: decoder layers run under checkpoint
ENABLED = "gradient_checkpointing"  # <role>/<this>: the HF model's is_gradient_checkpointing

# token-mean actor and critic with plain SGD (a gradient error is a parameter error), 2 steps of
# 2 mini-batches x 2 epochs: 8 optimizer steps per role
FAMILY = {"actor.loss_agg_mode": "token-mean", "critic.loss_agg_mode": "token-mean", "trainer.total_steps": 2,
          "actor.optim.name": "sgd", "critic.optim.name": "sgd", "actor.optim.lr": 0.05, "critic.optim.lr": 0.005}
CHECKPOINTING = {"actor.model.gradient_checkpointing": True, "critic.model.gradient_checkpointing": True}
LAYOUTS = {
    "dp1": {"actor.ppo_micro_batch_size_per_gpu": 4},
    # (DDP takes the same checkpointing path in the model; measured bitwise too, left out for time)
    "fsdp2": {"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2},
}


class CountCheckpointedLayers:
    """Reports, per update, how many decoder-layer forwards ran through the model's checkpoint
    function, and whether the HF model says checkpointing is on."""

    def init_model(self, model_path: str, total_steps: int) -> int:
        count = super().init_model(model_path, total_steps)
        self.checkpointed = 0
        for module in self.model.modules():
            if getattr(module, "gradient_checkpointing", False):
                module._gradient_checkpointing_func = self._counting(module._gradient_checkpointing_func)
        return count

    def _counting(self, checkpoint):
        def counted(*args, **kwargs):
            self.checkpointed += 1
            return checkpoint(*args, **kwargs)

        return counted

    def update(self, shards):
        before = self.checkpointed
        per_minibatch = super().update(shards)
        hf_model = getattr(self.model, "module", self.model)  # under DDP, the wrapped model
        per_minibatch[-1].append({
            f"{self.section}/{CHECKPOINTED}": Metric(float(self.checkpointed - before), Aggregation.SUM),
            f"{self.section}/{ENABLED}": Metric(float(hf_model.is_gradient_checkpointing), Aggregation.MIN),
        })
        return per_minibatch


class CountingActor(CountCheckpointedLayers, exactness_workers.RecordingActor):
    pass


class CountingCritic(CountCheckpointedLayers, exactness_workers.RecordingCritic):
    pass


class CountingInProcessActor(CountCheckpointedLayers, ActorWorker):
    pass


COUNTING = {"actor": CountingActor, "critic": CountingCritic}


@pytest.fixture(scope="module")
def recording(ray_session, tmp_path_factory):
    """(model folder, the generating fit without checkpointing, its recorded rollout folder)."""
    model_dir = build_varied_length_model(str(tmp_path_factory.mktemp("gc_model")))
    record = str(tmp_path_factory.mktemp("gc_rollouts") / "record")
    fit = run_fit(model_dir, str(tmp_path_factory.mktemp("gc_run")), workers=COUNTING,
                  **{**FAMILY, **LAYOUTS["dp1"], "trainer.record_rollouts": record})
    return model_dir, fit, record


def replay(recording, tmp_path_factory, layout: str, checkpointing: bool):
    model_dir, _, record = recording
    overrides = {**FAMILY, **LAYOUTS[layout], "trainer.replay_rollouts": record,
                 **(CHECKPOINTING if checkpointing else {})}
    return run_fit(model_dir, str(tmp_path_factory.mktemp("gc_run")), workers=COUNTING, **overrides)


def check_checkpointing(fit, on: bool) -> None:
    for role in ("actor", "critic"):
        counts = [h[f"{role}/{CHECKPOINTED}"] for h in fit.steps()]
        enabled = [h[f"{role}/{ENABLED}"] for h in fit.steps()]
        if on:  # 4 decoder layers, at least one micro-batch per update on each rank
            assert min(counts) >= 4 and enabled == [1.0] * len(enabled), (role, counts, enabled)
        else:
            assert counts == [0.0] * len(counts) and enabled == [0.0] * len(enabled), (role, counts, enabled)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_are_bitwise_equal_with_and_without_checkpointing(recording, tmp_path_factory, layout):
    # the generating fit is the dp1 fit without checkpointing (replaying its recording reproduces it
    # bit for bit: tests/test_exactness.py::test_replay_reproduces_the_recorded_run)
    without = recording[1] if layout == "dp1" else replay(recording, tmp_path_factory, layout, checkpointing=False)
    with_checkpointing = replay(recording, tmp_path_factory, layout, checkpointing=True)
    check_checkpointing(without, on=False)
    check_checkpointing(with_checkpointing, on=True)
    diff = compare_fits(without, with_checkpointing, bitwise=True)
    print(f"{layout}: without vs with gradient checkpointing (bitwise): {diff.line()}; "
          f"{without.seconds:.1f} s vs {with_checkpointing.seconds:.1f} s")
    assert diff.num_probes > 0
    assert not diff.failures, diff.failures[:10]


def test_lora_gradients_are_bitwise_equal_with_checkpointing(tiny_model_dir):
    """In process (one rank, no Ray): with LoRA the decoder layers' inputs need no gradient (the
    embeddings are frozen), yet the adapters inside the checkpointed layers get exactly the same
    gradient as without checkpointing."""
    import torch

    from conftest import tiny_overrides
    from rlflow import load_config

    def adapter_gradients(checkpointing: bool) -> tuple[dict, int]:
        worker = object.__new__(CountingInProcessActor)  # WorkerBase.__init__ would seed the process
        overrides = {"actor.lora.rank": 4, "actor.model.gradient_checkpointing": checkpointing}
        worker.cfg = load_config(None, tiny_overrides(tiny_model_dir, **overrides))
        worker.rank, worker.world_size, worker.device = 0, 1, torch.device("cpu")
        worker.init_model(tiny_model_dir, 10)
        worker.model.train()
        ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
        worker.model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
        grads = {name: p.grad for name, p in worker.model.named_parameters() if p.requires_grad}
        return grads, worker.checkpointed

    plain, no_calls = adapter_gradients(False)
    checkpointed, calls = adapter_gradients(True)
    assert no_calls == 0 and calls == 4  # one forward through the 4 decoder layers
    assert plain.keys() == checkpointed.keys() and len(plain) == 2 * 4 * 7
    assert all(g is not None for g in checkpointed.values())
    assert sum(float(g.norm()) for g in checkpointed.values()) > 0
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)
