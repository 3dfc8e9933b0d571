"""Bad numbers and unsafe defaults: NaN/inf in the losses (nan_policy), Ray's network exposure.

NaN is injected by a test-only worker subclass (tests/fault_workers.py): it fills the advantages of
its update shards with NaN (a reward function cannot produce one: RewardManager already refuses
NaN/inf scores, see tests/test_rewards.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from reliability import runs

GRPO = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False}


def test_nan_abort_names_step_and_metric(ray_session, tiny_model_dir, tmp_path):
    from controllers.worker_group import WorkerError

    overrides = {**GRPO, "actor.dp_size": 1, "trainer.total_steps": 1, "trainer.nan_policy": "abort"}
    with pytest.raises(WorkerError) as info:
        runs.fit(tiny_model_dir, str(tmp_path / "abort"), fault_spec="actor:0:update:1:nan", **overrides)
    message = str(info.value)
    print(f"\nnan_policy=abort -> {message}")
    assert message.startswith("step 1 (of 1): actor rank 0: update raised NonFiniteError"), message
    assert "non-finite gradient norm (nan)" in message and "'actor/pg_loss': nan" in message
    assert "trainer.nan_policy=skip" in message


def test_nan_skip_skips_the_minibatch_and_counts_it(ray_session, tiny_model_dir, tmp_path):
    """FSDP2, dp=2, NaN only in rank 0's shards: the gradient norm is global, so both ranks skip.

    Step 1: both mini-batches poisoned -> 2 skipped, the actor is exactly the initial model and
    its optimizer never stepped. Step 2: mini-batch 1 poisoned -> 1 skipped, mini-batch 0 trains.
    """
    from safetensors.torch import load_file

    from controllers import checkpoint as ckpt

    overrides = {**GRPO, "actor.dp_size": 2, "trainer.total_steps": 2, "trainer.save_freq": 1,
                 "trainer.nan_policy": "skip"}
    base = str(tmp_path / "skip")
    history = runs.fit(tiny_model_dir, base, fault_spec="actor:0:update:1:nan,actor:0:update:2:nan=1", **overrides)
    print(f"\nnan_policy=skip -> skipped per step: {[h['actor/skipped_minibatches'] for h in history]}")
    assert [h["actor/skipped_minibatches"] for h in history] == [2.0, 1.0]
    root = os.path.join(runs.run_dir_of(base), "checkpoints")
    step1 = ckpt._load_model_file(os.path.join(root, "step_1"), "actor/model.safetensors")
    step2 = ckpt._load_model_file(os.path.join(root, "step_2"), "actor/model.safetensors")
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(torch.equal(step1[name], initial[name]) for name in initial), "a skipped mini-batch changed the weights"
    assert all(torch.isfinite(t).all() for t in step2.values())
    assert any(not torch.equal(step2[name], step1[name]) for name in step1), "the clean mini-batch of step 2 did not train"
    optim1 = torch.load(os.path.join(root, "step_1", "actor", "optimizer.pt"), weights_only=True)["optimizer"]
    optim2 = torch.load(os.path.join(root, "step_2", "actor", "optimizer.pt"), weights_only=True)["optimizer"]
    assert optim1["state"] == {}, "no optimizer step may happen on a skipped mini-batch"
    assert {float(s["step"]) for s in optim2["state"].values()} == {1.0}


def test_ray_stays_on_loopback_by_default(monkeypatch):
    """Defaults: no dashboard (so no job server), and its host is 127.0.0.1 when enabled.
    ensure_ray passes them to ray.init (checked without starting a second Ray in this process)."""
    from controllers import cluster
    from rlflow import load_config
    from rlflow.config import to_dataclass

    cfg = to_dataclass(load_config())
    assert cfg.ray.include_dashboard is False and cfg.ray.dashboard_host == "127.0.0.1"
    seen = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: seen.append(kwargs))
    assert cluster.ensure_ray(cfg) is True
    assert seen[-1]["include_dashboard"] is False and seen[-1]["dashboard_host"] == "127.0.0.1"
    # turning the dashboard on keeps it on loopback; another host only when configured
    cluster.ensure_ray(to_dataclass(load_config(overrides=["ray.include_dashboard=true"])))
    assert seen[-1]["include_dashboard"] is True and seen[-1]["dashboard_host"] == "127.0.0.1"
    cluster.ensure_ray(to_dataclass(load_config(overrides=["ray.include_dashboard=true", "ray.dashboard_host=0.0.0.0"])))
    assert seen[-1]["dashboard_host"] == "0.0.0.0"
    # an existing cluster is joined, nothing started
    cluster.ensure_ray(to_dataclass(load_config(overrides=["ray.address=ray://head:10001"])))
    assert seen[-1] == {"address": "ray://head:10001", "log_to_driver": True}
