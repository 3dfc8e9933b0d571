"""A completed run parks its worker processes (controllers/worker_group.py, IdleWorkers): a later
run in the driver takes the groups of the roles it shares with it (on one node without GPUs, role by
role) and trains exactly as on new processes; a run that cannot reserve its placement while they
wait stops them; a failed run or trainer.keep_workers_s=0 parks nothing."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from conftest import tiny_overrides
from controllers.worker_group import IDLE_WORKERS, WorkerError
from trainers import CapturingTrainer

STEPS = 2


class PidTrainer(CapturingTrainer):
    """self.pids: {role: [the process id of each rank]}, read during the first step."""

    def train_step(self, step: int) -> dict:
        if step == 0:
            self.pids = {role: ray.get([w.__ray_call__.remote(lambda _: os.getpid()) for w in group.workers])
                         for role, group in self.groups.items()}
        return super().train_step(step)


def _fit(model_dir, out, **extra):
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(model_dir, **{
        "algorithm.adv_estimator": "grpo", "reward.num_workers": 0, "trainer.total_steps": STEPS,
        "trainer.deterministic": True, "trainer.default_local_dir": str(out), **extra}))
    trainer = PidTrainer(cfg)
    return trainer, trainer.fit()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _all_exit(pids, within_s: float = 20.0) -> bool:
    """ray.kill returns before the process is gone: poll until every pid has exited."""
    deadline = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _same_run(a, b):
    keys = [k for k in a[1][0] if not k.startswith(("timing/", "perf/", "memory/"))]
    assert [[h[k] for k in keys] for h in a[1]] == [[h[k] for k in keys] for h in b[1]]
    for role, weights in a[0].final_weights.items():
        assert all(torch.equal(weights[name], b[0].final_weights[role][name]) for name in weights), role


def test_a_later_run_takes_the_groups_of_the_roles_it_shares_and_trains_exactly(ray_session, tiny_model_dir, tmp_path):
    IDLE_WORKERS.stop()
    first = _fit(tiny_model_dir, tmp_path / "a")
    second = _fit(tiny_model_dir, tmp_path / "b")
    assert second[0].pids == first[0].pids, "the second run ran on the first run's processes"
    _same_run(first, second)

    # a critic joins: the run takes the actor's and the rollout's processes, starts a critic beside
    # them (in a placement group of its own), and trains exactly as a run on new processes does
    third = _fit(tiny_model_dir, tmp_path / "c", **{"algorithm.adv_estimator": "gae"})
    grpo_pids = [pid for pids in first[0].pids.values() for pid in pids]
    assert {role: pids for role, pids in third[0].pids.items() if role != "critic"} == first[0].pids
    assert not set(third[0].pids["critic"]) & set(grpo_pids)
    fourth = _fit(tiny_model_dir, tmp_path / "d")
    assert fourth[0].pids == first[0].pids
    _same_run(first, fourth)
    critic_pids = third[0].pids["critic"]
    IDLE_WORKERS.stop()
    assert _all_exit(grpo_pids + critic_pids)
    fresh = _fit(tiny_model_dir, tmp_path / "f", **{"algorithm.adv_estimator": "gae"})
    assert not set(pid for pids in fresh[0].pids.values() for pid in pids) & set(grpo_pids + critic_pids)
    _same_run(third, fresh)

    # a run whose placement group does not fit beside the parked groups (one bundle of 2 roles
    # taking all but 0.5 of the session's CPUs; the parked pools hold 1.5) stops them
    fresh_pids = [pid for pids in fresh[0].pids.values() for pid in pids]
    cpus = float(ray.cluster_resources()["CPU"])
    big = _fit(tiny_model_dir, tmp_path / "e", **{"trainer.cpus_per_worker": (cpus - 0.5) / 2})
    assert _all_exit(fresh_pids), "the parked groups stopped for the run that needed their CPUs"
    IDLE_WORKERS.stop()
    assert _all_exit([pid for pids in big[0].pids.values() for pid in pids])


def test_roles_park_apart_on_one_node_without_gpus_and_together_elsewhere(ray_session, tiny_model_dir, monkeypatch):
    """Colocated roles share their bundles' GPUs and nodes: there a run takes a whole layout or
    nothing (no GPU cluster here, so its resources are what the test says)."""
    from controllers.roles import enabled_roles, resolve_roles
    from controllers.setup import parking_keys
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "gae"}))
    roles = enabled_roles(resolve_roles(), cfg)
    assert len(roles) >= 3
    assert sorted(parking_keys(cfg, roles).values()) == [(name,) for name in sorted(roles)]
    one_node = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: one_node * 2)
    assert list(parking_keys(cfg, roles).values()) == [tuple(sorted(roles))]
    monkeypatch.setattr(ray, "nodes", lambda: one_node)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    assert list(parking_keys(cfg, roles).values()) == [tuple(sorted(roles))]


def test_keep_workers_s_0_and_a_failed_run_stop_the_processes(ray_session, tiny_model_dir, tmp_path):
    IDLE_WORKERS.stop()
    trainer, _ = _fit(tiny_model_dir, tmp_path / "a", **{"trainer.keep_workers_s": 0})
    assert _all_exit([pid for pids in trainer.pids.values() for pid in pids])

    class FailingTrainer(PidTrainer):
        def train_step(self, step):
            super().train_step(step)
            raise WorkerError("injected after the first step")

    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "reward.num_workers": 0, "trainer.default_local_dir": str(tmp_path / "b")}))
    failing = FailingTrainer(cfg)
    with pytest.raises(WorkerError, match="injected"):
        failing.fit()
    assert _all_exit([pid for pids in failing.pids.values() for pid in pids]), "a failed run parks nothing"
