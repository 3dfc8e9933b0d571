"""Masked reductions over per-token tensors.

Masks are 0/1 (float, long or bool) with the shape of the values. Positions where the mask is 0
are replaced by 0 before any arithmetic, so an inf/NaN sitting in padding (e.g. exp of a large
log-ratio) cannot poison a sum through ``0 * inf``.
"""

from __future__ import annotations

import torch


def _zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, with masked positions forced to exactly 0 (NaN/inf-safe)."""
    mask = mask.to(values.device)
    weighted = values * mask.to(values.dtype)
    return torch.where(mask != 0, weighted, torch.zeros_like(weighted))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of values where mask is set (over all elements, or along ``axis``)."""
    zeroed = _zero_masked(values, mask)
    return zeroed.sum() if axis is None else zeroed.sum(dim=axis)


def masked_count(mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Number of valid positions, as an int64 tensor.

    Counted in integers: a bf16/fp16 mask summed in its own dtype stops being exact at 256/2048.
    Callers cast the count to the dtype of what they divide.
    """
    valid = (mask != 0).to(torch.int64)
    return valid.sum() if axis is None else valid.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of values where mask is set; 0 (not NaN) where nothing is valid.

    Returning 0 for an empty mask matters: callers weight a per-micro-batch mean by its local token
    count, and ``NaN * 0`` would still be NaN.
    """
    total = masked_sum(values, mask, axis)
    count = masked_count(mask, axis).to(total.dtype)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the valid positions (Bessel-corrected when more than one is valid)."""
    mean = masked_mean(values, mask)
    centered_sq = (values - mean) ** 2
    var = masked_mean(centered_sq, mask)
    if unbiased:
        count = masked_count(mask).to(var.dtype)
        # n / (n - 1), left at 1 for n <= 1 so a single valid token does not divide by zero.
        correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        var = var * correction
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / std with mean and std taken over the valid positions only.

    Like verl, every position is transformed (the statistics come from valid ones); callers mask
    the result. ``shift_mean=False`` only rescales (adds the mean back).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
