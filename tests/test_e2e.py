"""The single controller end to end: real Ray actors, real gloo, the tiny model."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer, RLFlow
from controllers.rollout_source import read_recorded, recorded_steps
from inspecting_workers import INSPECTABLE
from trainers import CapturingTrainer
from rlflow import load_config
from rlflow.protocol import BatchMeta

# the default setup's reward pool (tiny_overrides scores in the driver), in the fits about it
REWARD_POOL = {"reward.num_workers": 2}


def test_ppo_dp2_actor_and_critic_receive_driver_metadata(ray_session, tiny_model_dir, tmp_path):
    cfg = load_config(None, tiny_overrides(
        tiny_model_dir, **{"actor.dp_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2, "trainer.total_steps": 2,
                           "trainer.default_local_dir": str(tmp_path), **REWARD_POOL}))
    trainer = PPOTrainer(cfg, worker_classes=INSPECTABLE)
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
        # FSDP2's gathered weights reached the rollout engine through the shared-memory file
        assert trainer.weight_sync == "shared_memory"
        actor_weights = trainer.groups["actor"].call_all("get_weights")[0]
        rollout_weights = trainer.groups["rollout"].call_all("engine_state_dict")[0]
        assert all(torch.equal(tensor, rollout_weights[name]) for name, tensor in actor_weights.items())
    finally:
        trainer.shutdown()


# the policy loss's own statistic, which shows it ran in the actor (vanilla reports the common four only)
OWN_POLICY_METRIC = {"vanilla": None, "cispo": "actor/pg_is_weight_mean", "sapo": "actor/pg_gate_weight_mean"}


@pytest.mark.parametrize("policy_loss", sorted(OWN_POLICY_METRIC))
def test_grpo_starts_no_critic(ray_session, tiny_model_dir, tmp_path, policy_loss):
    """One GRPO step, no critic, with each policy loss; two mini-batches of 8, so the second one's
    ratio is off 1 (cispo's weight and sapo's gate act on it)."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "grpo", "trainer.total_steps": 1,
                                                             "trainer.default_local_dir": str(tmp_path),
                                                             "actor.policy_loss": policy_loss}))
    trainer = PPOTrainer(cfg)
    assert not trainer.update_is_on_policy(16)
    trainer.setup()
    try:
        assert set(trainer.groups) == {"actor", "rollout"}
        metrics = trainer.train_step(0)
        assert not any(k.startswith("critic/") for k in metrics)
        assert math.isfinite(metrics["actor/pg_loss"])
        own = OWN_POLICY_METRIC[policy_loss]
        if own is not None:
            assert 0 < metrics[own] <= 2.0, metrics[own]  # a weight near 1: the update moved the policy a little
    finally:
        trainer.shutdown(keep_workers=True)  # the next test of this layout takes the processes


def _weight_share_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("rlflow-weights-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("mode", ["shared_memory", "object_store"])
def test_weight_sync_changes_rollout_outputs(ray_session, tiny_model_dir, tmp_path, mode):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"actor.optim.lr": 0.05, "actor.grad_clip": 100.0,
                                                             "rollout.weight_sync": mode,
                                                             "trainer.default_local_dir": str(tmp_path)}))
    files_before = _weight_share_files()
    trainer = PPOTrainer(cfg, worker_classes=INSPECTABLE)
    trainer.setup()
    try:
        assert trainer.weight_sync == mode
        # the shared file is unlinked once mapped: its name is gone while the workers still run
        assert _weight_share_files() == files_before
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
        trainer.shutdown(keep_workers=True)  # the next test of this layout takes the processes


def test_fit_uses_an_already_initialised_ray_and_returns_history(ray_session, tiny_model_dir, tmp_path):
    assert ray_session.is_initialized()
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"trainer.total_steps": 2, "trainer.test_freq": 2,
                                                             "trainer.val_before_train": True,
                                                             "trainer.default_local_dir": str(tmp_path), **REWARD_POOL}))
    history = RLFlow(cfg).fit()
    assert ray_session.is_initialized()  # fit did not shut down the caller's Ray
    assert [h["step"] for h in history] == [0, 1, 2]
    assert "val/score_mean" in history[0] and "val/score_mean" in history[-1]
    for key in ("actor/pg_loss", "critic/vf_loss", "reward/score_mean", "response/length_mean", "timing/gen"):
        assert key in history[1], key
    lines = (tmp_path / "rlflow" / "default" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]


def _one_on_policy_grpo_step(tmp_path, model_dir, name: str, skip: bool,
                             worker_classes: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    # 8 prompts x n=2 = 16 responses, one mini-batch of 16, one epoch: one optimizer step per rollout
    cfg = load_config(None, tiny_overrides(model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.ppo_mini_batch_size": 16, "trainer.total_steps": 1,
        "trainer.deterministic": True, "actor.skip_old_log_prob_when_on_policy": skip,
        "trainer.default_local_dir": str(tmp_path / name)}))
    trainer = CapturingTrainer(cfg, worker_classes=worker_classes)
    history = trainer.fit()
    return history[-1], trainer.final_weights["actor"]


def test_on_policy_update_skips_the_old_log_prob_forward(ray_session, tiny_model_dir, tmp_path):
    from fault_workers import faulty_workers

    recomputed, recomputed_weights = _one_on_policy_grpo_step(tmp_path, tiny_model_dir, "recompute", skip=False)
    # any call of the actor's compute_log_prob now raises in the worker: the run must not make one
    skipped, skipped_weights = _one_on_policy_grpo_step(
        tmp_path, tiny_model_dir, "skip", skip=True, worker_classes=faulty_workers("actor:*:compute_log_prob:*:raise"))
    # the update's own detached log-probs: the ratio is exactly 1, nothing is clipped
    assert skipped["actor/ppo_kl"] == 0.0 and skipped["actor/pg_clipfrac"] == 0.0
    # the recomputed forward differs from the update's only by float rounding
    assert abs(recomputed["actor/ppo_kl"]) < 1e-6
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert skipped[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key
    for name, value in skipped_weights.items():
        torch.testing.assert_close(value, recomputed_weights[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kl_in_reward_keeps_the_old_log_prob_forward(tiny_model_dir):
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.ppo_mini_batch_size": 16, "algorithm.use_kl_in_reward": True}))
    trainer = PPOTrainer(cfg)
    assert not trainer.update_is_on_policy(16)  # the driver needs old log-probs for the reward's KL
    assert PPOTrainer(load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.ppo_mini_batch_size": 16}))).update_is_on_policy(16)
    assert not PPOTrainer(load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.ppo_mini_batch_size": 8}))).update_is_on_policy(16)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"])
def test_every_advantage_estimator_runs_three_steps(ray_session, tiny_model_dir, tmp_path, estimator):
    """The driver gives each estimator the inputs it declares (rlflow.algos.estimator_inputs): the
    critic's values for gae, the group index for grpo/rloo, the greedy response's score for remax."""
    from rlflow.algos import NEEDS_CRITIC

    record = str(tmp_path / "rollouts")
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": estimator, "trainer.total_steps": 3, "trainer.default_local_dir": str(tmp_path),
        "trainer.record_rollouts": record}))
    trainer = PPOTrainer(cfg)
    history = trainer.fit()
    steps = [h for h in history if "actor/pg_loss" in h]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in steps)
    assert all(("critic/vf_loss" in h) == (estimator in NEEDS_CRITIC) for h in steps)
    recorded = {step: read_recorded(record, step) for step in sorted(recorded_steps(record))}
    assert sorted(recorded) == [0, 1, 2] and [r.weight_version for r in recorded.values()] == [0, 1, 2]
    recorded = {step: rollout.batch for step, rollout in recorded.items()}
    for step in recorded.values():  # the engine's log-probs of its tokens travel with the batch
        mask = step["response_mask"] != 0
        assert torch.all(step["rollout_log_probs"][mask] < 0) and torch.all(step["rollout_log_probs"][~mask] == 0)
    if estimator == "remax":
        for step in recorded.values():
            baselines = step["reward_baselines"].reshape(-1, cfg.rollout.n)
            # one greedy score per prompt, shared by its samples
            assert torch.equal(baselines, baselines[:, :1].expand_as(baselines))
    else:
        assert all("reward_baselines" not in step.keys() for step in recorded.values())
