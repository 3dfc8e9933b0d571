"""Advantage estimators, computed on the driver over the whole training batch.

Uniform calling convention: every registered estimator is called with keyword arguments and
accepts ``**unused``, so the driver can build one kwargs dict (token_level_rewards, response_mask, values,
index, reward_baselines, gamma, lam, epsilon, norm_adv_by_std_in_grpo, ...) and call
``get_adv_estimator_fn(name)(**kwargs)``. Each returns (advantages, returns), both [B, T] and zero
wherever response_mask is 0. ``estimator_inputs(name)`` lists the inputs an estimator requires.
Traits are declared at registration and read by config validation: the estimators in NEEDS_CRITIC
need ``values`` (a critic starts), those in NEEDS_GROUPS compare a prompt's responses (rollout.n >= 2).

Masks may be right-padded or have holes: the backward recursions carry their state across masked
positions unchanged, so nothing at a masked position (values or rewards in padding) leaks in.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from .masked import masked_whiten

ADV_ESTIMATORS: dict[str, Callable] = {}
NEEDS_CRITIC: set[str] = set()
NEEDS_GROUPS: set[str] = set()


def register_adv_estimator(name: str, needs_critic: bool = False, needs_groups: bool = False):
    """Decorator: register an advantage estimator under ``name``. needs_critic: it reads
    ``values`` (a critic starts unless critic.enable says otherwise); needs_groups: it compares the
    responses of a prompt (``index``), so rollout.n must be >= 2."""

    def decorator(fn: Callable) -> Callable:
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        for traits, declared in ((NEEDS_CRITIC, needs_critic), (NEEDS_GROUPS, needs_groups)):
            if declared:
                traits.add(name)
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> Callable:
    if name not in ADV_ESTIMATORS:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; registered: {', '.join(sorted(ADV_ESTIMATORS))}"
        )
    return ADV_ESTIMATORS[name]


def estimator_inputs(name: str) -> tuple[str, ...]:
    """Names of the keyword arguments ``name`` requires (those without a default)."""
    params = inspect.signature(get_adv_estimator_fn(name)).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.default is inspect.Parameter.empty
    )


def _valid(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (response_mask != 0).to(device=like.device)


# ----------------------------------------------------------------------------------------- GAE


def compute_gae_unwhitened(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """GAE advantages before whitening, [B, T], 0 at masked positions.

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next, where "next" is
    the next VALID token of the row; after the last valid token V_next = A_next = 0 (terminal).
    """
    valid = _valid(response_mask, values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        is_valid = valid[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        # Masked positions keep the carry as it is, so padding values never enter the recursion.
        next_advantage = torch.where(is_valid, advantage_t, next_advantage)
        next_value = torch.where(is_valid, values[:, t], next_value)
        advantages[:, t] = torch.where(is_valid, advantage_t, torch.zeros_like(advantage_t))
    return advantages


@register_adv_estimator("gae", needs_critic=True)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    **unused,
):
    """GAE (Schulman et al. 2016). returns = unwhitened advantages + values (the critic target);
    advantages are whitened over the batch's valid tokens (as verl does)."""
    with torch.no_grad():
        valid = _valid(response_mask, values)
        raw_advantages = compute_gae_unwhitened(token_level_rewards, values, response_mask, gamma, lam)
        returns = torch.where(valid, raw_advantages + values, torch.zeros_like(values))
        advantages = torch.where(
            valid, masked_whiten(raw_advantages, response_mask), torch.zeros_like(values)
        )
    return advantages, returns


# ------------------------------------------------------------------------ outcome (group) based


def _group_ids(index, device) -> torch.Tensor:
    """Group ids as a [B] long tensor; accepts a tensor or a sequence of hashables (e.g. uids)."""
    if isinstance(index, torch.Tensor):
        return index.to(device=device).reshape(-1)
    first_seen: dict = {}
    ids = [first_seen.setdefault(key, len(first_seen)) for key in index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, index):
    """Per-row (group size, group sum, group mean, unbiased group std) for group ids ``index``."""
    group = _group_ids(index, scores.device)
    if group.shape[0] != scores.shape[0]:
        raise ValueError(f"index has {group.shape[0]} entries for {scores.shape[0]} responses")
    _, slot = torch.unique(group, return_inverse=True)
    num_groups = int(slot.max()) + 1 if slot.numel() else 0
    size = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, slot, torch.ones_like(scores)
    )
    total = torch.zeros_like(size).index_add_(0, slot, scores)
    mean = total / size
    sq_dev = torch.zeros_like(size).index_add_(0, slot, (scores - mean[slot]) ** 2)
    std = torch.sqrt(sq_dev / (size - 1).clamp(min=1))  # torch.std's unbiased estimate
    return size[slot], total[slot], mean[slot], std[slot]


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    valid = _valid(response_mask, token_level_rewards)
    return torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards)).sum(-1)


def _broadcast_over_valid(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    valid = _valid(response_mask, per_row)
    per_token = per_row.unsqueeze(-1).expand(valid.shape)
    return torch.where(valid, per_token, torch.zeros_like(per_token))


@register_adv_estimator("grpo", needs_groups=True)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **unused,
):
    """GRPO: score_i = sum of row i's token rewards; A_i = (score_i - group mean) / (group std + eps)
    with the unbiased std; norm_adv_by_std_in_grpo=False is Dr.GRPO (no std division).
    A group of one has no baseline to compare with: its advantage is 0. returns = advantages."""
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        size, _, mean, std = _group_stats(scores, index)
        centered = scores - mean
        per_row = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered
        per_row = torch.where(size > 1, per_row, torch.zeros_like(per_row))
        advantages = _broadcast_over_valid(per_row, response_mask)
    return advantages, advantages.clone()


@register_adv_estimator("rloo", needs_groups=True)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    **unused,
):
    """RLOO: A_i = score_i - mean of the OTHER scores of its group; a group of one gets 0.
    (epsilon is accepted for a uniform signature; no division by a std happens here.)"""
    with torch.no_grad():
        scores = _sequence_scores(token_level_rewards, response_mask)
        size, total, _, _ = _group_stats(scores, index)
        leave_one_out_mean = (total - scores) / (size - 1).clamp(min=1)
        per_row = torch.where(size > 1, scores - leave_one_out_mean, torch.zeros_like(scores))
        advantages = _broadcast_over_valid(per_row, response_mask)
    return advantages, advantages.clone()


# ----------------------------------------------------------------------- return-to-go based


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float):
    """G_t = r_t + gamma * G_next over the valid tokens of each row (0 at masked positions)."""
    valid = _valid(response_mask, token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[-1])):
        is_valid = valid[:, t]
        running = torch.where(is_valid, token_level_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(is_valid, running, torch.zeros_like(running))
    return returns


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    **unused,
):
    """REINFORCE++: discounted return-to-go, whitened over the batch's valid tokens.
    returns = the unwhitened return-to-go."""
    with torch.no_grad():
        valid = _valid(response_mask, token_level_rewards)
        returns = discounted_returns(token_level_rewards, response_mask, gamma)
        advantages = torch.where(
            valid, masked_whiten(returns, response_mask), torch.zeros_like(returns)
        )
    return advantages, returns


@register_adv_estimator("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    **unused,
):
    """ReMax: A_t = (undiscounted return-to-go)_t - b, with b the score of the greedy response
    (reward_baselines, [B]). returns = the return-to-go."""
    with torch.no_grad():
        returns = discounted_returns(token_level_rewards, response_mask, 1.0)
        baseline = reward_baselines.to(returns.dtype).reshape(-1, 1)
        valid = _valid(response_mask, returns)
        advantages = torch.where(valid, returns - baseline, torch.zeros_like(returns))
    return advantages, returns
