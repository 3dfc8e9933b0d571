"""Loss aggregation and the loss terms: policy losses, value loss, entropy bonus, KL in the loss.

The normalisation contract (docs/CONVENTIONS.md, "Loss normalisation"): every micro-batch loss is
normalised by counts of the WHOLE mini-batch (``batch_num_tokens``, ``global_batch_size``) and
multiplied by ``dp_size``, so that summing micro-batch gradients on a rank and then averaging over
ranks (what DDP/FSDP do) gives exactly the gradient of the whole mini-batch computed in one piece.

The term contract: a loss term is ``fn(batch, meta, options) -> (loss, metrics)``.
- ``batch``: a mapping of the micro-batch's tensors (a TensorDict works): the keys of
  docs/CONVENTIONS.md plus the worker's forward outputs (``log_probs``, ``entropy``, ``vpreds``);
  a term declares the keys it reads when it is registered.
- ``meta``: the BatchMeta of the whole mini-batch (anything with ``dp_size`` and ``loss_kwargs()``),
  or None for a local call: the micro-batch's own counts and dp_size 1.
- ``options``: the term's own frozen dataclass, a LossOptions subclass.
- ``loss``: the term's contribution to the micro-batch loss, aggregated through agg_loss with
  meta's counts; ``metrics``: {name: rlflow.metrics.Metric}, each declaring its aggregation
  (a per-token statistic is weighted by the micro-batch's own valid-token count).
A new input is a new batch key and a new setting a new options field: no signature changes.

Rollout correction (rlflow.algos.rollout_correction) enters every policy loss in one place:
``aggregate_policy`` multiplies the per-token loss by the batch's ``rollout_is_weights`` (a declared
optional input of every policy loss) before ``aggregate``; the mask, and so every count, is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

import torch

from rlflow.metrics import Metric, loss_metric, token_mean_metric

from .kl import KL_PENALTY_MODES, kl_penalty
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



# ------------------------------------------------------------------------------ the term contract

Batch = Mapping[str, torch.Tensor]
TermFn = Callable[..., "tuple[torch.Tensor, dict[str, Metric]]"]


class LossOptionError(ValueError):
    """A bad value of one option of a loss term: ``option`` (the field) ``problem`` (the rest)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_option(option: str, value, condition: Callable[[float], bool] = lambda v: True, requirement: str = "") -> None:
    if not _is_number(value):
        raise LossOptionError(option, f"must be a number, got {value!r}")
    if not condition(value):
        raise LossOptionError(option, f"must be {requirement}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossOptions:
    """What every term is configured with: how its per-token loss becomes a scalar.

    Subclasses add the term's own settings. ``section_defaults`` (a class attribute, not a field)
    names the fields whose default is the config section's key of the same name.
    """

    loss_agg_mode: str = "token-mean"
    # divisor of seq-mean-token-sum-norm in a local call (meta None); a BatchMeta carries its own
    loss_scale_factor: float | None = None

    section_defaults = ()

    def __post_init__(self):
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise LossOptionError("loss_agg_mode", f"must be one of {', '.join(LOSS_AGG_MODES)}, got {self.loss_agg_mode!r}")


def option_names(options_cls: type) -> tuple[str, ...]:
    """A term's own settings: the fields of its options dataclass beyond LossOptions'."""
    shared = {f.name for f in dataclasses.fields(LossOptions)}
    return tuple(f.name for f in dataclasses.fields(options_cls) if f.name not in shared)


@dataclasses.dataclass(frozen=True)
class TermSpec:
    """A registered loss term: its function, its options dataclass, the batch keys it reads
    (`inputs`: always; `optional_inputs`: when the batch carries them)."""

    fn: TermFn
    options: type
    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()


def normalisation(meta, options: LossOptions) -> dict:
    """agg_loss's keyword arguments: the whole mini-batch's counts, or the micro-batch's own."""
    if meta is None:
        return {"dp_size": 1, "loss_scale_factor": options.loss_scale_factor}
    return meta.loss_kwargs()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, meta, options: LossOptions) -> torch.Tensor:
    return agg_loss(per_token, mask, options.loss_agg_mode, **normalisation(meta, options))


# per-token importance weights of the rollout correction (rlflow.algos.rollout_correction), [B, R]
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"


def aggregate_policy(per_token: torch.Tensor, batch: Batch, meta, options: LossOptions) -> torch.Tensor:
    """A policy loss's aggregation: ``aggregate`` of the per-token loss, multiplied first by the
    batch's ``rollout_is_weights`` when it carries them (the rollout correction; absent: no
    correction, not even a multiplication by 1).

    The one place the weights enter every policy loss. Only the numerator changes: the mask, so
    batch_num_tokens / global_batch_size and every local count, stays as it is, and a token of
    weight 0 (dropped by masked IS) still counts in the denominator whatever the split.
    """
    weights = batch.get(ROLLOUT_IS_WEIGHTS)
    if weights is not None:
        per_token = per_token * weights
    return aggregate(per_token, batch["response_mask"], meta, options)


def aggregated_loss_metric(loss: torch.Tensor, meta) -> Metric:
    """A loss value under the #6957 rule (rlflow.metrics.loss_metric)."""
    dp_size = 1 if meta is None else meta.dp_size
    return loss_metric(loss.item(), dp_size, has_global_meta=meta is not None)


def masked_mean_metric(values: torch.Tensor, mask: torch.Tensor) -> Metric:
    """A per-token statistic: this micro-batch's masked mean, weighted by its valid-token count."""
    return token_mean_metric(masked_mean(values.detach(), mask).item(), masked_count(mask).item())


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
    branch is the larger one (detached). The value-loss term below wraps it.
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


# -------------------------------------------------------------- the terms besides the policy loss

LOSS_TERMS: dict[str, TermSpec] = {}


def register_loss_term(name: str, options: type, inputs: tuple[str, ...]):
    """Decorator: register a term a role's loss can hold (terms.py composes them)."""

    def decorator(fn: TermFn) -> TermFn:
        if name in LOSS_TERMS and LOSS_TERMS[name].fn is not fn:
            raise ValueError(f"loss term {name!r} is already registered")
        LOSS_TERMS[name] = TermSpec(fn, options, tuple(inputs))
        return fn

    return decorator


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueLossOptions(LossOptions):
    cliprange_value: float = 0.5
    section_defaults = ("cliprange_value",)

    def __post_init__(self):
        super().__post_init__()
        _check_option("cliprange_value", self.cliprange_value, lambda v: v >= 0, ">= 0")


@register_loss_term("value_loss", ValueLossOptions, ("vpreds", "values", "returns", "response_mask"))
def value_loss_term(batch: Batch, meta, options: ValueLossOptions):
    """The critic's clipped value loss (compute_value_loss) with its clip fraction."""
    mask = batch["response_mask"]
    vf_loss, vf_clipfrac = compute_value_loss(
        batch["vpreds"], batch["returns"], batch["values"], mask, options.cliprange_value,
        options.loss_agg_mode, **normalisation(meta, options),
    )
    metrics = {
        "vf_loss": aggregated_loss_metric(vf_loss, meta),
        "vf_clipfrac": token_mean_metric(vf_clipfrac.item(), masked_count(mask).item()),
    }
    return vf_loss, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyBonusOptions(LossOptions):
    entropy_coeff: float = 0.0
    section_defaults = ("entropy_coeff",)

    def __post_init__(self):
        super().__post_init__()
        _check_option("entropy_coeff", self.entropy_coeff)


@register_loss_term("entropy_bonus", EntropyBonusOptions, ("entropy", "response_mask"))
def entropy_bonus_term(batch: Batch, meta, options: EntropyBonusOptions):
    """-entropy_coeff * the aggregated entropy; the metric is the aggregated entropy itself."""
    entropy_loss = aggregate(batch["entropy"], batch["response_mask"], meta, options)
    return -options.entropy_coeff * entropy_loss, {"entropy_loss": aggregated_loss_metric(entropy_loss, meta)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLLossOptions(LossOptions):
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    section_defaults = ("kl_loss_coef", "kl_loss_type")

    def __post_init__(self):
        super().__post_init__()
        _check_option("kl_loss_coef", self.kl_loss_coef)
        if self.kl_loss_type not in KL_PENALTY_MODES:
            raise LossOptionError("kl_loss_type", f"must be one of {', '.join(KL_PENALTY_MODES)}, got {self.kl_loss_type!r}")


@register_loss_term("kl_loss", KLLossOptions, ("log_probs", "ref_log_prob", "response_mask"))
def kl_loss_term(batch: Batch, meta, options: KLLossOptions):
    """kl_loss_coef * the aggregated per-token KL(policy || reference) estimate."""
    kl = kl_penalty(batch["log_probs"], batch["ref_log_prob"], options.kl_loss_type)
    kl_loss = aggregate(kl, batch["response_mask"], meta, options)
    return options.kl_loss_coef * kl_loss, {"kl_loss": aggregated_loss_metric(kl_loss, meta)}


# the teacher's log-prob of each sampled response token, [B, R] (controllers/roles.py: TEACHER)
TEACHER_LOG_PROB = "teacher_log_prob"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillOptions(LossOptions):
    """On-policy distillation (actor.distill): `coef` weights the term, `kl_type` is the per-token
    estimator k of rlflow.algos.kl (k3 by default: its gradient is the per-token reverse KL's, see
    distill_loss_term). An error names the config key (actor.distill.<option>)."""

    coef: float = 1.0
    kl_type: str = "low_var_kl"

    def __post_init__(self):
        super().__post_init__()
        _check_option("distill.coef", self.coef, lambda v: v >= 0, ">= 0")
        if self.kl_type not in KL_PENALTY_MODES:
            raise LossOptionError("distill.kl_type", f"must be one of {', '.join(KL_PENALTY_MODES)}, got {self.kl_type!r}")


@register_loss_term("distill_loss", DistillOptions, ("log_probs", "old_log_probs", TEACHER_LOG_PROB, "response_mask"))
def distill_loss_term(batch: Batch, meta, options: DistillOptions):
    """coef * aggregate(rho * k(log pi, log pi_teacher)): the reverse KL(pi || pi_teacher) of each
    sampled token, importance-weighted to the current policy.

    rho = exp(log pi - log pi_old) (clamped like the policy losses' ratio) is 1 on-policy with
    gradient grad log pi, so the gradient is grad k + k grad log pi: the pathwise and the
    score-function part of grad E_{y ~ pi}[k(y)], unbiased for the per-token reverse KL with the
    unbiased estimators (k1, k3). With k3 it is exactly (log pi - log pi_teacher) grad log pi (the
    policy gradient of the reward -(log pi - log pi_teacher), Thinking Machines' on-policy
    distillation), where k3's clamp does not act. distill_reverse_kl: the token mean of
    log pi - log pi_teacher (k1, the reverse KL's unbiased estimate on the sampled tokens).
    """
    log_prob, teacher_log_prob, mask = batch["log_probs"], batch[TEACHER_LOG_PROB], batch["response_mask"]
    estimate = kl_penalty(log_prob, teacher_log_prob, options.kl_type)
    ratio = torch.exp(_log_ratio(batch["old_log_probs"], log_prob))
    distill_loss = aggregate(ratio * estimate, mask, meta, options)
    metrics = {
        "distill_loss": aggregated_loss_metric(distill_loss, meta),
        "distill_reverse_kl": masked_mean_metric(log_prob - teacher_log_prob, mask),
    }
    return options.coef * distill_loss, metrics


# the teacher's top-k tokens at each sampled position, [B, R, k] (ids, long) and their log-probs
# (float) under the teacher; the actor's forward adds TOPK_LOG_PROBS, its own log-probs of those ids
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"
TOPK_LOG_PROBS = "topk_log_probs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillTopKOptions(LossOptions):
    """actor.distill with top_k > 0: `coef` weights the top-k forward KL term."""

    coef: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        _check_option("distill.coef", self.coef, lambda v: v >= 0, ">= 0")


@register_loss_term("distill_topk_loss", DistillTopKOptions, (TOPK_LOG_PROBS, TEACHER_TOPK_LOG_PROBS, "response_mask"))
def distill_topk_loss_term(batch: Batch, meta, options: DistillTopKOptions):
    """coef * aggregate(KL(q || pi) over the teacher's top k tokens) at each sampled position.

    q is the teacher's distribution renormalised over its k most likely tokens, pi the actor's
    full-vocabulary probability of each: sum_j q_j (log q_j - log pi(v_j)) >= 0, 0 only when the
    actor puts all its mass on those k tokens in the teacher's proportions (as k grows it tends to
    the forward KL). Its gradient, -sum_j q_j grad log pi(v_j), is cross-entropy towards the
    teacher's top k (GKD's forward KL on the student's own samples). The positions are those the
    actor sampled; their distribution is not differentiated (no ratio), as in GKD.
    distill_forward_kl: the per-token value's token mean.
    """
    log_pi, teacher, mask = batch[TOPK_LOG_PROBS], batch[TEACHER_TOPK_LOG_PROBS], batch["response_mask"]
    log_q = torch.log_softmax(teacher.to(log_pi.dtype), dim=-1)
    per_token = (log_q.exp() * (log_q - log_pi)).sum(-1)
    distill_loss = aggregate(per_token, mask, meta, options)
    metrics = {
        "distill_loss": aggregated_loss_metric(distill_loss, meta),
        "distill_forward_kl": masked_mean_metric(per_token, mask),
    }
    return options.coef * distill_loss, metrics


# ----------------------------------------------------------------------------- policy losses

POLICY_LOSSES: dict[str, TermSpec] = {}
POLICY_LOSS_INPUTS = ("log_probs", "old_log_probs", "advantages", "response_mask")
# read when present: the rollout correction's weights, applied by aggregate_policy
POLICY_LOSS_OPTIONAL_INPUTS = (ROLLOUT_IS_WEIGHTS,)


def register_policy_loss(name: str, options: type = LossOptions, inputs: tuple[str, ...] = POLICY_LOSS_INPUTS):
    """Decorator: register a policy loss under ``name`` with its options dataclass.

    A policy loss is a term (the contract at the top of this module) that reports pg_loss,
    pg_clipfrac, ppo_kl and pg_clipfrac_lower (policy_metrics), and may add statistics of its own
    (each a Metric declaring its aggregation, e.g. cispo's pg_is_weight_mean); `inputs` are the batch keys it
    reads. It aggregates its per-token loss with aggregate_policy, which applies the rollout
    correction's weights (every policy loss declares them as an optional input). The invariance
    test iterates this registry.
    """

    def decorator(fn: TermFn) -> TermFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name].fn is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = TermSpec(fn, options, tuple(inputs), POLICY_LOSS_OPTIONAL_INPUTS)
        return fn

    return decorator


def get_policy_loss(name: str) -> TermSpec:
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"Unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}"
        )
    return POLICY_LOSSES[name]


def get_policy_loss_fn(name: str) -> TermFn:
    return get_policy_loss(name).fn


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def policy_metrics(pg_loss, meta, mask, *, ppo_kl, pg_clipfrac=None, pg_clipfrac_lower=None) -> dict[str, Metric]:
    """What every policy loss reports; a clip fraction of a clip the loss does not have is 0."""
    num_tokens = masked_count(mask).item()

    def fraction(per_token):
        return token_mean_metric(0.0, num_tokens) if per_token is None else masked_mean_metric(per_token, mask)

    return {
        "pg_loss": aggregated_loss_metric(pg_loss, meta),
        "pg_clipfrac": fraction(pg_clipfrac),
        "ppo_kl": masked_mean_metric(ppo_kl, mask),
        "pg_clipfrac_lower": fraction(pg_clipfrac_lower),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOClipOptions(LossOptions):
    """PPO's clip of the probability ratio to [1 - clip_ratio_low, 1 + clip_ratio_high]; the
    defaults are the actor section's clip_ratio_low / clip_ratio_high."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    section_defaults = ("clip_ratio_low", "clip_ratio_high")

    def __post_init__(self):
        super().__post_init__()
        _check_option("clip_ratio_low", self.clip_ratio_low, lambda v: 0 <= v < 1, "in [0, 1)")
        _check_option("clip_ratio_high", self.clip_ratio_high, lambda v: v >= 0, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DualClipOptions(PPOClipOptions):
    clip_ratio_c: float = 3.0
    section_defaults = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")

    def __post_init__(self):
        super().__post_init__()
        _check_option("clip_ratio_c", self.clip_ratio_c, lambda v: v > 1.0, "> 1.0 for dual-clip PPO")


@register_policy_loss("vanilla", options=DualClipOptions)
def compute_policy_loss_vanilla(batch: Batch, meta, options: DualClipOptions):
    """PPO clipped surrogate with asymmetric clip range and dual clip (Ye et al. 2020).

    For negative advantages the loss -A * ratio is additionally capped at -A * clip_ratio_c, so a
    huge ratio on a bad action cannot produce an unbounded update.
    """
    log_prob, advantages, mask = batch["log_probs"], batch["advantages"], batch["response_mask"]
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    ratio = torch.exp(log_ratio)

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - options.clip_ratio_low, 1.0 + options.clip_ratio_high)
    ppo_clip_loss = torch.maximum(unclipped_loss, clipped_loss)

    dual_clip_bound = -advantages * options.clip_ratio_c
    dual_clipped_loss = torch.minimum(ppo_clip_loss, dual_clip_bound)
    negative_adv = advantages < 0
    per_token_loss = torch.where(negative_adv, dual_clipped_loss, ppo_clip_loss)

    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    dtype = log_prob.dtype
    return pg_loss, policy_metrics(
        pg_loss, meta, mask,
        ppo_kl=-log_ratio,
        pg_clipfrac=(clipped_loss > unclipped_loss).to(dtype),
        pg_clipfrac_lower=((ppo_clip_loss > dual_clip_bound) & negative_adv).to(dtype),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GSPOOptions(PPOClipOptions):
    pass


@register_policy_loss("gspo", options=GSPOOptions)
def compute_policy_loss_gspo(batch: Batch, meta, options: GSPOOptions):
    """GSPO (Zheng et al. 2025): clip a sequence-level ratio exp(mean_t log-ratio).

    Token-level form: log s_it = sg[log s_i] + log_prob_t - sg[log_prob_t]; its value is the
    sequence ratio, its gradient flows through each token's own log-prob. With seq-mean-token-mean
    (GSPO's setting; set it explicitly, the default is the uniform token-mean) this is exactly the
    sequence-level objective. The sequence log-ratio is computed within each row, so it does not
    depend on how rows are split.
    """
    log_prob, advantages, mask = batch["log_probs"], batch["advantages"], batch["response_mask"]
    # clamped per token like every loss's ratio, so the sequence mean is bounded too
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    seq_log_ratio = masked_mean(log_ratio, mask, axis=-1)  # [B]
    straight_through_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(straight_through_log_ratio, max=10.0))

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - options.clip_ratio_low, 1.0 + options.clip_ratio_high)
    per_token_loss = torch.maximum(unclipped_loss, clipped_loss)

    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    clipped = (clipped_loss > unclipped_loss).to(log_prob.dtype)
    return pg_loss, policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio, pg_clipfrac=clipped)


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(batch: Batch, meta, options: LossOptions):
    """Importance-weighted policy gradient without clipping: loss = -A * exp(lp - old_lp).

    On-policy (old == current) its gradient is REINFORCE's -A * grad log pi. No options of its own.
    """
    log_prob, mask = batch["log_probs"], batch["response_mask"]
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    per_token_loss = -batch["advantages"] * torch.exp(log_ratio)
    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    return pg_loss, policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeoMeanOptions(LossOptions):
    """GMPO clips LOG-ratios to [-clip_ratio_low, clip_ratio_high]: a different unit from PPO's
    ratio clip, so the actor section's clip_ratio_* do not apply; 0.4 is the GMPO paper's value."""

    clip_ratio_low: float = 0.4
    clip_ratio_high: float = 0.4

    def __post_init__(self):
        super().__post_init__()
        _check_option("clip_ratio_low", self.clip_ratio_low, lambda v: v >= 0, ">= 0")
        _check_option("clip_ratio_high", self.clip_ratio_high, lambda v: v >= 0, ">= 0")


@register_policy_loss("geo_mean", options=GeoMeanOptions)
def compute_policy_loss_geo_mean(batch: Batch, meta, options: GeoMeanOptions):
    """GMPO (geometric-mean policy optimisation): -A * geometric mean of clipped token ratios.

    A row's advantage A_i is the mean of its tokens' (the outcome advantage). Its token log-ratios
    are clipped in LOG space to [-clip_ratio_low, clip_ratio_high], pessimistically for the sign of
    A_i (like PPO's min). The sequence loss -A_i * exp(mean_t clipped log-ratio) is broadcast onto
    the row's valid tokens and aggregated by agg_loss, so it obeys the normalisation contract
    (seq-mean-token-mean averages the sequence losses over sequences).
    """
    log_prob, mask = batch["log_probs"], batch["response_mask"]
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    seq_advantage = masked_mean(batch["advantages"], mask, axis=-1)  # [B]
    # the sign of the advantage that weights the row, so the clip is pessimistic for that weight
    sign = torch.sign(seq_advantage).unsqueeze(-1)
    signed_log_ratio = sign * log_ratio
    signed_clipped = sign * torch.clamp(log_ratio, -options.clip_ratio_low, options.clip_ratio_high)
    # min over the signed pair = the pessimistic choice; multiply the sign back.
    pessimistic_log_ratio = sign * torch.minimum(signed_log_ratio, signed_clipped)

    seq_log_ratio = masked_mean(pessimistic_log_ratio, mask, axis=-1)  # [B]
    seq_loss = -seq_advantage * torch.exp(seq_log_ratio)  # [B]
    per_token_loss = seq_loss.unsqueeze(-1).expand_as(log_prob)

    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    clipped = ((signed_clipped < signed_log_ratio) & (sign != 0)).to(log_prob.dtype)
    return pg_loss, policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio, pg_clipfrac=clipped)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOOptions(LossOptions):
    """CISPO clips the importance-sampling WEIGHT to [1 - epsilon_low, 1 + epsilon_high] (MiniMax-M1's
    eps^IS_low, eps^IS_high), not the update, so the actor section's clip_ratio_* do not apply.

    epsilon_low = 1 puts the lower bound at 0, below every ratio: no lower clip, the paper's setting
    ("we did not impose a lower bound"). The paper tunes epsilon_high without stating its value;
    0.28 is DAPO's clip-higher bound, the default of Trinity-RFT's CISPO.
    """

    epsilon_low: float = 1.0
    epsilon_high: float = 0.28

    def __post_init__(self):
        super().__post_init__()
        _check_option("epsilon_low", self.epsilon_low, lambda v: 0 <= v <= 1, "in [0, 1] (1: no lower bound)")
        _check_option("epsilon_high", self.epsilon_high, lambda v: v >= 0, ">= 0")


@register_policy_loss("cispo", options=CISPOOptions)
def compute_policy_loss_cispo(batch: Batch, meta, options: CISPOOptions):
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4-5): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi.

    The clipped ratio is a detached weight: every token's gradient is -weight * A * grad log pi,
    also where the clip holds the weight constant (PPO's clip would give those tokens none). The
    loss value is a surrogate (it holds log pi): only its gradient is the objective's.
    pg_clipfrac: tokens whose weight the clip changed (either bound); pg_is_weight_mean: the mean
    clipped weight.
    """
    log_prob, advantages, mask = batch["log_probs"], batch["advantages"], batch["response_mask"]
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    ratio = torch.exp(log_ratio).detach()
    lower_bound, upper_bound = 1.0 - options.epsilon_low, 1.0 + options.epsilon_high
    clipped_is_weight = torch.clamp(ratio, lower_bound, upper_bound)
    per_token_loss = -clipped_is_weight * advantages * log_prob

    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    weight_clipped = ((ratio > upper_bound) | (ratio < lower_bound)).to(log_prob.dtype)
    metrics = policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio, pg_clipfrac=weight_clipped)
    metrics["pg_is_weight_mean"] = masked_mean_metric(clipped_is_weight, mask)
    return pg_loss, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class SAPOOptions(LossOptions):
    """SAPO's gate temperatures: tau_pos for tokens with A > 0, tau_neg for the others. 1.0 / 1.05
    are the paper's (tau_neg > tau_pos: negative updates decay faster off-policy)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        super().__post_init__()
        _check_option("tau_pos", self.tau_pos, lambda v: v > 0, "> 0")
        _check_option("tau_neg", self.tau_neg, lambda v: v > 0, "> 0")


@register_policy_loss("sapo", options=SAPOOptions)
def compute_policy_loss_sapo(batch: Batch, meta, options: SAPOOptions):
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347, Eq. 5): -A * f(r), with the soft
    gate f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg.

    No clip: the gradient is -A * w * r * grad log pi with w = 4 p (1 - p), p = sigmoid(tau (r - 1)),
    which is 1 on-policy (r = 1: REINFORCE's gradient) and decays smoothly as r leaves 1. The paper
    averages tokens per sequence, then sequences (seq-mean-token-mean; set it explicitly, the
    default is the uniform token-mean). pg_gate_weight_mean: the mean of w.
    """
    log_prob, advantages, mask = batch["log_probs"], batch["advantages"], batch["response_mask"]
    log_ratio = _log_ratio(batch["old_log_probs"], log_prob)
    ratio = torch.exp(log_ratio)
    temperature = torch.where(
        advantages > 0,
        torch.full_like(ratio, options.tau_pos),
        torch.full_like(ratio, options.tau_neg),
    )
    gate_probability = torch.sigmoid(temperature * (ratio - 1.0))
    soft_gate = gate_probability * (4.0 / temperature)
    per_token_loss = -advantages * soft_gate

    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    gradient_weight = 4.0 * gate_probability * (1.0 - gate_probability)
    metrics = policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio)
    metrics["pg_gate_weight_mean"] = masked_mean_metric(gradient_weight, mask)
    return pg_loss, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPPOOptions(LossOptions):
    """DPPO's trust region: delta_high bounds how far a token with A > 0 may rise, delta_low how
    far one with A <= 0 may fall, in the divergence of the loss (dppo_tv: the change of the
    token's probability; dppo_kl: the binary KL). The IS weight is truncated at clip_ratio_c (the
    actor section's). 0.2 / 0.2 are the thresholds of the authors' verl code (its clip_ratio
    defaults)."""

    delta_low: float = 0.2
    delta_high: float = 0.2
    clip_ratio_c: float = 3.0
    section_defaults = ("clip_ratio_c",)

    def __post_init__(self):
        super().__post_init__()
        _check_option("delta_low", self.delta_low, lambda v: v > 0, "> 0")
        _check_option("delta_high", self.delta_high, lambda v: v > 0, "> 0")
        _check_option("clip_ratio_c", self.clip_ratio_c, lambda v: v > 1.0, "> 1.0")


def _dppo_loss(batch: Batch, meta, options: DPPOOptions, outside: Callable):
    """-A * sg(min(r, c)) * log pi on the tokens inside the trust region, 0 on the others (their
    gradient dropped); `outside(prob, old_prob, rising)` says which tokens left it in the
    direction their advantage pushes (rising: A > 0)."""
    log_prob, advantages, mask = batch["log_probs"], batch["advantages"], batch["response_mask"]
    old_log_prob = batch["old_log_probs"]
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    prob, old_prob = torch.exp(log_prob.detach()), torch.exp(old_log_prob)
    rising = advantages > 0
    kept = (~outside(prob, old_prob, rising)).to(log_prob.dtype)
    weight = torch.clamp(ratio, max=options.clip_ratio_c)
    per_token_loss = -advantages * weight * log_prob * kept
    pg_loss = aggregate_policy(per_token_loss, batch, meta, options)
    return pg_loss, policy_metrics(pg_loss, meta, mask, ppo_kl=-log_ratio, pg_clipfrac=1.0 - kept,
                                   pg_clipfrac_lower=(ratio > options.clip_ratio_c).to(log_prob.dtype) * kept)


@register_policy_loss("dppo_tv", options=DPPOOptions)
def compute_policy_loss_dppo_tv(batch: Batch, meta, options: DPPOOptions):
    """DPPO-Binary-TV (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879): the trust region bounds the total variation of the sampled token's
    Bernoulli (it, or not it), |pi - pi_old|, instead of the ratio. A token with A > 0 leaves it
    when pi - pi_old > delta_high, one with A <= 0 when pi_old - pi > delta_low; the others keep
    the policy gradient -A * sg(min(r, c)) grad log pi. pg_clipfrac: tokens outside;
    pg_clipfrac_lower: tokens inside whose weight the truncation at c changed."""

    def outside(prob, old_prob, rising):
        return torch.where(rising, prob - old_prob > options.delta_high, old_prob - prob > options.delta_low)

    return _dppo_loss(batch, meta, options, outside)


@register_policy_loss("dppo_kl", options=DPPOOptions)
def compute_policy_loss_dppo_kl(batch: Batch, meta, options: DPPOOptions):
    """DPPO-Binary-KL (the same paper): the divergence is the KL of the sampled token's Bernoulli,
    pi_old log(pi_old / pi) + (1 - pi_old) log((1 - pi_old) / (1 - pi)); a token with A > 0 leaves
    the trust region when pi rose and that KL > delta_high, one with A <= 0 when pi fell and it is
    > delta_low. Otherwise as dppo_tv."""

    def outside(prob, old_prob, rising):
        tiny = torch.finfo(prob.dtype).tiny
        binary_kl = (old_prob * (torch.log(old_prob + tiny) - torch.log(prob + tiny))
                     + (1 - old_prob) * (torch.log1p(-old_prob + tiny) - torch.log1p(-prob + tiny)))
        return torch.where(rising, (prob > old_prob) & (binary_kl > options.delta_high),
                           (prob < old_prob) & (binary_kl > options.delta_low))

    return _dppo_loss(batch, meta, options, outside)


@register_policy_loss("nll", inputs=("log_probs", "response_mask"))
def compute_policy_loss_nll(batch: Batch, meta, options: LossOptions):
    """Supervised fine-tuning's loss: the negative log-likelihood of each response token,
    -log pi(token), aggregated like every loss (token-mean: the mini-batch's summed NLL over its
    token count, batch_num_tokens, whatever the split). It reads neither advantages nor old
    log-probs: `rlflow sft` trains with it (controllers/sft.py); in an RL run it would clone the
    sampled responses. ppo_kl is 0 (no ratio)."""
    log_prob, mask = batch["log_probs"], batch["response_mask"]
    pg_loss = aggregate_policy(-log_prob, batch, meta, options)
    return pg_loss, policy_metrics(pg_loss, meta, mask, ppo_kl=torch.zeros_like(log_prob))
