"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.algos import (
    ADV_ESTIMATORS,
    NEEDS_CRITIC,
    NEEDS_GROUPS,
    compute_gae_advantage_return,
    compute_gae_unwhitened,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    estimator_inputs,
    get_adv_estimator_fn,
)

D = torch.float64


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=D), **kw)


# ---------------------------------------------------------------------------------------- GAE

# rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (gamma * lam = 0.72):
#   t=2: delta = 1 + 0.9 * 0   - 0.7 = 0.3    A2 = 0.3
#   t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03   A1 = 0.03 + 0.72 * 0.3   = 0.246
#   t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04   A0 = 0.04 + 0.72 * 0.246 = 0.21712
#   returns = A + V = [0.71712, 0.846, 1.0]
GAE_REWARDS = [0.0, 0.0, 1.0]
GAE_VALUES = [0.5, 0.6, 0.7]
GAE_ADV = [0.21712, 0.246, 0.3]
GAE_RETURNS = [0.71712, 0.846, 1.0]


def test_gae_hand_example_three_steps():
    rewards = torch.tensor([GAE_REWARDS], dtype=D)
    values = torch.tensor([GAE_VALUES], dtype=D)
    mask = torch.ones(1, 3, dtype=D)
    close(compute_gae_unwhitened(rewards, values, mask, gamma=0.9, lam=0.8), [GAE_ADV])
    advantages, returns = compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    close(returns, [GAE_RETURNS])
    # Whitened with the unbiased variance over the valid tokens (+1e-8 inside the sqrt).
    raw = torch.tensor(GAE_ADV, dtype=D)
    close(advantages, [((raw - raw.mean()) / (raw.var() + 1e-8).sqrt()).tolist()])


def test_gae_variable_length_padding_does_not_leak():
    # Row 0 is the 3-step example padded to 5 with garbage values/rewards; row 1 is full length.
    rewards = torch.tensor([GAE_REWARDS + [5.0, 5.0], [0.0, 1.0, 0.0, 0.0, 2.0]], dtype=D)
    values = torch.tensor([GAE_VALUES + [99.0, -99.0], [0.1, 0.2, 0.3, 0.4, 0.5]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=D)
    raw = compute_gae_unwhitened(rewards, values, mask, gamma=0.9, lam=0.8)
    close(raw[0], GAE_ADV + [0.0, 0.0])
    alone = compute_gae_unwhitened(rewards[1:], values[1:], mask[1:], gamma=0.9, lam=0.8)
    close(raw[1], alone[0])

    advantages, returns = compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    close(returns[0], GAE_RETURNS + [0.0, 0.0])
    valid = mask.bool()
    assert torch.all(advantages[~valid] == 0) and torch.all(returns[~valid] == 0)
    # Whitened over the 8 valid tokens only.
    assert float(advantages[valid].mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(advantages[valid].std()) == pytest.approx(1.0, rel=1e-6)


def test_gae_skips_holes_in_the_mask():
    # A masked position inside the response (e.g. tool output) is skipped: the recursion links the
    # valid tokens around it as if the hole were not there.
    rewards = torch.tensor([[0.0, 7.0, 0.0, 1.0]], dtype=D)
    values = torch.tensor([[0.5, 42.0, 0.6, 0.7]], dtype=D)
    mask = torch.tensor([[1, 0, 1, 1]], dtype=D)
    raw = compute_gae_unwhitened(rewards, values, mask, gamma=0.9, lam=0.8)
    close(raw, [[GAE_ADV[0], 0.0, GAE_ADV[1], GAE_ADV[2]]])


# ------------------------------------------------------------------------------- GRPO / RLOO


def outcome_rewards(scores, lengths, width):
    """Put each score on the last valid token of its row (as the reward stage does)."""
    rewards = torch.zeros(len(scores), width, dtype=D)
    mask = torch.zeros(len(scores), width, dtype=D)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        if length:
            rewards[row, length - 1] = score
    return rewards, mask


def per_row(advantages, mask):
    """The row's advantage (constant over its valid tokens), after checking it is constant."""
    values = []
    for adv_row, mask_row in zip(advantages, mask):
        valid = adv_row[mask_row.bool()]
        assert torch.all(adv_row[~mask_row.bool()] == 0)
        assert torch.allclose(valid, valid[:1].expand_as(valid))
        values.append(float(valid[0]))
    return values


def test_grpo_group_with_known_answer_and_group_of_one():
    # Group 0: scores [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3).
    #   A = +-0.5 * sqrt(3) = +-0.8660254. Group 1 has one response: A = 0.
    rewards, mask = outcome_rewards([1, 0, 0, 1, 0.7], [3, 1, 4, 2, 2], width=4)
    index = torch.tensor([0, 0, 0, 0, 1])
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=index, epsilon=0.0
    )
    half_sqrt3 = 0.5 * math.sqrt(3)
    assert per_row(advantages, mask) == pytest.approx([half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3, 0.0])
    torch.testing.assert_close(returns, advantages)


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask = outcome_rewards([1, 0, 0, 1, 0.7], [3, 1, 4, 2, 2], width=4)
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=torch.tensor([0, 0, 0, 0, 1]),
        norm_adv_by_std_in_grpo=False,
    )
    assert per_row(advantages, mask) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])


def test_grpo_epsilon_and_identical_scores():
    # All scores equal: std 0 -> 0 / (0 + eps) = 0, not NaN.
    rewards, mask = outcome_rewards([1, 1, 1], [2, 2, 2], width=2)
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=torch.tensor([5, 5, 5])
    )
    assert torch.all(advantages == 0)


def test_grpo_accepts_uid_strings_and_interleaved_groups():
    rewards, mask = outcome_rewards([2, 4, 1, 3], [1, 1, 1, 1], width=1)
    by_tensor, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=torch.tensor([7, 3, 7, 3])
    )
    by_uid, _ = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=["a", "b", "a", "b"]
    )
    torch.testing.assert_close(by_tensor, by_uid)
    # Group 7: scores [2, 1] mean 1.5, std sqrt(0.5): A = +-0.5 / sqrt(0.5) = +-0.7071
    assert per_row(by_tensor, mask) == pytest.approx([0.70710, 0.70710, -0.70710, -0.70710], abs=1e-4)


def test_rloo_group_with_known_answer_and_group_of_one():
    # Group 0, scores [1, 0, 0, 1]: a 1 is compared with the mean of the others (1/3) -> 2/3,
    #   a 0 with 2/3 -> -2/3. Group 1, scores [3, 1]: +2, -2. Group 2 (one response): 0.
    rewards, mask = outcome_rewards([1, 0, 0, 1, 3, 1, 5], [2, 3, 1, 2, 1, 3, 2], width=3)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    advantages, returns = compute_rloo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=index
    )
    assert per_row(advantages, mask) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 0.0])
    torch.testing.assert_close(returns, advantages)


# ----------------------------------------------------------------------- REINFORCE++ / ReMax


def test_reinforce_plus_plus_returns_and_whitening():
    # gamma 0.5, rewards [0, 0, 1] -> return-to-go [0.25, 0.5, 1]; padded row ignores the 9.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, gamma=0.5
    )
    close(returns, [[0.25, 0.5, 1.0], [2.0, 0.0, 0.0]])
    valid_returns = torch.tensor([0.25, 0.5, 1.0, 2.0], dtype=D)
    expected = (valid_returns - valid_returns.mean()) / valid_returns.std()
    close(advantages[mask.bool()], expected, atol=1e-6, rtol=1e-6)
    assert torch.all(advantages[~mask.bool()] == 0)


def test_remax_subtracts_the_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 7.0, 7.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    baselines = torch.tensor([0.4, 0.5], dtype=D)
    advantages, returns = compute_remax_outcome_advantage(
        token_level_rewards=rewards, reward_baselines=baselines, response_mask=mask
    )
    close(returns, [[1.0, 1.0, 1.0], [0.5, 0.0, 0.0]])
    close(advantages, [[0.6, 0.6, 0.6], [0.0, 0.0, 0.0]])


# ------------------------------------------------------------------------------------- registry


def test_registry_and_uniform_calling_convention():
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "remax"}
    assert NEEDS_CRITIC == {"gae"}
    assert NEEDS_GROUPS == {"grpo", "rloo"}  # declared where they are registered; validation reads them
    for name in ADV_ESTIMATORS:
        assert ("values" in estimator_inputs(name)) == (name in NEEDS_CRITIC)
        assert ("index" in estimator_inputs(name)) == (name in NEEDS_GROUPS)
    with pytest.raises(ValueError, match="grpo"):
        get_adv_estimator_fn("ppo")

    # The driver builds one kwargs dict and every estimator takes what it needs.
    rewards, mask = outcome_rewards([1, 0, 1, 1], [2, 3, 1, 3], width=3)
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        values=torch.full_like(rewards, 0.1),
        index=torch.tensor([0, 0, 1, 1]),
        reward_baselines=torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=D),
        gamma=1.0,
        lam=0.95,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        some_future_config_key="ignored",
    )
    for name, fn in ADV_ESTIMATORS.items():
        assert set(estimator_inputs(name)) <= set(kwargs), name
        advantages, returns = fn(**kwargs)
        assert advantages.shape == returns.shape == rewards.shape
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
        assert torch.all(advantages[~mask.bool()] == 0), name
