"""Pure torch RL algorithms: loss aggregation, policy/value/entropy losses, KL, advantages.

Imports torch and the standard library only (no ray, transformers or omegaconf), so the driver and
tests can use it without paying for the heavy stacks.
"""

from .advantages import (
    ADV_ESTIMATORS,
    NEEDS_CRITIC,
    compute_gae_advantage_return,
    compute_gae_unwhitened,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    discounted_returns,
    estimator_inputs,
    get_adv_estimator_fn,
    register_adv_estimator,
)
from .kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from .losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
    register_policy_loss,
)
from .masked import masked_count, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "NEEDS_CRITIC",
    "compute_gae_advantage_return",
    "compute_gae_unwhitened",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "discounted_returns",
    "estimator_inputs",
    "get_adv_estimator_fn",
    "register_adv_estimator",
    "KL_PENALTY_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_penalty",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "agg_loss",
    "compute_entropy_loss",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gspo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "entropy_from_logits",
    "get_policy_loss_fn",
    "register_policy_loss",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
