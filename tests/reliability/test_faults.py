"""Faults: a worker of any role that dies or hangs mid-step or mid-save, remote-call timeouts.

Faults are injected by test-only worker subclasses (tests/fault_workers.py) passed in with
PPOTrainer(worker_classes=...); nothing in rlflow/, controllers/ or workers/ knows about them.
(NaN out of a worker's model: test_nan_faults.py.)
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch

from controllers import checkpoint as ckpt
from controllers.worker_group import WorkerError, get_with_timeout
from reliability import runs

# 2 processes (actor, rollout) instead of runs.EXACT's 6
CHEAP = runs.CHEAP
# the steps' remote-call timeout of the hang tests (setup runs under tiny_overrides' 120 s), and
# how much later than it the error may come: the step's calls before the hung one (well under a
# second each on the tiny model) and the way up to fit()
HANG_TIMEOUT_S = 3
HANG_MARGIN_S = 4

def test_worker_death_then_exact_resume(ray_session, tiny_model_dir, tmp_path):
    """2 steps + checkpoint + a worker death in step 3 + a NEW fit with resume_mode=auto for steps
    3-4, against 4 steps straight (runs.EXACT: FSDP2 actor and DDP critic with dp=2, adaptive KL in
    the reward, lr warm-up across the resume point, shuffled data).

    The death (actor rank 1 exits at the start of step 3's update, while rank 0 enters an FSDP
    collective) is reported naming the role and rank, long before remote_timeout_s; the step-2
    checkpoint stays intact and latest; the resumed run ends with exactly the uninterrupted run's
    metrics, parameters and optimizer state. The straight run goes last: it takes the processes
    the resumed run left (trainer.keep_workers_s), where first it would start its own.
    """
    base = str(tmp_path / "crashed")
    trainer = runs.PPOTrainerWithStepClock(runs.make_config(tiny_model_dir, base, **{"trainer.save_freq": 2}),
                                           fault_spec="actor:1:update:3:exit")
    timeout_s = trainer.cfg.trainer.remote_timeout_s
    clock = time.monotonic()
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    print(f"\ncrashed run: {time.monotonic() - clock:.1f} s")
    elapsed = time.monotonic() - trainer.step_started[3]
    message = str(info.value)
    print(f"worker death -> after {elapsed:.1f} s: {message}")
    assert message.startswith("step 3 (of 4): actor rank 1: update: the worker process died"), message
    assert elapsed < timeout_s / 10, f"the error took {elapsed:.1f} s (remote_timeout_s={timeout_s})"
    crashed = list(trainer.history)
    assert [h["step"] for h in crashed] == [1, 2]

    root = os.path.join(runs.run_dir_of(base), "checkpoints")
    assert open(os.path.join(root, "latest")).read().strip() == "step_2"
    assert [name for _, name in ckpt.list_checkpoints(root)] == ["step_2"]
    ckpt.verify(os.path.join(root, "step_2"))

    clock = time.monotonic()
    resumed, trainer = runs.fit(tiny_model_dir, base, return_trainer=True, **{"trainer.save_freq": 2})
    print(f"resumed run: {time.monotonic() - clock:.1f} s")
    assert [h["step"] for h in resumed] == [1, 2, 3, 4], "the history continues from the checkpoint"

    reference_base = str(tmp_path / "straight")
    clock = time.monotonic()
    reference, ref_trainer = runs.fit(tiny_model_dir, reference_base, return_trainer=True, **{"trainer.save_freq": 2})
    print(f"straight run: {time.monotonic() - clock:.1f} s")
    runs.assert_same(runs.metrics(crashed), runs.metrics(reference)[:2])
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


# (fault spec, config, the call the error must name); one worker of each other role dies or hangs
# in one of its calls during step 1 (the actor's: the two tests above)
ROLE_FAULTS = [
    pytest.param("rollout:0:generate:1:exit", CHEAP, "rollout rank 0: generate", id="rollout-dies-in-generate"),
    pytest.param("rollout:0:generate:1:sleep=600", CHEAP, "rollout rank 0: generate", id="rollout-hangs-in-generate"),
    pytest.param("critic:0:compute_values:1:exit", runs.WITH_CRITIC, "critic rank 0: compute_values",
                 id="critic-dies-in-compute_values"),
    pytest.param("critic:0:update:1:sleep=600", runs.WITH_CRITIC, "critic rank 0: update", id="critic-hangs-in-update"),
    pytest.param("reference:0:compute_ref_log_prob:1:exit", runs.WITH_REFERENCE, "reference rank 0: compute_ref_log_prob",
                 id="reference-dies-in-compute_ref_log_prob"),
    pytest.param("reference:0:compute_ref_log_prob:1:sleep=600", runs.WITH_REFERENCE,
                 "reference rank 0: compute_ref_log_prob", id="reference-hangs-in-compute_ref_log_prob"),
]


@pytest.mark.parametrize("spec, overrides, call", ROLE_FAULTS)
def test_dead_or_hung_worker_of_each_role_fails_the_step_naming_it(ray_session, tiny_model_dir, tmp_path,
                                                                   no_leftover_workers, spec, overrides, call):
    """One WorkerError naming the step, role, rank and call: for a death at once (far within
    remote_timeout_s), for a hang once the call's timeout has run out and not much later. The
    fixture checks that the dead or hung worker is gone afterwards."""
    hangs = ":sleep=" in spec
    trainer = runs.PPOTrainerWithStepClock(runs.make_config(tiny_model_dir, str(tmp_path), **overrides),
                                           step_timeout_s=HANG_TIMEOUT_S if hangs else None, fault_spec=spec)
    timeout_s = trainer.cfg.trainer.remote_timeout_s
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    message = str(info.value)
    assert 1 in trainer.step_started, f"failed before step 1: {message}"
    elapsed = time.monotonic() - trainer.step_started[1]
    print(f"\n{spec} -> after {elapsed:.1f} s: {message[:300]}")
    assert trainer.history == []
    assert "\n" not in message, f"one error, nothing after it: {message}"
    if hangs:
        assert message.startswith(f"step 1 (of 1): {call} did not return within "
                                  f"trainer.remote_timeout_s={HANG_TIMEOUT_S} s (waited "), message
        waited = float(re.search(r"\(waited ([0-9.]+) s\)", message).group(1))
        assert HANG_TIMEOUT_S <= waited < HANG_TIMEOUT_S + 1, message
        assert HANG_TIMEOUT_S <= elapsed < HANG_TIMEOUT_S + HANG_MARGIN_S, elapsed
    else:
        assert message.startswith(f"step 1 (of 1): {call}: the worker process died"), message
        assert elapsed < min(10.0, timeout_s / 10), f"the error took {elapsed:.1f} s (remote_timeout_s={timeout_s})"


def test_worker_death_during_a_save_keeps_the_previous_checkpoint(ray_session, tiny_model_dir, tmp_path,
                                                                   no_leftover_workers):
    """save_freq=1: actor rank 0 dies in state_for_checkpoint during step 2's save.

    The error names the rank and the call; step 1's checkpoint stays `latest` and verifies; there
    is no step_2 folder and no temporary folder (the states are collected before anything is
    written). A new run resumes from step 1, redoes step 2 exactly and saves it; the next save
    prunes what an interrupted write would have left (a half-written .tmp-step_2-* folder)."""
    overrides = {**CHEAP, "trainer.total_steps": 2, "trainer.save_freq": 1}
    base = str(tmp_path / "run")
    trainer = runs.PPOTrainerWithStepClock(runs.make_config(tiny_model_dir, base, **overrides),
                                           fault_spec="actor:0:state_for_checkpoint:2:exit")
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    message = str(info.value)
    print(f"\nsave -> {message[:300]}")
    assert "actor rank 0: state_for_checkpoint: the worker process died" in message, message
    crashed = list(trainer.history)
    assert [h["step"] for h in crashed] == [1, 2], "step 2 trained; its save failed"
    root = os.path.join(runs.run_dir_of(base), "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    assert open(os.path.join(root, "latest")).read().strip() == "step_1"
    assert ckpt.list_checkpoints(root) == [(1, "step_1")]
    assert ckpt.find_latest(root) == os.path.join(root, "step_1")
    assert ckpt.verify(os.path.join(root, "step_1"))["step"] == 1

    # what a driver killed while writing step 2's files leaves (tests/test_checkpoint.py)
    half = os.path.join(root, ".tmp-step_2-killed", "actor")
    os.makedirs(half)
    with open(os.path.join(half, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 100)
    resumed = runs.fit(tiny_model_dir, base, **overrides)
    assert [h["step"] for h in resumed] == [1, 2]
    runs.assert_same(runs.metrics(resumed), runs.metrics(crashed))
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2"], "the save of step 2 prunes the leftover"
    assert ckpt.find_latest(root) == os.path.join(root, "step_2")
    for step in (1, 2):
        assert ckpt.verify(os.path.join(root, f"step_{step}"))["step"] == step


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
    """The gloo/nccl side: init_process_group and the store rank 1 joins get trainer.remote_timeout_s."""
    import torch.distributed as dist

    from rlflow.config import to_dataclass
    from workers.base import WorkerBase

    cfg = to_dataclass(runs.make_config(tiny_model_dir, "/nonexistent", **{"trainer.remote_timeout_s": 42}))
    seen, store_seen = {}, {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: store_seen.update(kwargs, args=args) or "store")
    worker = object.__new__(WorkerBase)
    worker.cfg, worker.rank, worker.world_size, worker.device = cfg, 1, 2, torch.device("cpu")
    worker.init_distributed("127.0.0.1", 12345)
    assert seen["timeout"] == datetime.timedelta(seconds=42) and seen["rank"] == 1 and seen["world_size"] == 2
    assert seen["store"] == "store" and store_seen["args"] == ("127.0.0.1", 12345, 2)
    assert store_seen["timeout"] == datetime.timedelta(seconds=42) and store_seen["is_master"] is False


def test_fault_specs_are_checked():
    """The test-only fault workers: a bad spec is refused; a spec names roles, ranks and any
    public method of the role's worker, which the subclass wraps (the others stay the base's)."""
    import fault_workers

    from controllers.roles import default_worker_classes

    defaults = default_worker_classes()
    classes = fault_workers.faulty_workers("actor:*:update:*:nan=1,actor:0:compute_log_prob:2:raise")
    assert list(classes) == ["actor"] and issubclass(classes["actor"], defaults["actor"])
    assert [f.method for f in classes["actor"].FAULTS] == ["update", "compute_log_prob"]
    classes = fault_workers.faulty_workers("rollout:0:generate:1:exit,critic:*:compute_values:*:nan_values,"
                                           "reference:0:compute_ref_log_prob:2:sleep=1.5,actor:0:state_for_checkpoint:2:exit")
    assert sorted(classes) == ["actor", "critic", "reference", "rollout"]
    for role, method in [("rollout", "generate"), ("critic", "compute_values"), ("reference", "compute_ref_log_prob"),
                         ("actor", "state_for_checkpoint")]:
        assert issubclass(classes[role], defaults[role])
        assert method in vars(classes[role]), f"{role}.{method} is not wrapped"
    assert "update" not in vars(classes["critic"]) and "compute_log_prob" not in vars(classes["actor"])
    for bad, why in [("actor:0:update:1:bogus", "unknown action"), ("actor:0:update:1:nan_", "unknown action"),
                     ("actor:0:update", "role:rank:method:nth:action"), ("actor:x:update:1:exit", "numbers or"),
                     ("critic:0:compute_values:1:nan", "use it on update"), ("actor:0:update:1:nan_values", "critic"),
                     ("critic:0:update:1:nan_logits", "actor / reference")]:
        with pytest.raises(ValueError, match=why):
            fault_workers.parse(bad)
    with pytest.raises(ValueError, match="no such public method"):
        fault_workers.faulty_workers("critic:0:compute_log_prob:1:exit")
    with pytest.raises(ValueError, match="the roles are"):
        fault_workers.faulty_workers("learner:0:update:1:exit")


def test_faults_happen_on_the_nth_call_of_the_named_rank():
    """The wrapper in a plain process: which call of which rank does what; nan_logits poisons the
    model's forwards during that call only, gradients included."""
    import types

    import fault_workers

    class Model(torch.nn.Module):  # returns an object with .logits, as a transformers model does
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            return types.SimpleNamespace(logits=self.linear(x))

    class Worker:
        role = "actor"

        def __init__(self, rank):
            self.rank = rank
            self.model = Model()

        def step(self, x):
            self.model.zero_grad()
            logits = self.model(x).logits
            logits.sum().backward()
            return logits.detach(), self.model.linear.weight.grad

    spec = "actor:1:step:2:nan_logits,actor:0:step:*:raise"
    body = {"FAULTS": fault_workers.parse(spec), "step": fault_workers._faulty_method("step", Worker.step)}
    faulty = type("FaultyWorker", (fault_workers.FaultInjection, Worker), body)
    rank1 = faulty(rank=1)
    calls = [rank1.step(torch.ones(1, 3)) for _ in range(3)]
    assert [bool(torch.isnan(logits).all()) for logits, _ in calls] == [False, True, False]
    assert [bool(torch.isnan(grad).all()) for _, grad in calls] == [False, True, False]
    assert all(torch.isfinite(t).all() for i in (0, 2) for t in calls[i]), "only the 2nd call is poisoned"
    with pytest.raises(fault_workers.InjectedFault, match="actor rank 0, call 1 of step"):
        faulty(rank=0).step(torch.ones(1, 3))
