"""Recovery without a person (trainer.max_failures, controllers/recovery.py): a worker of each role
dies or hangs, the run restarts the lost role's workers by itself (the other roles' processes host
their roles again), and ends exactly as the run without faults.

The faults are armed by the test's driver at the start of a chosen step (tests/fault_workers.py
armable_workers): they fire once, at the worker's next call of the method, in real worker
processes (os._exit, or a sleep past the remote-call timeout).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from controllers.recovery import RECOVERIES_FILE
from controllers.worker_group import WorkerError
from reliability import runs

HANG = "sleep=60"
STEP_TIMEOUT_S = 3  # the steps' remote-call timeout: how long a hang takes to be noticed

# GAE (actor, critic and rollout processes), one step off: step t trains on a batch generated while
# step t-1 trained, so a batch is always in flight; checkpoints every 2 steps, snapshots every 3
RECOVERING = {
    "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": False, "actor.dp_size": 1,
    "trainer.max_staleness": 1, "trainer.total_steps": 6, "trainer.save_freq": 2, "trainer.snapshot_freq": 3,
    "trainer.max_failures": 7,
}
ARMABLE = {"actor": ["update", "init_model"], "critic": ["update"], "rollout": ["generate"]}
# (the step at whose start it is armed, role, method, action); a rollout fault hits the generation
# of the NEXT step's batch, which runs while this step trains
SCHEDULE = [
    (1, "actor", "update", "exit"),
    (2, "critic", "update", HANG),
    (3, "rollout", "generate", "exit"),
    (4, "actor", "update", HANG),
    (5, "rollout", "generate", HANG),
    (6, "critic", "update", "exit"),
]
# armed with step 2's fault: the actor's process, kept by that fault's restart, dies hosting its role
# again (its init_model), so the restart itself fails and the next one starts the actor anew
RESTART_FAULT = (2, "actor", "init_model", "exit")
# the restore point each fault goes back to: the start (nothing saved yet), checkpoint 2, the
# snapshot of step 3, checkpoint 4 (step 6's fault comes before its own checkpoint and snapshot)
RESTORED = [0, 0, 2, 3, 4, 4]


def _trainer_class():
    from trainers import CapturingTrainer

    class ArmingTrainer(CapturingTrainer):
        """Arms each scheduled fault once, at the start of its step; the groups' remote-call timeout
        is STEP_TIMEOUT_S after every start of the workers (their start runs under the config's)."""

        def __init__(self, config, schedule, record_dir, restart_faults=(), **kwargs):
            from fault_workers import armable_workers

            super().__init__(config, worker_classes=armable_workers(ARMABLE, arm_dir=record_dir), **kwargs)
            self.schedule = list(schedule)
            self.restart_faults = list(restart_faults)
            self.record_dir = record_dir

        def start_workers(self, *restarting):
            super().start_workers(*restarting)
            for group in self.groups.values():
                group.timeout_s = STEP_TIMEOUT_S

        def train_step(self, step):
            from fault_workers import arm_fault

            for faults, name in ((self.schedule, "fault"), (self.restart_faults, "restart-fault")):
                while faults and faults[0][0] == step + 1:
                    at, role, method, action = faults.pop(0)
                    arm_fault(self.record_dir, role, 0, method, action, os.path.join(self.record_dir, f"{name}-{at}"))
            return super().train_step(step)

    return ArmingTrainer


def _fit(model_dir, base, schedule, record_dir, restart_faults=(), **overrides):
    trainer = _trainer_class()(runs.make_config(model_dir, base, **{**RECOVERING, **overrides}), schedule, record_dir,
                               restart_faults)
    return trainer.fit(), trainer


def _compared(history):
    return [{k: v for k, v in row.items() if k != "trainer/recoveries"} for row in runs.metrics(history)]


def test_recover_from_death_and_hang_of_every_role_exactly(ray_session, tiny_model_dir, tmp_path, capsys):
    """Six faults in one run (each trained role and the rollout, each dying and hanging, the rollout
    while generating the batch in flight), restored from the start, checkpoints and a snapshot, and
    a seventh during a restart (a kept process dies hosting its role again): the run goes on by
    itself and ends with the metrics, weights and optimizer state of the run without (whose
    checkpoints are written synchronously, the faulty run's asynchronously)."""
    records = tmp_path / "faults"
    records.mkdir()
    clock = time.monotonic()
    reference, ref_trainer = _fit(tiny_model_dir, str(tmp_path / "straight"), [], str(records))
    straight_s = time.monotonic() - clock
    clock = time.monotonic()
    # its checkpoints written beside the steps (trainer.async_save): restored from, and compared
    history, trainer = _fit(tiny_model_dir, str(tmp_path / "faulty"), SCHEDULE, str(records), [RESTART_FAULT],
                            **{"trainer.async_save": True})
    faulty_s = time.monotonic() - clock
    err = capsys.readouterr().err

    with open(os.path.join(trainer.run_dir, RECOVERIES_FILE)) as f:
        recoveries = [json.loads(line) for line in f]
    lines = []
    for (at, role, method, action), rec in zip(SCHEDULE, recoveries, strict=True):
        fault_time = float((records / f"fault-{at}").read_text())
        continued = rec["detected"] + rec["seconds"]
        lines.append(f"step {at} {role} {method} {'dies' if action == 'exit' else 'hangs'}: noticed after "
                     f"{rec['detected'] - fault_time:.1f} s, restarted and restored step {rec['restored_step']} "
                     f"({rec['restored_from']}) in {rec['seconds']:.1f} s (stop {rec['stop_s']:.1f}, start "
                     f"{rec['start_s']:.1f}, restore {rec['restore_s']:.1f}; kept {', '.join(rec['kept'])}): "
                     f"{continued - fault_time:.1f} s from fault to going on")
        assert (rec["step"], rec["role"], rec["rank"], rec["call"]) == (at, role, 0, method), rec
        assert rec["cause"] == ("died" if action == "exit" else "timeout"), rec
        # only the lost role's processes start again; the others host their roles again. After step
        # 2's fault the actor died doing so: the second restart started it anew and kept the critic
        # the first had started (the record names the step's own fault and the last restart's phases)
        lost = {RESTART_FAULT[1]} if at == RESTART_FAULT[0] else {role}
        assert rec["kept"] == sorted({"actor", "critic", "rollout"} - lost), rec
    assert (records / f"restart-fault-{RESTART_FAULT[0]}").exists()
    assert (f"rlflow: restarting after step {RESTART_FAULT[0]}: {RESTART_FAULT[1]} rank 0: {RESTART_FAULT[2]}: "
            "the worker process died") in err, err
    print(f"\nstraight run {straight_s:.1f} s, run with {len(SCHEDULE) + 1} faults {faulty_s:.1f} s\n" + "\n".join(lines))
    assert [rec["restored_step"] for rec in recoveries] == RESTORED
    kinds = ["checkpoint" if rec["restored_from"].startswith(trainer.run_dir) else rec["restored_from"]
             for rec in recoveries]
    assert kinds == ["the run's start", "the run's start", "checkpoint", "the snapshot in memory", "checkpoint",
                     "checkpoint"]
    assert history[-1]["trainer/recoveries"] == len(SCHEDULE) + 1 and reference[-1]["trainer/recoveries"] == 0

    assert [row["step"] for row in history] == list(range(1, 7))
    runs.assert_same(_compared(history), _compared(reference))
    runs.assert_same_weights(runs.final_weights(trainer), runs.final_weights(ref_trainer))
    got = runs.checkpoint_tensors(os.path.join(trainer.run_dir, "checkpoints", "step_6"))
    want = runs.checkpoint_tensors(os.path.join(ref_trainer.run_dir, "checkpoints", "step_6"))
    assert got.keys() == want.keys() and [k for k in want if not (got[k] == want[k]).all()] == []


def test_a_failed_save_goes_on_then_max_failures_used_up_stops_the_run(ray_session, tiny_model_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """max_failures=1. A checkpoint that cannot be written (the disk is full at step 2's save) is the
    first failure: the run goes on without it. The next failure (the critic dies in step 3) finds
    none left and stops the run with its own error."""
    from safetensors import SafetensorError

    from controllers import checkpoint

    real_save_file = checkpoint.save_file

    def full_at_step_2(tensors, path, metadata=None):
        if ".tmp-step_2-" in path:
            raise SafetensorError("Error while serializing: IoError(No space left on device)")
        return real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", full_at_step_2)
    records = tmp_path / "faults"
    records.mkdir()
    trainer = _trainer_class()(runs.make_config(tiny_model_dir, str(tmp_path / "run"), **{
        **RECOVERING, "trainer.total_steps": 3, "trainer.save_freq": 1, "trainer.max_failures": 1,
        "trainer.snapshot_freq": 0}), [(3, "critic", "update", "exit")], str(records))
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    message = str(info.value)
    print(f"\n{message}")
    assert message.startswith("step 3 (of 3): critic rank 0: update: the worker process died"), message
    assert message.endswith("trainer.max_failures=1 recoveries used")
    # step 2 was logged before its save failed: the count shows from step 3's metrics on
    assert [row["step"] for row in trainer.history] == [1, 2] and trainer.history[-1]["trainer/recoveries"] == 0
    assert trainer.recovery.failures == 1
    root = os.path.join(trainer.run_dir, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    with open(os.path.join(trainer.run_dir, RECOVERIES_FILE)) as f:
        (record,) = [json.loads(line) for line in f]
    assert (record["step"], record["cause"]) == (2, "save") and "No space left on device" in record["error"]
    assert "the run goes on without it (failure 1 of trainer.max_failures=1)" in capsys.readouterr().err
