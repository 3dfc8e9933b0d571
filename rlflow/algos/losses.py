"""Loss aggregation, policy losses, value loss and entropy loss.

The normalisation contract (docs: DESIGN.md): every micro-batch loss is normalised by counts of the
WHOLE mini-batch (``batch_num_tokens``, ``global_batch_size``) and multiplied by ``dp_size``, so
that summing micro-batch gradients on a rank and then averaging over ranks (what DDP/FSDP do) gives
exactly the gradient of the whole mini-batch computed in one piece. Per-token statistics returned
next to a loss are LOCAL masked means; the caller weights them by the local valid-token count.
"""

from __future__ import annotations

from typing import Callable

import torch

from .masked import masked_count, masked_mean, masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# Which piece of mini-batch metadata each mode divides by (token-sum divides by nothing).
_GLOBAL_COUNT_OF_MODE = {
    "token-mean": "batch_num_tokens",
    "token-sum": None,
    "seq-mean-token-sum": "global_batch_size",
    "seq-mean-token-mean": "global_batch_size",
    "seq-mean-token-sum-norm": "global_batch_size",
}

# Keep exp() of a log-ratio finite; same bound as common PPO implementations.
_LOG_RATIO_CLAMP = 20.0


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Unknown loss_agg_mode {loss_agg_mode!r}; expected one of: {', '.join(LOSS_AGG_MODES)}"
        )


def _as_denominator(count, like: torch.Tensor) -> torch.Tensor:
    """A count as a tensor on like's device/dtype; 0 becomes 1 (the numerator is then 0 too).

    That keeps a micro-batch without valid tokens at loss 0 with a gradient path, instead of NaN.
    """
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return torch.where(count == 0, torch.ones_like(count), count)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss of one micro-batch into a scalar.

    Args:
        loss_mat: per-token loss, [B, T].
        loss_mask: 1 where a token counts, [B, T].
        loss_agg_mode: one of LOSS_AGG_MODES.
        dp_size: data-parallel ranks sharing the mini-batch; ``* dp_size`` cancels the mean that
            DDP/FSDP take over ranks.
        batch_num_tokens: valid tokens in the whole mini-batch (token-mean). None: this
            micro-batch's own count.
        global_batch_size: sequences with >= 1 valid token in the whole mini-batch (seq-mean-*).
            None: this micro-batch's own count.
        loss_scale_factor: constant divisor of seq-mean-token-sum-norm (the config's
            data.max_response_length). Required in that mode; never the padded width, which varies
            with the split.
    """
    _check_mode(loss_agg_mode)
    if int(dp_size) != dp_size or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")

    global_count_name = _GLOBAL_COUNT_OF_MODE[loss_agg_mode]
    global_count = {"batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}.get(
        global_count_name
    )
    if global_count_name is not None and global_count is None and dp_size > 1:
        raise ValueError(
            f"agg_loss(loss_agg_mode={loss_agg_mode!r}) got dp_size={dp_size} but no "
            f"{global_count_name}: with several dp ranks the loss must be normalised by the count of "
            f"the whole mini-batch (pass the BatchMeta's {global_count_name}); normalising by each "
            f"rank's own count would make the gradient depend on the split"
        )
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError(
                "agg_loss(loss_agg_mode='seq-mean-token-sum-norm') needs loss_scale_factor to be set "
                "(a constant such as data.max_response_length); it is not defaulted to the padded "
                "width, because that width changes with the micro-batch split"
            )
        if not loss_scale_factor > 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor!r}")

    if loss_agg_mode == "token-mean":
        count = masked_count(loss_mask) if batch_num_tokens is None else batch_num_tokens
        loss = masked_sum(loss_mat, loss_mask) / _as_denominator(count, loss_mat)
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, loss_mask)
    else:
        seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)
        seq_token_counts = masked_count(loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            # A fully masked row has sum 0 and count 0: clamp keeps it at 0 rather than NaN.
            seq_losses = seq_sums / seq_token_counts.to(seq_sums.dtype).clamp(min=1)
        else:
            seq_losses = seq_sums
        if global_batch_size is None:
            num_seqs = (seq_token_counts > 0).sum()
        else:
            num_seqs = global_batch_size
        loss = seq_losses.sum() / _as_denominator(num_seqs, loss_mat)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / loss_scale_factor
    return loss * dp_size


# ----------------------------------------------------------------------------------- value loss


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """Clipped value loss: 0.5 * agg_loss(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).

    Returns (vf_loss, vf_clipfrac); vf_clipfrac is the local masked mean of where the clipped
    branch is the larger one (detached).
    """
    vpreds_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    unclipped_sq_err = (vpreds - returns) ** 2
    clipped_sq_err = (vpreds_clipped - returns) ** 2
    per_token_loss = torch.maximum(unclipped_sq_err, clipped_sq_err)
    vf_loss = 0.5 * agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    # a token counts as clipped only when the clip moved it: values + clamp(vpreds - values) can round
    # one ulp away from vpreds inside the range, which made the fraction depend on the split
    clipped = (clipped_sq_err > unclipped_sq_err) & ((vpreds - values).abs() > cliprange_value)
    vf_clipfrac = masked_mean(clipped.to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac.detach()


# -------------------------------------------------------------------------------- entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp(z) - sum(p * z) (stable)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """Aggregated per-token entropy (the caller subtracts entropy_coeff * this from the loss)."""
    return agg_loss(
        entropy,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )


# ----------------------------------------------------------------------------- policy losses

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str):
    """Decorator: register a policy loss under ``name``.

    A registered loss must have the signature of compute_policy_loss_vanilla, return
    (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), and aggregate through agg_loss; the
    invariance test iterates this registry.
    """

    def decorator(fn: Callable) -> Callable:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"Unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}"
        )
    return POLICY_LOSSES[name]


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """PPO clipped surrogate with asymmetric clip range and dual clip (Ye et al. 2020).

    For negative advantages the loss -A * ratio is additionally capped at -A * clip_ratio_c, so a
    huge ratio on a bad action cannot produce an unbounded update.
    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), the last three local masked means.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo_clip_loss = torch.maximum(unclipped_loss, clipped_loss)

    dual_clip_bound = -advantages * clip_ratio_c
    dual_clipped_loss = torch.minimum(ppo_clip_loss, dual_clip_bound)
    negative_adv = advantages < 0
    per_token_loss = torch.where(negative_adv, dual_clipped_loss, ppo_clip_loss)

    pg_loss = agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    dtype = log_prob.dtype
    pg_clipfrac = masked_mean((clipped_loss > unclipped_loss).to(dtype), response_mask)
    pg_clipfrac_lower = masked_mean(
        ((ppo_clip_loss > dual_clip_bound) & negative_adv).to(dtype), response_mask
    )
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach()


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """GSPO (Zheng et al. 2025): clip a sequence-level ratio exp(mean_t log-ratio).

    Token-level form: log s_it = sg[log s_i] + log_prob_t - sg[log_prob_t]; its value is the
    sequence ratio, its gradient flows through each token's own log-prob. With seq-mean-token-mean
    (GSPO's setting; pass it explicitly, the default is the uniform token-mean) this is exactly the
    sequence-level objective. The sequence log-ratio is
    computed within each row, so it does not depend on how rows are split. clip_ratio_c is unused.
    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower=0).
    """
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, axis=-1)  # [B]
    straight_through_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(straight_through_log_ratio, max=10.0))

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token_loss = torch.maximum(unclipped_loss, clipped_loss)

    pg_loss = agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    dtype = log_prob.dtype
    pg_clipfrac = masked_mean((clipped_loss > unclipped_loss).to(dtype), response_mask)
    ppo_kl = masked_mean(-_log_ratio(old_log_prob, log_prob), response_mask)
    pg_clipfrac_lower = torch.zeros((), dtype=dtype, device=log_prob.device)
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """Importance-weighted policy gradient without clipping: loss = -A * exp(lp - old_lp).

    On-policy (old == current) its gradient is REINFORCE's -A * grad log pi. The clip arguments
    are accepted for a uniform signature and ignored; both clip fractions are 0.
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    per_token_loss = -advantages * torch.exp(log_ratio)
    pg_loss = agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, zero, ppo_kl.detach(), zero.clone()


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """GMPO (geometric-mean policy optimisation): -A * geometric mean of clipped token ratios.

    Token log-ratios are clipped in LOG space to [-clip_ratio_low, clip_ratio_high] (GMPO's paper
    uses 0.4; the defaults are the uniform 0.2 of the registry signature), pessimistically
    for the sign of the advantage (like PPO's min). The sequence loss -A_i * exp(mean_t clipped
    log-ratio) is broadcast onto the row's valid tokens and aggregated by agg_loss, so it obeys the
    normalisation contract (seq-mean-token-mean averages the sequence losses over sequences).
    clip_ratio_c is unused. Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower=0).
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    sign = torch.sign(advantages)
    signed_log_ratio = sign * log_ratio
    signed_clipped = sign * torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    # min over the signed pair = the pessimistic choice; multiply the sign back.
    pessimistic_log_ratio = sign * torch.minimum(signed_log_ratio, signed_clipped)

    seq_log_ratio = masked_mean(pessimistic_log_ratio, response_mask, axis=-1)  # [B]
    seq_advantage = masked_mean(advantages, response_mask, axis=-1)  # outcome advantage per row
    seq_loss = -seq_advantage * torch.exp(seq_log_ratio)  # [B]
    per_token_loss = seq_loss.unsqueeze(-1).expand_as(log_prob)

    pg_loss = agg_loss(
        per_token_loss,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    dtype = log_prob.dtype
    clipped = (signed_clipped < signed_log_ratio) & (sign != 0)
    pg_clipfrac = masked_mean(clipped.to(dtype), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    pg_clipfrac_lower = torch.zeros((), dtype=dtype, device=log_prob.device)
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower
