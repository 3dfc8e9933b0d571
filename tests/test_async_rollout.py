"""Asynchronous rollout (trainer.max_staleness): the next steps' batches are generated while a step
trains, each by a known weight version, and the training on them is exactly the training on the
same batches replayed; a checkpoint taken with a rollout in flight resumes bitwise.

The loop at max_staleness=0 is the synchronous loop of before the change: the same calls in the
same order (RolloutQueue starts step t's rollout, then finishes it). The commit that added the
queue compared the final weights of a GRPO and a PPO+critic+KL run before and after it (equal).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.usefixtures("ray_session")


# ------------------------------------------------------------------------------------------------
# the queue's order, on a source that only records what it was asked
# ------------------------------------------------------------------------------------------------
class _LoggingSource:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def start(self, step):
        self.calls.append(("start", step))
        return step

    def finish(self, step, timer):
        from controllers.rollout_source import Rollout
        from tensordict import TensorDict

        self.calls.append(("finish", step))
        batch = TensorDict({"responses": torch.full((2, 3), step)}, batch_size=[2])
        return Rollout(batch, weight_version=step, extras={"num_reward_errors": 0})


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_queue_starts_ahead_and_never_past_the_last_step(max_staleness):
    from controllers.ppo import Timer
    from controllers.rollout_source import RolloutQueue

    source = _LoggingSource()
    queue = RolloutQueue(source, max_staleness, total_steps=5)
    for step in range(5):
        assert int(queue.take(step, Timer()).batch["responses"][0, 0]) == step
        started = [s for kind, s in source.calls if kind == "start"]
        assert started == list(range(min(step + max_staleness, 4) + 1)), "started in order, up to step + k"
    assert [s for kind, s in source.calls if kind == "finish"] == list(range(5))
    if max_staleness == 0:  # the synchronous loop: each step's rollout started, then finished
        assert source.calls == [(kind, s) for s in range(5) for kind in ("start", "finish")]


@pytest.mark.parametrize("max_staleness, order", [
    (0, "S0 F0 S1 F1 S2 F2 S3 F3 S4 F4"),  # finish_next has nothing started ahead: the synchronous loop
    (1, "S0 S1 F0 F1 S2 F2 S3 F3 S4 F4"),
    (3, "S0 S1 S2 S3 F0 F1 S4 F2 F3 F4"),
])
def test_the_next_rollout_is_finished_while_a_step_trains(max_staleness, order):
    """The trainer's order: take(t), then finish_next(t) while step t's updates run. Step t + 1's
    rollout is finished then (before step t's weight sync), and take(t + 1) starts the next one only."""
    from controllers.ppo import Timer
    from controllers.rollout_source import RolloutQueue

    source = _LoggingSource()
    queue = RolloutQueue(source, max_staleness, total_steps=5)
    for step in range(5):
        assert int(queue.take(step, Timer()).batch["responses"][0, 0]) == step
        queue.finish_next(step, Timer())
    assert " ".join(f"{kind[0].upper()}{s}" for kind, s in source.calls) == order


def test_queue_state_finishes_what_is_in_flight_and_restores_it():
    from controllers.ppo import Timer
    from controllers.rollout_source import RolloutQueue

    source = _LoggingSource()
    queue = RolloutQueue(source, 2, total_steps=6)
    queue.take(0, Timer())
    records = queue.state_dict(Timer())  # steps 1 and 2 were started at step 0
    assert [r["step"] for r in records] == [1, 2]
    assert ("finish", 1) in source.calls and ("finish", 2) in source.calls

    restored_source = _LoggingSource()
    restored = RolloutQueue(restored_source, 2, total_steps=6)
    restored.load_state_dict(records, step=1)
    assert int(restored.take(1, Timer()).batch["responses"][0, 0]) == 1
    assert restored_source.calls == [("start", 3)], "only the step not in the checkpoint is started"
    assert int(restored.take(2, Timer()).batch["responses"][0, 0]) == 2


# ------------------------------------------------------------------------------------------------
# real fits
# ------------------------------------------------------------------------------------------------
from async_helpers import ESTIMATORS, STEPS, async_config, check_weight_versions, metrics_of  # noqa: E402


@pytest.fixture(scope="module")
def live_run(tiny_model_dir, tmp_path_factory):
    """live_run(estimator) -> (StepWeightsTrainer after its fit, history, recording folder): the
    max_staleness=1 run of STEPS steps, recorded; fitted once per module (two tests read the grpo one)."""
    runs = {}

    def get(estimator):
        from trainers import StepWeightsTrainer

        if estimator not in runs:
            base = tmp_path_factory.mktemp(f"live_{estimator}")
            record = str(base / "record")
            live = StepWeightsTrainer(async_config(tiny_model_dir, str(base / "live"), **ESTIMATORS[estimator],
                                                   **{"trainer.record_rollouts": record}))
            runs[estimator] = (live, live.fit(), record)
        return runs[estimator]

    return get


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_one_step_stale_rollout_trains_exactly_on_what_it_generated(tiny_model_dir, tmp_path, live_run, estimator):
    """max_staleness=1: step t trains on the batch the rollout generated with the weights of step
    t - 1 while step t - 1 updated (the recorded log-probs prove which weights). Training on that
    recording again (replayed, nothing overlapping) gives bitwise the same metrics and weights."""
    from trainers import CapturingTrainer

    live, history, record = live_run(estimator)
    assert [h["rollout/staleness"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    check_weight_versions(tiny_model_dir, record, live.actor_versions, tol=1e-5, lag_min=1e-3)
    if estimator == "gae":
        assert "critic/vf_loss" in history[-1]
    # the policy lag shows in the mismatch between the rollout's log-probs (behaviour) and the
    # actor's at the start of the update (proximal)
    assert all(h["rollout_corr/abs_diff_max"] > 1e-4 for h in history[1:]), [h["rollout_corr/abs_diff_max"] for h in history]
    assert history[0]["rollout_corr/abs_diff_max"] < 1e-5

    replay = CapturingTrainer(async_config(tiny_model_dir, str(tmp_path / "replay"), **ESTIMATORS[estimator],
                                      **{"trainer.replay_rollouts": record}))
    replayed = replay.fit()
    assert metrics_of(replayed) == metrics_of(history)
    for role, weights in live.final_weights.items():
        differing = [name for name, tensor in weights.items() if not torch.equal(tensor, replay.final_weights[role][name])]
        assert not differing, f"{role}: {differing[:3]}"


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_next_batch_is_scored_while_the_actor_updates(tiny_model_dir, tmp_path, max_staleness):
    """With max_staleness=1 the driver scores step t + 1's batch while step t's update runs (the
    actor's update sleeps 1.5 s, the reward function runs in the driver); at 0 it scores each batch
    before the update that trains on it, never during one.

    "While the update runs" is read on the driver's own order of events: between dispatching the
    actor's update and getting its result (the actor's measured update lies inside that window). A
    wall-clock window of the actor's alone is flaky: a batch generated early is scored right after
    the dispatch, which may be before the busy actor process begins the call. (GRPO: a critic's
    update is not what this is about.)
    """
    from controllers.ppo import PPOTrainer
    from text_rewards import exactness_score
    from inspecting_workers import SlowUpdateActor

    events = []  # ("score" | "dispatch" | "gathered", time.time()), in the driver's order

    def reward_fn(*args, **kwargs):
        events.append(("score", time.time()))
        return exactness_score(*args, **kwargs)

    config = async_config(tiny_model_dir, str(tmp_path), **{"trainer.total_steps": 3, "trainer.max_staleness": max_staleness,
                                                           "algorithm.adv_estimator": "grpo",
                                                           "reward.num_workers": 0, "reward.custom_function.path": "null"})
    trainer = PPOTrainer(config, worker_classes={"actor": SlowUpdateActor}, reward_fn=reward_fn)
    trainer.setup()
    try:
        actor = trainer.groups["actor"]
        dispatch, gather = actor.call_per_dp_rank_async, actor.gather

        def recording_dispatch(method, *args, **kwargs):
            if method == "update":
                events.append(("dispatch", time.time()))
            return dispatch(method, *args, **kwargs)

        def recording_gather(futures, method, *args, **kwargs):
            result = gather(futures, method, *args, **kwargs)
            if method == "update":
                events.append(("gathered", time.time()))
            return result

        actor.call_per_dp_rank_async, actor.gather = recording_dispatch, recording_gather
        for step in range(3):
            trainer.train_step(step)
        import ray

        intervals = ray.get(actor.call_rank_async(0, "update_intervals"))[0]
    finally:
        trainer.shutdown()
    kinds = [kind for kind, _ in events]
    rows = config.data.train_batch_size * config.rollout.n
    assert kinds.count("score") == 3 * rows and kinds.count("dispatch") == kinds.count("gathered") == len(intervals) == 3
    opened = [i for i, kind in enumerate(kinds) if kind == "dispatch"]
    closed = [i for i, kind in enumerate(kinds) if kind == "gathered"]
    for i, j, (start, end) in zip(opened, closed, intervals):
        assert i < j and events[i][1] <= start <= end <= events[j][1], "the actor's update ran inside its window"
    during = [kinds[i:j].count("score") for i, j in zip(opened, closed)]
    if max_staleness == 0:
        assert during == [0, 0, 0], during
    else:  # the last step has no next batch
        assert during == [rows, rows, 0], during


def test_a_batch_older_than_max_staleness_stops_the_run(tiny_model_dir, tmp_path, live_run):
    """Replaying a max_staleness=1 recording with max_staleness=0 stops at the first stale batch
    (the recording: the grpo run of test_one_step_stale_..., shared)."""
    from controllers.ppo import PPOTrainer

    _, _, record = live_run("grpo")
    trainer = PPOTrainer(async_config(tiny_model_dir, str(tmp_path / "replay"), **{
        "trainer.total_steps": 2, "trainer.replay_rollouts": record, "trainer.max_staleness": 0, **ESTIMATORS["grpo"]}))
    with pytest.raises(RuntimeError, match=r"rollout of step 2 was generated by the weights after 0 steps: 1 updates "
                                           r"behind the actor, outside trainer.max_staleness=0"):
        trainer.fit()
    assert [h["step"] for h in trainer.history] == [1]


def test_resume_with_a_rollout_in_flight_is_exact(tiny_model_dir, tmp_path):
    """max_staleness=1, checkpoint after step 2 (step 3's rollout is in flight then), the actor
    fails in step 3; a new fit resumes. Against an uninterrupted run: every step trains on the same
    batch (the same prompts, each once), and metrics, weights and optimizer state are bitwise equal.
    Resuming it with max_staleness=0 is refused, naming the key."""
    from controllers import checkpoint as ckpt
    from controllers.rollout_source import read_recorded, recorded_steps
    from controllers.worker_group import WorkerError
    from fault_workers import faulty_workers
    from trainers import CapturingTrainer

    # the reward in the driver: the pool's processes are not what this is about
    extra = {"trainer.save_freq": 2, "trainer.resume_mode": "auto", "algorithm.adv_estimator": "gae",
             "reward.num_workers": 0}
    straight = CapturingTrainer(async_config(tiny_model_dir, str(tmp_path / "straight"),
                                        **{**extra, "trainer.record_rollouts": str(tmp_path / "rec_straight")}))
    want = straight.fit()

    base, record = str(tmp_path / "crashed"), str(tmp_path / "rec_crashed")
    config = async_config(tiny_model_dir, base, **{**extra, "trainer.record_rollouts": record})
    crashed = CapturingTrainer(config, worker_classes=faulty_workers("actor:0:update:3:raise"))
    with pytest.raises(WorkerError, match="step 3 .*actor rank 0: update"):
        crashed.fit()
    assert [h["step"] for h in crashed.history] == [1, 2]
    root = os.path.join(base, "rlflow", "default", "checkpoints")
    state = torch.load(os.path.join(root, "step_2", ckpt.TRAINER_STATE), weights_only=True)
    in_flight = state["driver"]["in_flight"]
    assert [(r["step"], r["weight_version"]) for r in in_flight] == [(2, 1)], "step 3's rollout, by the weights of step 2"

    # the refusal is the driver-state restore's, which a resuming fit's checkpoint.load calls (the
    # resumed fit below goes through it): called directly, on a trainer not set up, it needs no
    # worker processes (a refused fit would start and load them all first)
    refused = CapturingTrainer(async_config(tiny_model_dir, base, **{**extra, "trainer.record_rollouts": record,
                                                                 "trainer.max_staleness": 0}))
    with pytest.raises(ValueError, match=r"resume with trainer.max_staleness >= 1"):
        refused.load_driver_state(state["driver"], int(state["step"]))

    resumed = CapturingTrainer(async_config(tiny_model_dir, base, **{**extra, "trainer.record_rollouts": record}))
    got = resumed.fit()
    assert metrics_of(got) == metrics_of(want)
    for role, weights in straight.final_weights.items():
        assert all(torch.equal(t, resumed.final_weights[role][k]) for k, t in weights.items()), role
    straight_root = os.path.join(str(tmp_path / "straight"), "rlflow", "default", "checkpoints")
    a = torch.load(os.path.join(root, "step_4", "actor", "optimizer.pt"), weights_only=True)["optimizer"]["state"]
    b = torch.load(os.path.join(straight_root, "step_4", "actor", "optimizer.pt"), weights_only=True)["optimizer"]["state"]
    assert all(torch.equal(a[p][slot], b[p][slot]) for p in b for slot in b[p])

    assert recorded_steps(record) == recorded_steps(str(tmp_path / "rec_straight")) == set(range(STEPS))
    prompts = []
    for step in range(STEPS):
        x, y = read_recorded(record, step), read_recorded(str(tmp_path / "rec_straight"), step)
        assert x.weight_version == y.weight_version
        assert x.batch.keys() == y.batch.keys() and all(torch.equal(x.batch[k], y.batch[k]) for k in y.batch.keys())
        prompts += [tuple(row.tolist()) for row in x.batch["prompts"][:: 2]]  # rollout.n = 2 samples per prompt
    assert len(prompts) == STEPS * 8, "8 prompts a step"
