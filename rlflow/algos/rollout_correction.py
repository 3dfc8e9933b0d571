"""Rollout correction: the rollout engine's policy vs the trainer's, measured and corrected.

Every sampled token has two log-probs:
- behaviour, ``rollout_log_probs``: the rollout engine's, under the distribution it was drawn from;
- proximal, ``old_log_probs``: the trainer's under the weights that generated the batch (the
  driver's recomputation; on the on-policy path, where the driver skips that forward, the update's
  own detached log-probs).
Their log-ratio ``old - rollout`` is the engine mismatch (kernels, precision, top-k/top-p
truncation) plus, for a stale batch, the policy lag.

Mismatch metrics (``mismatch_metrics``), each a rlflow.metrics.Metric with its aggregation, so the
driver reduces them exactly like every other metric, whatever the split:
- ``rollout_corr/log_ratio_mean``: token mean of old - rollout (MEAN, weight: valid tokens);
- ``rollout_corr/k3_kl``: token mean of k3 = exp(d) - 1 - d, d = old - rollout (an unbiased
  estimate of KL(behaviour || proximal) from the behaviour's samples; MEAN);
- ``rollout_corr/abs_diff_max``: the largest |old - rollout| over valid tokens (MAX; 0 without any);
- ``rollout_corr/out_of_band_frac``: the fraction of tokens whose ratio exp(d) is outside
  [low, high] (MEAN).

Correction (``RolloutCorrectionOptions.mode``; "none" reports the metrics only): per-token weights,
detached, that every policy loss's aggregation multiplies (``losses.aggregate_policy``, through the
batch key ``rollout_is_weights``). The objective is decoupled PPO (Hilton et al. 2022; AReaL's
decoupled loss): the policy loss's ratio stays pi_theta / pi_proximal (``old_log_probs``), and the
weight is pi_proximal / pi_behaviour:
- ``token_tis``: w_t = min(exp(d_t), cap) (truncated IS, "TIS", Yao et al. 2025);
- ``seq_tis``: w_t = min(exp(sum_t' d_t'), cap) for every token of the sequence (the product of
  its token ratios, truncated);
- ``token_mis``: w_t = exp(d_t) when it is in [low, high], else 0 (masked IS, IcePop);
- ``seq_mis``: w_t = rho = exp(sum_t' d_t') when rho is in [low, high], else 0 for the whole
  sequence (masked IS, MIS).
Each d, and each sequence's sum of them, is clamped to [-20, 20] before exp (exp stays finite).

Dropped tokens (weight 0) leave the loss through the numerator only: they stay in
``response_mask``, so ``batch_num_tokens`` and ``global_batch_size`` (the driver's counts of the
mini-batch) and every micro-batch's own counts are those of the uncorrected run in every layout; a
dropped token contributes 0 to the sum, and a sequence whose tokens are all dropped still counts as
a sequence. The policy statistics (pg_clipfrac, ppo_kl, ...) stay over all valid tokens. With the
correction on, ``rollout_corr/is_weight_mean`` (token mean of the weights),
``rollout_corr/truncated_frac`` (tokens whose weight the cap lowered) and
``rollout_corr/dropped_frac`` (tokens of weight 0) are reported as well.

With every ratio exactly 1 (rollout == old) every weight is exactly 1 (cap >= 1, low <= 1 <= high),
and x * 1 == x in IEEE arithmetic, so the loss and its gradient are bitwise those without the
correction.

Modes are registered with ``@register_rollout_correction(name)``: a function
``(log_ratio, mask, options) -> (weights, truncated)`` over one micro-batch, row-local (a sequence's
weight reads only its own row), which is what makes it independent of the split; the invariance
test iterates this registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from rlflow.metrics import Aggregation, Metric, token_mean_metric

from .losses import LossOptionError, _check_option
from .masked import masked_count, masked_sum

METRIC_PREFIX = "rollout_corr/"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
_LOG_RATIO_CLAMP = 20.0

CorrectionFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
ROLLOUT_CORRECTIONS: dict[str, CorrectionFn] = {}


def register_rollout_correction(name: str):
    """Decorator: register a correction mode ``fn(log_ratio, mask, options) -> (weights, truncated)``;
    log_ratio is old - rollout (clamped, 0 outside the mask), weights and truncated (bool: the cap
    lowered the weight) are [B, R]."""

    def decorator(fn: CorrectionFn) -> CorrectionFn:
        if name == "none" or (name in ROLLOUT_CORRECTIONS and ROLLOUT_CORRECTIONS[name] is not fn):
            raise ValueError(f"rollout correction {name!r} is already registered")
        ROLLOUT_CORRECTIONS[name] = fn
        return fn

    return decorator


def correction_modes() -> tuple[str, ...]:
    return ("none", *ROLLOUT_CORRECTIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionOptions:
    """mode: none | a registered correction; cap: the truncation C of the *_tis modes; [low, high]:
    the band of the *_mis modes and of the out_of_band_frac metric."""

    mode: str = "none"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self):
        if self.mode not in correction_modes():
            raise LossOptionError("mode", f"must be one of {', '.join(correction_modes())}, got {self.mode!r}")
        # a cap below 1 or a band without 1 would reweight tokens that are exactly on-policy
        _check_option("cap", self.cap, lambda v: v >= 1, ">= 1 (a weight above the cap is lowered to it)")
        _check_option("low", self.low, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_option("high", self.high, lambda v: v >= 1, ">= 1")
        if not self.low < self.high:
            raise LossOptionError("low", f"must be < high ({self.high!r}), got {self.low!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def options_from_config(section) -> RolloutCorrectionOptions:
    """From the config section algorithm.rollout_correction (read by attribute)."""
    return RolloutCorrectionOptions(mode=section.mode, cap=section.cap, low=section.low, high=section.high)


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (mask != 0).to(like.device)


def log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """old - rollout per token, detached, clamped to [-20, 20], 0 outside the mask."""
    diff = torch.clamp(old_log_probs.detach() - rollout_log_probs.detach(), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.where(_valid(mask, diff), diff, torch.zeros_like(diff))


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The row's summed log-ratio (the log of its ratio product), broadcast to its tokens."""
    summed = torch.clamp(masked_sum(log_ratio, mask, axis=-1), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return summed.unsqueeze(-1).expand_as(log_ratio)


def _truncate(ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    truncated = ratio > cap
    return torch.where(truncated, torch.full_like(ratio, cap), ratio), truncated


def _band_mask(ratio: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    in_band = (ratio >= low) & (ratio <= high)
    return torch.where(in_band, ratio, torch.zeros_like(ratio)), torch.zeros_like(in_band)


@register_rollout_correction("token_tis")
def token_tis(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions):
    """Token-level truncated IS: min(pi_old / pi_rollout, cap) per token."""
    return _truncate(torch.exp(log_ratio), options.cap)


@register_rollout_correction("seq_tis")
def seq_tis(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions):
    """Sequence-level truncated IS: min(prod_t pi_old / pi_rollout, cap) on every token of the row."""
    return _truncate(torch.exp(_sequence_log_ratio(log_ratio, mask)), options.cap)


@register_rollout_correction("token_mis")
def token_mis(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions):
    """Token-level masked IS (IcePop): the token's ratio inside [low, high], 0 outside."""
    return _band_mask(torch.exp(log_ratio), options.low, options.high)


@register_rollout_correction("seq_mis")
def seq_mis(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions):
    """Sequence-level masked IS (MIS): the sequence's ratio product inside [low, high], else the
    whole sequence gets 0."""
    return _band_mask(torch.exp(_sequence_log_ratio(log_ratio, mask)), options.low, options.high)


def _token_means(values: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, Metric]:
    """Local token means, weighted by the local valid-token count (one host sync for all)."""
    valid = mask != 0
    count = masked_count(mask)
    names = list(values)
    sums = torch.stack([masked_sum(values[name].to(torch.float64), valid) for name in names])
    means = (sums / count.to(sums.dtype).clamp(min=1)).tolist()
    num_tokens = count.item()
    return {METRIC_PREFIX + name: token_mean_metric(mean, num_tokens) for name, mean in zip(names, means)}


def mismatch_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions) -> dict[str, Metric]:
    """The rollout-vs-trainer mismatch of one micro-batch (log_ratio: ``log_ratio(...)``)."""
    valid = _valid(mask, log_ratio)
    ratio = torch.exp(log_ratio)  # in the values' dtype, like the weights: the same band decisions
    d = log_ratio.to(torch.float64)  # k3 ~ d^2 / 2 of a d ~ 1e-7: float32 would round it away
    metrics = _token_means({
        "log_ratio_mean": d,
        "k3_kl": torch.expm1(d) - d,
        "out_of_band_frac": ((ratio < options.low) | (ratio > options.high)).to(log_ratio.dtype),
    }, valid)
    abs_diff = torch.where(valid, log_ratio.abs(), torch.zeros_like(log_ratio))
    abs_max = float(abs_diff.max()) if abs_diff.numel() else 0.0
    metrics[METRIC_PREFIX + "abs_diff_max"] = Metric(abs_max, Aggregation.MAX)
    return metrics


def _weights(ratio_log: torch.Tensor, mask: torch.Tensor, options: RolloutCorrectionOptions):
    weights, truncated = ROLLOUT_CORRECTIONS[options.mode](ratio_log, mask, options)
    valid = _valid(mask, weights)
    return torch.where(valid, weights, torch.ones_like(weights)).detach(), truncated & valid


def rollout_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       options: RolloutCorrectionOptions) -> torch.Tensor | None:
    """The per-token weights of options.mode, [B, R], detached, 1 outside the mask; None for mode
    none."""
    if not options.enabled:
        return None
    return _weights(log_ratio(old_log_probs, rollout_log_probs, mask), mask, options)[0]


def compute_rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       options: RolloutCorrectionOptions) -> tuple[torch.Tensor | None, dict[str, Metric]]:
    """One micro-batch's correction weights (None for mode none) and metrics: the mismatch, and
    with a correction the weights' mean and the truncated and dropped fractions."""
    ratio_log = log_ratio(old_log_probs, rollout_log_probs, mask)
    metrics = mismatch_metrics(ratio_log, mask, options)
    if not options.enabled:
        return None, metrics
    weights, truncated = _weights(ratio_log, mask, options)
    valid = _valid(mask, weights)
    metrics.update(_token_means({
        "is_weight_mean": weights,
        "truncated_frac": truncated.to(weights.dtype),
        "dropped_frac": (valid & (weights == 0)).to(weights.dtype),
    }, valid))
    return weights, metrics
