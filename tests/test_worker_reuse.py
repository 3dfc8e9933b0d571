"""A completed run parks its worker processes (controllers/worker_group.py, IdleWorkers): a later
run in the driver takes them (on one node without GPUs, a group of any role for a role of its
size: workers/process.py) and trains exactly as on new processes; a run that cannot reserve its
placement while they wait stops them; a failed run parks all but its lost workers' groups;
trainer.keep_workers_s=0 parks nothing."""

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


def _pids(run) -> set[int]:
    return {pid for pids in run[0].pids.values() for pid in pids}


def test_a_later_run_takes_groups_of_any_role_and_trains_exactly(ray_session, tiny_model_dir, tmp_path):
    IDLE_WORKERS.stop()
    first = _fit(tiny_model_dir, tmp_path / "a")
    second = _fit(tiny_model_dir, tmp_path / "b")
    assert _pids(second) == _pids(first), "the second run ran on the first run's processes"
    _same_run(first, second)

    # a critic joins: the run takes every process the GRPO run left, whatever role each hosted, and
    # starts one more; it trains exactly as a run on new processes does
    third = _fit(tiny_model_dir, tmp_path / "c", **{"algorithm.adv_estimator": "gae"})
    grpo_pids = _pids(first)
    assert grpo_pids < _pids(third) and len(_pids(third) - grpo_pids) == 1
    role_of = {pid: role for role, pids in first[0].pids.items() for pid in pids}
    moved = {role: role_of[pid] for role, pids in third[0].pids.items() for pid in pids if pid in role_of and
             role_of[pid] != role}
    assert moved, "some process hosts another role than in the first run"
    fourth = _fit(tiny_model_dir, tmp_path / "d")
    assert _pids(fourth) < _pids(third)
    _same_run(first, fourth)
    third_pids = _pids(third)
    IDLE_WORKERS.stop()
    assert _all_exit(third_pids)
    fresh = _fit(tiny_model_dir, tmp_path / "f", **{"algorithm.adv_estimator": "gae"})
    assert not _pids(fresh) & third_pids
    _same_run(third, fresh)

    # a run whose placement group does not fit beside the parked groups (one bundle of 2 roles
    # taking all but 0.5 of the session's CPUs; the parked pools hold 1.5) stops them
    fresh_pids = _pids(fresh)
    cpus = float(ray.cluster_resources()["CPU"])
    big = _fit(tiny_model_dir, tmp_path / "e", **{"trainer.cpus_per_worker": (cpus - 0.5) / 2})
    assert _all_exit(fresh_pids), "the parked groups stopped for the run that needed their CPUs"
    IDLE_WORKERS.stop()
    assert _all_exit(_pids(big))


def test_groups_park_by_size_on_one_node_without_gpus_and_as_a_layout_elsewhere(ray_session, tiny_model_dir,
                                                                                 monkeypatch):
    """On one node without GPUs a group parks under its size (and the CPUs and environment its
    processes started with), whatever its role. Colocated roles share their bundles' GPUs and
    nodes: there a run takes a whole layout or nothing (no GPU cluster here, so its resources are
    what the test says)."""
    from controllers.roles import enabled_roles, resolve_roles
    from controllers.setup import parking_keys
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{"algorithm.adv_estimator": "gae", "actor.dp_size": 2}))
    roles = enabled_roles(resolve_roles(), cfg)
    assert len(roles) >= 3
    parking = parking_keys(cfg, roles)
    assert [names for _, names in parking] == [(name,) for name in sorted(roles)]
    key_of = {names[0]: key for key, names in parking}
    assert key_of["actor"] == key_of["critic"] != key_of["rollout"]  # 2 ranks (the critic follows the actor), 1
    one_node = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: one_node * 2)
    assert [names for _, names in parking_keys(cfg, roles)] == [tuple(sorted(roles))]
    monkeypatch.setattr(ray, "nodes", lambda: one_node)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    assert [names for _, names in parking_keys(cfg, roles)] == [tuple(sorted(roles))]


def test_keep_workers_s_0_stops_the_processes_and_a_failed_run_parks_all_but_the_lost_role(ray_session,
                                                                                            tiny_model_dir, tmp_path):
    IDLE_WORKERS.stop()
    trainer, _ = _fit(tiny_model_dir, tmp_path / "a", **{"trainer.keep_workers_s": 0})
    assert _all_exit([pid for pids in trainer.pids.values() for pid in pids])

    # the rollout's process dies generating step 2's batch: the run fails naming it; its process is
    # gone, the actor's waits, and the next run takes it and trains exactly as on new processes
    from fault_workers import faulty_workers
    from rlflow import load_config

    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "reward.num_workers": 0, "trainer.total_steps": STEPS,
        "trainer.deterministic": True, "trainer.default_local_dir": str(tmp_path / "b")}))
    failing = PidTrainer(cfg, worker_classes=faulty_workers("rollout:0:generate:2:exit"))
    with pytest.raises(WorkerError, match="rollout rank 0: generate: the worker process died") as info:
        failing.fit()
    assert info.value.lost_roles == {"rollout"}
    assert _all_exit(failing.pids["rollout"])
    assert all(_alive(pid) for pid in failing.pids["actor"]), "the actor's processes wait for the next run"
    after = _fit(tiny_model_dir, tmp_path / "c")
    assert set(failing.pids["actor"]) <= _pids(after) and not set(failing.pids["rollout"]) & _pids(after)
    IDLE_WORKERS.stop()
    fresh = _fit(tiny_model_dir, tmp_path / "d")
    assert not _pids(fresh) & _pids(after)
    _same_run(after, fresh)
    IDLE_WORKERS.stop()
