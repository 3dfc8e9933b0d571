"""The single controller end to end: real Ray actors, real gloo, the tiny model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer, RLFlow
from rlflow import load_config
from rlflow.protocol import BatchMeta


def test_ppo_dp2_actor_and_critic_receive_driver_metadata(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(
        tiny_model_dir, **{"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2, "trainer.total_steps": 2,
                           "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        assert trainer.cfg.critic.dp_size == 2 and "critic" in trainer.groups
        expected: list[BatchMeta] = []
        original_plan = trainer.plan_minibatches

        def recording_plan(batch, role, step):
            per_rank = original_plan(batch, role, step)
            if role == "critic":
                from rlflow.protocol import get_meta

                expected.extend(get_meta(shard) for shard in per_rank[0])
            return per_rank

        trainer.plan_minibatches = recording_plan
        for step in range(2):
            metrics = trainer.train_step(step)
            assert torch.isfinite(torch.tensor(metrics["critic/vf_loss"]))
            # what each critic rank saw is exactly what the driver computed for the whole mini-batch
            seen = trainer.groups["critic"].call_all("seen_meta")
            assert seen[0] == seen[1] == expected
            for meta in expected:
                assert meta.dp_size == 2 and meta.global_batch_size <= cfg.actor.ppo_mini_batch_size
                assert meta.loss_scale_factor == cfg.data.max_response_length
            expected.clear()
    finally:
        trainer.shutdown()


def test_grpo_starts_no_critic(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "grpo", "trainer.total_steps": 1,
                                                             "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        assert set(trainer.groups) == {"actor", "rollout"}
        metrics = trainer.train_step(0)
        assert not any(k.startswith("critic/") for k in metrics)
        assert "actor/pg_loss" in metrics
    finally:
        trainer.shutdown()


def test_weight_sync_changes_rollout_outputs(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"actor.optim.lr": 0.05, "actor.grad_clip": 100.0,
                                                             "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        from rlflow.data.dataset import collate

        probe = collate(list(trainer.val_dataset)[:4], trainer.val_dataset.pad_token_id).select(
            "input_ids", "attention_mask", "position_ids")
        before = trainer.groups["rollout"].dispatch_dp("generate", probe, 1, False, 0)
        weights_before = trainer.groups["rollout"].call_all("engine_state_dict")[0]
        trainer.train_step(0)
        after = trainer.groups["rollout"].dispatch_dp("generate", probe, 1, False, 0)
        weights_after = trainer.groups["rollout"].call_all("engine_state_dict")[0]
        actor_weights = trainer.groups["actor"].call_all("get_weights")[0]
        changed = [k for k in weights_after if not torch.equal(weights_before[k], weights_after[k])]
        assert changed, "the rollout engine's weights did not change after an update"
        for name, tensor in actor_weights.items():
            assert torch.equal(tensor, weights_after[name]), f"rollout weight {name} differs from the actor's"
        assert not torch.equal(before["responses"], after["responses"]), "greedy outputs unchanged after sync"
    finally:
        trainer.shutdown()


def test_fit_uses_an_already_initialised_ray_and_returns_history(ray_session, tiny_model_dir, tmp_path):
    assert ray_session.is_initialized()
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"trainer.total_steps": 2, "trainer.test_freq": 2,
                                                             "trainer.val_before_train": True,
                                                             "trainer.default_local_dir": str(tmp_path)}))
    history = RLFlow(cfg).fit()
    assert ray_session.is_initialized()  # fit did not shut down the caller's Ray
    assert [h["step"] for h in history] == [0, 1, 2]
    assert "val/score_mean" in history[0] and "val/score_mean" in history[-1]
    for key in ("actor/pg_loss", "critic/vf_loss", "reward/score_mean", "response/length_mean", "timing/gen"):
        assert key in history[1], key
    lines = (tmp_path / "rlflow" / "default" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
