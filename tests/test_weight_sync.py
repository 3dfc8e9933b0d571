"""rollout.weight_sync=collective (workers/weight_collective.py): actor rank 0 broadcasts its
weights in buckets over a process group of its own (gloo here) into every rollout rank."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer
from inspecting_workers import INSPECTABLE
from rlflow import load_config
from text_rewards import REWARD_FILE
from trainers import CapturingTrainer
from workers.weight_collective import bucket_views, plan_buckets


# a reward that varies with the text: GRPO's advantages are not all zero, so an update moves the weights
VARIED_REWARD = {"reward.custom_function.path": REWARD_FILE, "reward.custom_function.name": "exactness_score"}


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=gen),  # 128 bytes
        "norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "layer.weight": torch.randn(4, 4, generator=gen),  # 64 bytes
        "head.weight": torch.randn(2, 4, generator=gen),  # 32 bytes
        "steps": torch.tensor([3, 1, 4], dtype=torch.int64),
    }


def test_weight_sync_buckets_group_dtypes_and_respect_the_size():
    state = _state()
    layout = plan_buckets(state, bucket_bytes=100)
    dtypes = [bucket.dtype for bucket in layout.buckets]
    # float32 in state order: embed (128 > 100: alone), then layer + head (96), then bf16, int64
    assert dtypes == ["torch.float32", "torch.float32", "torch.bfloat16", "torch.int64"]
    assert [[e.name for e in b.entries] for b in layout.buckets] == [
        ["embed.weight"], ["layer.weight", "head.weight"], ["norm.weight"], ["steps"]]
    assert layout.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    # a bucket's views hold each tensor exactly
    for bucket in layout.buckets:
        flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype)
        for name, view in bucket_views(flat, bucket).items():
            view.copy_(state[name])
        assert all(torch.equal(view, state[name]) for name, view in bucket_views(flat, bucket).items())
    layout.check(state)
    with pytest.raises(ValueError, match=r"rollout.weight_sync=collective.*missing \['steps'\]"):
        layout.check({k: v for k, v in state.items() if k != "steps"})
    with pytest.raises(ValueError, match=r"head.weight is \(2, 4\) torch.float16"):
        layout.check({**state, "head.weight": state["head.weight"].half()})


def test_weight_sync_collective_lands_bitwise_on_every_rollout_rank(ray_session, tiny_model_dir, tmp_path):
    """FSDP2 over two actor ranks (the full state is their collective) and two rollout ranks, small
    buckets (several per dtype): after an update every rollout engine holds the actor's weights."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.dp_size": 2, "rollout.dp_size": 2, "trainer.total_steps": 1,
        "actor.ppo_micro_batch_size_per_gpu": 2, "actor.optim.lr": 0.05, "actor.grad_clip": 100.0,
        "rollout.weight_sync": "collective", "rollout.weight_sync_bucket_mb": 1,
        **VARIED_REWARD, "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg, worker_classes=INSPECTABLE)
    trainer.setup()
    try:
        assert trainer.weight_sync == "collective"
        before = trainer.groups["rollout"].call_all("engine_state_dict")[0]
        trainer.train_step(0)
        actor = trainer.groups["actor"].call_all("get_weights")[0]
        assert any(not torch.equal(actor[k], before[k]) for k in actor), "the update changed nothing"
        for rank, engine in enumerate(trainer.groups["rollout"].call_all("engine_state_dict")):
            for name, tensor in actor.items():
                assert tensor.dtype == engine[name].dtype and torch.equal(tensor, engine[name]), (rank, name)
        # a second sync reuses the group and the buckets
        trainer.sync_weights()
    finally:
        trainer.shutdown()


def _grpo_fit(tmp_path, model_dir, mode: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = load_config(None, tiny_overrides(model_dir, **{
        "algorithm.adv_estimator": "grpo", "trainer.total_steps": 2, "trainer.deterministic": True,
        "actor.optim.lr": 0.01, "rollout.weight_sync": mode, **VARIED_REWARD,
        "trainer.default_local_dir": str(tmp_path / mode)}))
    trainer = CapturingTrainer(cfg)
    history = trainer.fit()
    assert trainer.weight_sync == mode
    return history, trainer.final_weights["actor"]


def test_weight_sync_collective_fit_equals_shared_memory(ray_session, tiny_model_dir, tmp_path):
    """A deterministic 2-step GRPO fit: the step-2 rollout comes from the synced weights, so any
    difference in what the engine received shows in its metrics."""
    shared, shared_weights = _grpo_fit(tmp_path, tiny_model_dir, "shared_memory")
    collective, collective_weights = _grpo_fit(tmp_path, tiny_model_dir, "collective")
    assert len(shared) == len(collective) == 2
    for a, b in zip(shared, collective):
        keys = {k for k in a if not k.startswith(("timing/", "memory/"))}
        assert keys == {k for k in b if not k.startswith(("timing/", "memory/"))}
        for key in keys:
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), (a["step"], key, a[key], b[key])
    assert shared_weights.keys() == collective_weights.keys()
    assert all(torch.equal(shared_weights[k], collective_weights[k]) for k in shared_weights)
