"""Roles as data: a role's worker can be replaced by a subclass, and a new role is one declaration
(controllers/roles.py) that setup, the forward phase, sizing and shutdown pick up."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer
from controllers.roles import Forward, Role, default_worker_classes, resolve_roles
from rlflow import load_config
from workers.actor import ReferenceWorker
from workers.critic import CriticWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import tests/


class MyCritic(CriticWorker):
    pass


def test_a_subclass_replaces_its_role_only():
    trainer = PPOTrainer(load_config(), worker_classes={"critic": MyCritic})
    assert trainer.worker_classes == {**default_worker_classes(), "critic": MyCritic}


@pytest.mark.parametrize("classes, error, pattern", [
    ({"critc": MyCritic}, ValueError, r"unknown role 'critc'; roles: actor, rollout, critic, reference"),
    ({"actor": MyCritic}, TypeError, r"worker_classes\['actor'\] must be a subclass of ActorWorker"),
    ({"actor": "workers.actor.ActorWorker"}, TypeError, r"must be a subclass of ActorWorker"),
])
def test_other_classes_are_refused(classes, error, pattern):
    with pytest.raises(error, match=pattern):
        PPOTrainer(load_config(), worker_classes=classes)


def test_bad_role_declarations_are_refused():
    with pytest.raises(TypeError, match="Role declarations"):
        resolve_roles([{"name": "scorer"}])
    trained = Role("judge", ReferenceWorker, lambda cfg: True, lambda cfg: 1, lambda ctx: ("init_model", ()), trains=True)
    with pytest.raises(ValueError, match="role 'judge' trains but declares no update_keys"):
        resolve_roles([trained])


class TokenScorer(ReferenceWorker):
    """A second frozen model scoring every response token: its log-prob under the policy's
    starting weights, with the reference's micro-batch size (so it must equal the reference's
    bitwise: a different row count per matmul may round differently on some CPUs)."""

    role = "scorer"

    def score_tokens(self, td):
        return self._log_prob_shard(td, self.cfg.reference.log_prob_micro_batch_size_per_gpu, "scorer_log_probs")


SCORER = Role(
    name="scorer",
    worker=TokenScorer,
    enabled=lambda cfg: True,
    dp_size=lambda cfg: 2,
    init=lambda ctx: ("init_model", (ctx.model_path,)),
    forward=Forward("score_tokens", "scorer_log_probs"),
)


class SeeingTrainer(PPOTrainer):
    """Keeps each step's batch after the forward phase, and the keys each trained role was sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches, self.sent_keys, self.group_sizes = [], {}, {}

    def _apply_kl_and_advantages(self, batch, metrics):
        self.batches.append(batch.clone())
        self.group_sizes = {name: group.world_size for name, group in self.groups.items()}
        super()._apply_kl_and_advantages(batch, metrics)

    def plan_minibatches(self, batch, role, step):
        self.sent_keys[role] = set(batch.keys())
        return super().plan_minibatches(batch, role, step)


def test_a_role_added_by_one_declaration_runs_in_the_fit(ray_session, tiny_model_dir, tmp_path):
    """The scorer's per-token tensor reaches the step's batch (computed by 2 ranks, equal to the
    data-parallel reference's log-probs of the same tokens) and the loss never sees it."""
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "actor.use_kl_loss": True, "reference.dp_size": 2,
        "trainer.total_steps": 1, "trainer.default_local_dir": str(tmp_path)}))
    trainer = SeeingTrainer(cfg, roles=[SCORER])
    history = trainer.fit()
    assert [h["step"] for h in history] == [1] and len(trainer.batches) == 1
    assert all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    assert trainer.group_sizes == {"actor": 1, "rollout": 1, "reference": 2, "scorer": 2}
    assert trainer.groups == {}, "shutdown stops the added role with the others"
    for batch in trainer.batches:
        scores, mask = batch["scorer_log_probs"], batch["response_mask"].bool()
        assert scores.shape == batch["responses"].shape and torch.isfinite(scores).all()
        assert (scores[mask] < 0).all()
        assert torch.equal(scores, batch["ref_log_prob"])
    assert "ref_log_prob" in trainer.sent_keys["actor"] and "scorer_log_probs" not in trainer.sent_keys["actor"]
