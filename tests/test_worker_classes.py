"""PPOTrainer(worker_classes=...): a role's worker can be replaced by a subclass (custom workers,
and the tests' negative controls); anything else is refused before Ray starts."""

from __future__ import annotations

import pytest

from controllers.ppo import PPOTrainer, default_worker_classes
from rlflow import load_config
from workers.critic import CriticWorker


class MyCritic(CriticWorker):
    pass


def test_a_subclass_replaces_its_role_only():
    trainer = PPOTrainer(load_config(), worker_classes={"critic": MyCritic})
    assert trainer.worker_classes == {**default_worker_classes(), "critic": MyCritic}


@pytest.mark.parametrize("classes, error, pattern", [
    ({"critc": MyCritic}, ValueError, r"unknown role 'critc'; roles: actor, critic, reference, rollout"),
    ({"actor": MyCritic}, TypeError, r"worker_classes\['actor'\] must be a subclass of ActorWorker"),
    ({"actor": "workers.actor.ActorWorker"}, TypeError, r"must be a subclass of ActorWorker"),
])
def test_other_classes_are_refused(classes, error, pattern):
    with pytest.raises(error, match=pattern):
        PPOTrainer(load_config(), worker_classes=classes)
