"""Real fits for the reliability tests: config, fault injection, comparisons of runs.

Each fit starts new worker processes: on 2 cores that costs ~7 s for 2 processes and ~25 s for
the 6 of EXACT, while a step takes under a second. Keep the number of fits down.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

from conftest import tiny_overrides

# a reward that varies with the text (a random tiny model never solves the task: all-zero rewards
# would make the runs' comparison weak)
_REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 7) / 3.0 - 1.0
'''

# FSDP2 actor, DDP critic, dp=2 each; KL in the reward with the adaptive controller (needs the
# reference); lr warm-up over 3 steps, so the scheduler's position matters at a resume after step 2
EXACT = {
    "actor.dp_size": 2,
    "actor.strategy": "fsdp2",
    "critic.strategy": "ddp",
    "actor.ppo_micro_batch_size_per_gpu": 2,
    "actor.optim.warmup_steps": 3,
    "critic.optim.warmup_steps": 3,
    "algorithm.use_kl_in_reward": True,
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": 0.05,
    "algorithm.kl_ctrl.horizon": 100,
    "trainer.deterministic": True,
    "trainer.total_steps": 4,
    "trainer.project_name": "p",
    "trainer.experiment_name": "e",
    # the reward in the driver: the reward pool's 2 processes per fit are not under test here
    # (tests/test_reward_pool.py); the scores are the same
    "reward.num_workers": 0,
}

# the cheapest fits, 1 step: actor + rollout (2 processes instead of EXACT's 6); then one more
# process each for a role under test: the critic (GAE needs values), the reference (the actor's KL loss)
CHEAP = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False, "actor.dp_size": 1,
         "trainer.total_steps": 1}
WITH_CRITIC = {**CHEAP, "algorithm.adv_estimator": "gae"}
WITH_REFERENCE = {**CHEAP, "actor.use_kl_loss": True}

_cache: dict = {}


def reward_file() -> str:
    if "reward" not in _cache:
        path = os.path.join(tempfile.mkdtemp(prefix="rlflow-reward-"), "reward.py")
        with open(path, "w") as f:
            f.write(_REWARD_SOURCE)
        _cache["reward"] = path
    return _cache["reward"]


def run_dir_of(base: str) -> str:
    return os.path.join(base, "p", "e")


def make_config(model_dir: str, base_dir: str, **overrides):
    from rlflow import load_config

    values = {**EXACT, "reward.custom_function.path": reward_file(), "trainer.default_local_dir": base_dir, **overrides}
    return load_config(None, tiny_overrides(model_dir, **values))


def fit(model_dir: str, base_dir: str, fault_spec: str | None = None, return_trainer: bool = False, **overrides):
    """One fit; a new trainer (new worker processes) each time. fault_spec: tests/fault_workers.py."""
    from fault_workers import faulty_workers
    from trainers import CapturingTrainer

    trainer = CapturingTrainer(make_config(model_dir, base_dir, **overrides),
                               worker_classes=faulty_workers(fault_spec) if fault_spec else None)
    history = trainer.fit()
    return (history, trainer) if return_trainer else history


def final_weights(trainer) -> dict:
    """{"actor": state dict, "critic": ...} at the end of a fit."""
    assert trainer.final_weights, "the fit did not finish"
    return trainer.final_weights


def metrics(history: list[dict]) -> list[dict]:
    """Everything but wall-clock timings."""
    return [{k: v for k, v in h.items() if not k.startswith("timing/")} for h in history]


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g["step"], sorted(set(g) ^ set(w)))
        for key in w:
            same = g[key] == w[key] or (isinstance(w[key], float) and math.isnan(w[key]) and math.isnan(g[key]))
            assert same, f"step {w['step']} {key}: {g[key]!r} != {w[key]!r}"


def assert_same_weights(got: dict | None, want: dict | None) -> None:
    assert got is not None and want is not None
    assert got.keys() == want.keys()
    for role in want:
        assert got[role].keys() == want[role].keys(), role
        bad = [name for name in want[role] if not torch.equal(got[role][name], want[role][name])]
        assert not bad, f"{role}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def checkpoint_tensors(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of a checkpoint, flattened (for an exact comparison)."""
    from controllers.checkpoint import _load_model_file

    out = {}
    for role in ("actor", "critic"):
        for name, tensor in _load_model_file(ckpt_dir, f"{role}/model.safetensors").items():
            out[f"{role}/model/{name}"] = tensor
        optim = torch.load(os.path.join(ckpt_dir, role, "optimizer.pt"), weights_only=True)["optimizer"]
        for param, slots in optim["state"].items():
            for slot, tensor in slots.items():
                out[f"{role}/optim/{param}/{slot}"] = tensor
    return out


def _clocked_trainer_class():
    from trainers import CapturingTrainer

    class PPOTrainerWithStepClock(CapturingTrainer):
        """Records when each step (1-based) starts, to time how fast a fault is reported.

        step_timeout_s: after setup, the groups' remote-call timeout becomes this (setup itself runs
        under trainer.remote_timeout_s): a small timeout for the steps without making the start of
        the worker processes race it on a busy machine.
        """

        def __init__(self, config, step_timeout_s: float | None = None, fault_spec: str | None = None):
            from fault_workers import faulty_workers

            super().__init__(config, worker_classes=faulty_workers(fault_spec) if fault_spec else None)
            self.step_started: dict[int, float] = {}
            self.step_timeout_s = step_timeout_s
            self.setup_timeouts: dict[str, float] = {}

        def setup(self) -> None:
            super().setup()
            self.setup_timeouts = {role: group.timeout_s for role, group in self.groups.items()}
            if self.step_timeout_s is not None:
                for group in self.groups.values():
                    group.timeout_s = self.step_timeout_s

        def train_step(self, step: int) -> dict:
            import time

            self.step_started[step + 1] = time.monotonic()
            return super().train_step(step)

    return PPOTrainerWithStepClock


def __getattr__(name):
    if name == "PPOTrainerWithStepClock":
        return _clocked_trainer_class()
    raise AttributeError(name)


def live_workers() -> set[str]:
    """The Ray actors alive and the placement groups not removed, in this test session's Ray."""
    import ray
    # ray.util.state needs the dashboard, which the tests' local Ray does not start
    from ray._private.state import actors

    alive = {f"actor {actor_id} ({info.get('ActorClassName')})" for actor_id, info in actors().items()
             if info.get("State") != "DEAD"}
    groups = {f"placement group {pg_id} ({info.get('state')})" for pg_id, info in ray.util.placement_group_table().items()
              if info.get("state") != "REMOVED"}
    return alive | groups


def parked_ids() -> set[str]:
    """The ids of the actors and placement groups of the worker groups that wait for the next run (IdleWorkers)."""
    from controllers.worker_group import IDLE_WORKERS

    groups = [group for entry in IDLE_WORKERS._parked for group in entry.groups]
    return {w._actor_id.hex() for group in groups for w in group.workers} | {group.pool.pg.id.hex() for group in groups}


def assert_no_new_workers(before: set[str], wait_s: float = 15.0) -> None:
    """Whatever a fit started is gone (ray.kill and placement-group removal are asynchronous) or
    waits for the next run (IdleWorkers: a run parks the groups that released what they held, and
    the next test's fits take them): a dead, hung or failed worker must not outlive its fit."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        parked = parked_ids()
        left = sorted(w for w in live_workers() - before if w.split(" (")[0].split()[-1] not in parked)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"the fit left workers behind: {left}"
