"""DAPO's dynamic sampling and soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", sections 3.2 and 3.4), as pure torch functions.

Dynamic sampling: a group (one prompt's n responses) whose responses all score alike has zero
advantage under GRPO-style estimators, so it adds tokens to the batch but no gradient signal; such
groups are dropped and more prompts are generated until the batch holds enough informative groups.

Soft overlong punishment: a response that runs into the last `buffer_len` tokens before the length
limit is penalised linearly, from 0 at `max_response_length - buffer_len` to `-penalty_factor` at
`max_response_length`, so truncated answers are discouraged without a cliff.
"""

from __future__ import annotations

import torch

__all__ = ["groups_with_variance", "overlong_penalty", "rows_of_groups"]


def groups_with_variance(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] per-response values, B = G * group_size in group order (row r in group r // group_size)
    -> [G] bool: True where the group's values are not all equal.

    Equality is exact (max == min), not std > eps: a group of identical scores is what gives a zero
    advantage, and any difference, however small, is a signal the estimator sees.
    """
    if values.dim() != 1 or values.shape[0] % group_size:
        raise ValueError(f"values of shape {tuple(values.shape)} do not split into groups of {group_size}")
    grouped = values.reshape(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def rows_of_groups(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """[k] group indices -> the [k * group_size] row indices of those groups, group by group."""
    return (groups.long().unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """[B] response lengths (valid tokens) -> [B] penalties <= 0 to add to the scores:
    -penalty_factor * (length - (max_response_length - buffer_len)) / buffer_len where the length
    exceeds max_response_length - buffer_len, 0 elsewhere."""
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_response_length={max_response_length}]")
    expected = max_response_length - buffer_len
    excess = (response_lengths.to(torch.float32) - expected).clamp(min=0.0)
    return -penalty_factor * excess / buffer_len
