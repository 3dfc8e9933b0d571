"""Faults: a worker that dies mid-step, a worker that hangs, remote-call timeouts.

Faults are injected by test-only worker subclasses (tests/fault_workers.py) passed in with
PPOTrainer(worker_classes=...); nothing in rlflow/, controllers/ or workers/ knows about them.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from controllers import checkpoint as ckpt
from controllers.worker_group import WorkerError, get_with_timeout
from reliability import runs

# 2 processes (actor, rollout) instead of runs.EXACT's 6
CHEAP = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False, "actor.dp_size": 1,
         "trainer.total_steps": 1}

def test_worker_death_then_exact_resume(ray_session, tiny_model_dir, tmp_path):
    """4 steps straight vs 2 steps + checkpoint + a worker death in step 3 + a NEW fit with
    resume_mode=auto for steps 3-4 (runs.EXACT: FSDP2 actor and DDP critic with dp=2, adaptive KL
    in the reward, lr warm-up across the resume point, shuffled data).

    The death (actor rank 1 exits at the start of step 3's update, while rank 0 enters an FSDP
    collective) is reported naming the role and rank, long before remote_timeout_s; the step-2
    checkpoint stays intact and latest; the resumed run ends with exactly the uninterrupted run's
    metrics, parameters and optimizer state.
    """
    reference_base = str(tmp_path / "straight")
    clock = time.monotonic()
    reference, ref_trainer = runs.fit(tiny_model_dir, reference_base, return_trainer=True, **{"trainer.save_freq": 2})
    print(f"\nstraight run: {time.monotonic() - clock:.1f} s")

    base = str(tmp_path / "crashed")
    trainer = runs.PPOTrainerWithStepClock(runs.make_config(tiny_model_dir, base, **{"trainer.save_freq": 2}),
                                           fault_spec="actor:1:update:3:exit")
    timeout_s = trainer.cfg.trainer.remote_timeout_s
    clock = time.monotonic()
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    print(f"crashed run: {time.monotonic() - clock:.1f} s")
    elapsed = time.monotonic() - trainer.step_started[3]
    message = str(info.value)
    print(f"\nworker death -> after {elapsed:.1f} s: {message}")
    assert message.startswith("step 3 (of 4): actor rank 1: update: the worker process died"), message
    assert elapsed < timeout_s / 10, f"the error took {elapsed:.1f} s (remote_timeout_s={timeout_s})"
    assert [h["step"] for h in trainer.history] == [1, 2]
    runs.assert_same(runs.metrics(trainer.history), runs.metrics(reference)[:2])

    root = os.path.join(runs.run_dir_of(base), "checkpoints")
    assert open(os.path.join(root, "latest")).read().strip() == "step_2"
    assert [name for _, name in ckpt.list_checkpoints(root)] == ["step_2"]
    ckpt.verify(os.path.join(root, "step_2"))

    clock = time.monotonic()
    resumed, trainer = runs.fit(tiny_model_dir, base, return_trainer=True, **{"trainer.save_freq": 2})
    print(f"resumed run: {time.monotonic() - clock:.1f} s")
    assert [h["step"] for h in resumed] == [1, 2, 3, 4], "the history continues from the checkpoint"
    runs.assert_same(runs.metrics(resumed), runs.metrics(reference))
    runs.assert_same_weights(runs.final_weights(trainer), runs.final_weights(ref_trainer))
    got = runs.checkpoint_tensors(os.path.join(root, "step_4"))
    want = runs.checkpoint_tensors(os.path.join(runs.run_dir_of(reference_base), "checkpoints", "step_4"))
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []
    assert reference[-1]["actor/lr"] != reference[1]["actor/lr"], "the warm-up must span the resume point"


def test_hung_worker_times_out_naming_the_call(ray_session, tiny_model_dir, tmp_path):
    """The actor hangs in update: the driver gives up after the remote-call timeout, naming the call.

    The groups take their timeout from trainer.remote_timeout_s (checked); the steps then run under
    a 5 s one, so that the test's start-up on a busy machine cannot race a small timeout. (The
    collective side of the same config value: test_collective_timeout_comes_from_config.)
    """
    step_timeout_s = 5
    trainer = runs.PPOTrainerWithStepClock(runs.make_config(
        tiny_model_dir, str(tmp_path / "hung"), **{**CHEAP, "trainer.remote_timeout_s": 77}), step_timeout_s=step_timeout_s,
        fault_spec="actor:0:update:1:sleep=600")
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    message = str(info.value)
    assert trainer.setup_timeouts == {"actor": 77, "rollout": 77}, trainer.setup_timeouts
    assert 1 in trainer.step_started, f"failed before step 1: {message}"
    elapsed = time.monotonic() - trainer.step_started[1]
    print(f"\nhung worker -> after {elapsed:.1f} s: {message}")
    assert message.startswith(f"step 1 (of 1): actor rank 0: update did not return within "
                              f"trainer.remote_timeout_s={step_timeout_s} s"), message
    assert step_timeout_s - 0.5 < elapsed < step_timeout_s + 10, elapsed


def test_get_with_timeout_reports_a_failure_at_once(ray_session):
    """One call fails while the others would run for a minute: the error comes at once."""
    import ray

    @ray.remote
    def slow():
        time.sleep(60)

    @ray.remote
    def fail():
        raise ValueError("bad shard")

    futures = [slow.remote(), fail.remote()]
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"^critic rank 1: update raised ValueError: bad shard"):
        get_with_timeout(futures, ["critic rank 0: update", "critic rank 1: update"], timeout_s=120)
    assert time.monotonic() - start < 10
    for future in futures:
        ray.cancel(future, force=True)


def test_get_with_timeout_names_the_late_call(ray_session):
    import ray

    @ray.remote
    def slow(seconds):
        time.sleep(seconds)
        return seconds

    futures = [slow.remote(0), slow.remote(60)]
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"^rollout rank 1: generate did not return within trainer.remote_timeout_s=2 s"):
        get_with_timeout(futures, ["rollout rank 0: generate", "rollout rank 1: generate"], timeout_s=2)
    assert 2 <= time.monotonic() - start < 10
    ray.cancel(futures[1], force=True)
    assert get_with_timeout([slow.remote(0)], ["x"], 30) == [0]


def test_collective_timeout_comes_from_config(monkeypatch, tiny_model_dir):
    """The gloo/nccl side: init_process_group gets trainer.remote_timeout_s."""
    import torch.distributed as dist

    from rlflow.config import to_dataclass
    from workers.base import WorkerBase

    cfg = to_dataclass(runs.make_config(tiny_model_dir, "/nonexistent", **{"trainer.remote_timeout_s": 42}))
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    worker = object.__new__(WorkerBase)
    worker.cfg, worker.rank, worker.world_size, worker.device = cfg, 1, 2, torch.device("cpu")
    worker.init_distributed("127.0.0.1", 12345)
    assert seen["timeout"] == datetime.timedelta(seconds=42) and seen["rank"] == 1 and seen["world_size"] == 2


def test_fault_specs_are_checked():
    """The test-only fault workers: a bad spec is refused; a spec names roles and ranks."""
    import fault_workers

    from workers.actor import ActorWorker

    classes = fault_workers.faulty_workers("actor:*:update:*:nan=1,actor:0:compute_log_prob:2:raise")
    assert list(classes) == ["actor"] and issubclass(classes["actor"], ActorWorker)
    assert [f.method for f in classes["actor"].FAULTS] == ["update", "compute_log_prob"]
    with pytest.raises(ValueError, match="unknown action"):
        fault_workers.parse("actor:0:update:1:bogus")
    with pytest.raises(ValueError, match="role:rank:method:nth:action"):
        fault_workers.parse("actor:0:update")
