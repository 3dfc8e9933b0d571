"""A user's module for `trainer.imports` (tests/test_user_imports.py): a policy loss, an advantage
estimator and a rollout engine registered under names of their own, each leaving a mark a run's
metrics show. Only that test's `rlflow` subprocess imports it: the test session's registries (which
the invariance and composition tests iterate) never hold these names."""

from __future__ import annotations

import torch

from rlflow.algos import DualClipOptions, compute_policy_loss_vanilla, masked_mean_metric, register_adv_estimator
from rlflow.algos import register_policy_loss
from workers.rollout.engine import register_engine
from workers.rollout.hf import HFRollout

ADVANTAGE = 0.25


@register_adv_estimator("test_constant", needs_groups=True)
def constant_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **unused):
    """ADVANTAGE on every response token (needs_groups only to be checked by validation)."""
    advantages = ADVANTAGE * (response_mask != 0).to(token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_policy_loss("test_marked", options=DualClipOptions)
def marked_vanilla(batch, meta, options):
    """PPO's loss, reporting the advantages it was given (actor/plugin_advantage)."""
    loss, metrics = compute_policy_loss_vanilla(batch, meta, options)
    metrics["plugin_advantage"] = masked_mean_metric(batch["advantages"], batch["response_mask"])
    return loss, metrics


@register_engine("test_one_token")
class OneTokenRollout(HFRollout):
    """The HF engine keeping one token of each response (response/length_mean is 1)."""

    def generate_ids(self, *args, **kwargs):
        responses, log_probs = super().generate_ids(*args, **kwargs)
        return [r[:1] for r in responses], None if log_probs is None else [lp[:1] for lp in log_probs]
