"""The composed actor loss and the critic loss of the real workers, checked against float64 formulas
written here, independently of rlflow.algos.

In process, without Ray: an ActorWorker / CriticWorker (rank 0 of 1) loads the tiny model, which is
then converted to float64, and `micro_loss` runs on one random micro-batch whose BatchMeta belongs to
a BIGGER mini-batch (more tokens and sequences than the micro-batch holds, loss_scale_factor 5 while
the config's is data.max_response_length), so what is checked is the global normalisation of the
contract in docs/CONVENTIONS.md, not the micro-batch's own counts. The independent side runs the
same weights (loaded separately with transformers, or a copy taken before any step) over the FULL
input_ids, with no trimming of padding columns, and writes every policy loss, aggregation mode, KL
estimator, the entropy bonus and the clipped value loss out by hand. Loss values, the gradient of
every parameter and every metric the worker reports (value and declared aggregation) must agree. The rollout
correction (algorithm.rollout_correction, rlflow/algos/rollout_correction.py) is checked the same way:
its importance weights and rollout_corr/* metrics are written out here from the micro-batch's
rollout_log_probs and old_log_probs.

Precision: workers/forward.py casts the logits / values to float32 (`logits.float()`), so even with a
float64 model the worker computes log-softmax, entropy and all loss arithmetic in float32 (the
gradient flows back through that cast into the float64 model). The comparison is therefore against
float32 rounding, not float64: see RTOL_F32 below. The random inputs are kept at least KINK_MARGIN
away from every branch point of the losses (clip bounds, dual-clip bound, |x| at 0, the k3 clamp, the
rollout correction's cap and band, token by token and summed over a sequence), so float32 rounding
cannot flip a branch and the two sides differ by rounding only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from conftest import tiny_overrides
from rlflow.algos import KL_PENALTY_MODES, LOSS_AGG_MODES, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from rlflow.config import load_config, to_dataclass
from rlflow.metrics import Aggregation
from rlflow.protocol import BatchMeta
from workers.actor import ActorWorker
from workers.critic import CriticWorker

F64 = torch.float64

# Worker side is float32 after the logits (see the module docstring). Worst differences measured on
# this data over every policy loss x mode x KL type x dp_size (280 actor cases) and the critic's 10:
# total loss 3.3e-7 of the size of its terms (|pg| + c_ent |ent| + c_kl |kl|: the total itself can
# nearly cancel), each parameter's gradient 5.7e-7 of its largest entry, metrics 1.4e-6 relative
# (actor/pg_loss, whose terms have both signs). float32's unit roundoff is 6e-8. 2e-5 leaves >= 14x
# headroom over those and is ~900x below what the negative controls change (entropy sign flipped:
# gradients 1.7e-2 off; the micro-batch's own token count: 0.42). Measured again with cispo and sapo
# (2026-12-06, the same sweep, 420 actor cases): loss 2.5e-7, gradients 8.8e-7 (sapo; 5.8e-7 for the
# four before), metrics 3.8e-7: 2e-5 still leaves >= 22x.
RTOL_F32 = 2e-5
KINK_MARGIN = 1e-3  # >> float32 error of a log-prob (~5e-7), << the spread of the random inputs

# The micro-batch: prompt width P, response width R. No prompt fills its P columns and no response
# its R columns, so the worker trims columns on both sides while the independent side does not.
P, R = 6, 7
PROMPT_LENS = (5, 2, 4, 1, 3)
RESPONSE_LENS = (6, 1, 4, 2, 5)  # row 1: a single valid token
EXTRA_TOKENS, EXTRA_SEQS = 13, 3  # the rest of the mini-batch, on other micro-batches / ranks
LOSS_SCALE_FACTOR = 5.0  # the BatchMeta's; the config's (data.max_response_length) is 6

TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.15, 0.3, 2.5  # actor.clip_ratio_*: vanilla's and gspo's clip
GEO_CLIP = (0.4, 0.4)  # geo_mean's own default (GMPO's; log space), not the actor's clip_ratio_*
GEO_OWN_CLIP = (0.25, 0.35)  # geo_mean's clip set through actor.policy_loss_options
CISPO_EPS = (1.0, 0.28)  # cispo's own default (epsilon_low, epsilon_high): no lower bound, weight <= 1.28
CISPO_OWN_EPS = (CLIP_LOW, CLIP_HIGH)  # set through actor.policy_loss_options: both bounds act
SAPO_TAU = (1.0, 1.05)  # sapo's own default (tau_pos, tau_neg), the paper's
DPPO_DELTA = 0.2  # dppo's default trust region (delta_low = delta_high)
SAPO_OWN_TAU = (0.6, 2.5)  # set through actor.policy_loss_options
ENTROPY_COEFF, KL_COEF = 0.05, 0.27
CLIPRANGE_VALUE = 0.3


# ------------------------------------------------------------------------------------- fixtures

# in-process workers change process-wide state: tests/conftest.py puts it back after the module
pytestmark = pytest.mark.usefixtures("restore_process_state")


@pytest.fixture(scope="module")
def reference_lm(tiny_model_dir):
    """The policy's weights, loaded by transformers itself (not by the worker), in float64."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).double()
    model.train()
    return model


BASE_OVERRIDES = {
    "actor.entropy_coeff": ENTROPY_COEFF,
    "actor.use_kl_loss": True,
    "actor.kl_loss_coef": KL_COEF,
    "actor.clip_ratio_low": CLIP_LOW,
    "actor.clip_ratio_high": CLIP_HIGH,
    "actor.clip_ratio_c": CLIP_C,
    "rollout.temperature": TEMPERATURE,
    "critic.enable": True,
    "critic.cliprange_value": CLIPRANGE_VALUE,
}


@functools.lru_cache(maxsize=None)
def base_cfg(model_dir: str):
    """The validated config every worker here starts from (load_config costs ~0.15 s a call, which
    was a third of this file's time); each test then sets its own actor/critic fields on a copy."""
    return to_dataclass(load_config(None, tiny_overrides(model_dir, **BASE_OVERRIDES)))


def actor_worker(model_dir: str, cfg=None, **actor_fields) -> ActorWorker:
    """A rank-0 actor in this process, its model in float64. actor_fields: ActorConfig fields
    (policy_loss, loss_agg_mode, kl_loss_type), values from rlflow's registries."""
    cfg = cfg or base_cfg(model_dir)
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, **actor_fields))
    worker = ActorWorker(cfg, 0, 1)
    worker.init_model(model_dir, 2)
    worker.model.double()
    worker.model.train()  # as TrainableWorker.update leaves it
    return worker


def critic_worker(model_dir: str, **critic_fields) -> CriticWorker:
    cfg = base_cfg(model_dir)
    cfg = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, **critic_fields))
    worker = CriticWorker(cfg, 0, 1)
    worker.init_model(model_dir, 2)
    worker.model.double()
    worker.model.train()
    return worker


def meta_for(micro: TensorDict, dp_size: int) -> BatchMeta:
    """What the driver attaches for the whole mini-batch this micro-batch is a slice of."""
    return BatchMeta(
        dp_size=dp_size,
        batch_num_tokens=int(micro["response_mask"].sum()) + EXTRA_TOKENS,
        global_batch_size=micro.batch_size[0] + EXTRA_SEQS,
        loss_scale_factor=LOSS_SCALE_FACTOR,
    )


def base_micro_batch(pad_id: int, vocab: int) -> TensorDict:
    """Left-padded prompts, right-padded responses, the derived masks and positions."""
    gen = torch.Generator().manual_seed(1234)
    rows = len(PROMPT_LENS)
    prompts = torch.full((rows, P), pad_id, dtype=torch.long)
    responses = torch.full((rows, R), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, P, dtype=torch.long)
    response_mask = torch.zeros(rows, R, dtype=torch.long)
    for row, (p_len, r_len) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        prompts[row, P - p_len :] = torch.randint(1, vocab, (p_len,), generator=gen)
        prompt_mask[row, P - p_len :] = 1
        responses[row, :r_len] = torch.randint(1, vocab, (r_len,), generator=gen)
        response_mask[row, :r_len] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
            "response_mask": response_mask,
        },
        batch_size=[rows],
    )


def full_forward_logits(model, micro: TensorDict) -> torch.Tensor:
    """Logits predicting each response token, [B, R, V], from the untrimmed sequence: position
    P-1+j sees the prompt and response tokens < j."""
    out = model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
    )
    return out.logits[:, P - 1 : P - 1 + R]


def reference_log_probs_and_entropy(model, micro: TensorDict):
    logits = full_forward_logits(model, micro).to(F64) / TEMPERATURE
    log_p = torch.log_softmax(logits, dim=-1)
    log_prob = log_p.gather(-1, micro["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_prob, entropy


def away_from(x: torch.Tensor, kinks, margin: float = KINK_MARGIN) -> torch.Tensor:
    """Nudge entries that sit within `margin` of a kink past it (repeat until none does)."""
    x = x.clone()
    for _ in range(100):
        near = torch.zeros_like(x, dtype=torch.bool)
        for kink in kinks:
            near |= (x - kink).abs() < margin
        if not near.any():
            return x
        x = torch.where(near, x + 2.5 * margin, x)
    raise AssertionError("could not move the inputs away from the kinks")


def min_distance(x: torch.Tensor, mask: torch.Tensor, kinks) -> float:
    valid = x[mask != 0]
    return min(float((valid - k).abs().min()) for k in kinks)


def k3_value(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x) - x - 1.0


@pytest.fixture(scope="module")
def actor_batch(reference_lm):
    """The micro-batch of the actor tests, with old log-probs chosen so every clip region is hit."""
    config = reference_lm.config
    micro = base_micro_batch(config.pad_token_id, config.vocab_size)
    mask = micro["response_mask"]
    valid = mask != 0
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        log_prob, _ = reference_log_probs_and_entropy(reference_lm, micro)

    # advantages of both signs, never near 0 (the sign picks the dual clip's branch; a row's mean
    # advantage picks geo_mean's, checked below)
    advantages = torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 1.2
    advantages = torch.where(advantages.abs() < 0.2, advantages.sign() * 0.2 + advantages, advantages)
    # the log-ratio log_prob - old_log_prob, token by token
    log_ratio = torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 0.6
    # row 0 hits every region of dual-clip PPO:
    #   A < 0 beyond the dual-clip bound (ratio > c), A < 0 below 1 - low, A > 0 above 1 + high, inside;
    # its mean advantage is < 0, so it also hits geo_mean's lower log-space clip (-0.5)
    log_ratio[0, :6] = torch.tensor([1.4, -0.5, 0.6, 0.05, -0.05, 2.0], dtype=F64)
    advantages[0, :6] = torch.tensor([-1.1, -0.7, 0.9, 1.3, -0.4, -2.0], dtype=F64)
    # row 3 (two tokens): mean advantage > 0, so both log-ratios are above geo_mean's upper clip,
    # the second although its own advantage is < 0 (the row's sign decides)
    log_ratio[3, :2] = torch.tensor([0.7, 0.5], dtype=F64)
    advantages[3, :2] = torch.tensor([0.8, -0.5], dtype=F64)
    # row 1 (one token): a sequence ratio below 1 - low with A < 0 (GSPO's lower clip)
    log_ratio[1, 0], advantages[1, 0] = -0.4, -0.8
    kinks = (math.log(1 - CLIP_LOW), math.log(1 + CLIP_HIGH), math.log(CLIP_C),
             -GEO_CLIP[0], GEO_CLIP[1], -GEO_OWN_CLIP[0], GEO_OWN_CLIP[1],
             math.log(1 + CISPO_EPS[1]))  # cispo's own bounds are CLIP_LOW / CLIP_HIGH's kinks
    log_ratio = away_from(log_ratio, kinks)
    old_log_probs = (log_prob - log_ratio).float()

    # ref - log_prob: both signs, one token far enough that k3 = e^x - x - 1 > 10 (its clamp acts)
    ref_gap = torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 0.5
    ref_gap[2, 1] = 3.0
    k3_kink = 2.5282  # k3(x) = 10 near here (x > 0)
    ref_gap = away_from(ref_gap, (0.0, k3_kink), margin=10 * KINK_MARGIN)
    ref_log_prob = (log_prob + ref_gap).float()

    # padding holds junk: every loss must mask it
    junk = torch.full_like(log_prob, 3.0)
    micro["old_log_probs"] = torch.where(valid, old_log_probs, junk.float())
    micro["advantages"] = torch.where(valid, advantages, -junk).float()
    micro["ref_log_prob"] = torch.where(valid, ref_log_prob, junk.float())

    # the premises, on the values the worker actually receives (float32-rounded); if a change of the
    # tiny model moves an input onto a kink, change a seed above
    eff_log_ratio = log_prob - micro["old_log_probs"].to(F64)
    eff_ref_gap = micro["ref_log_prob"].to(F64) - log_prob
    assert min_distance(eff_log_ratio, mask, kinks) > KINK_MARGIN / 2, "a log-ratio sits on a clip bound"
    assert min_distance(eff_ref_gap, mask, (0.0,)) > KINK_MARGIN, "a ref gap sits on |x|'s kink"
    assert min_distance(k3_value(eff_ref_gap), mask, (10.0,)) > KINK_MARGIN, "a k3 value sits on its clamp"
    assert (eff_log_ratio[valid].abs() < 20).all() and (eff_ref_gap[valid].abs() < 20).all()  # no ±20 clamps
    assert (k3_value(eff_ref_gap)[valid] > 10).any()  # the k3 clamp is active on a token
    seq_log_ratio = (eff_log_ratio * valid).sum(-1) / valid.sum(-1)
    assert min_distance(seq_log_ratio, torch.ones_like(seq_log_ratio), kinks[:2]) > KINK_MARGIN / 2, \
        "a sequence log-ratio sits on a GSPO clip bound"
    assert (seq_log_ratio < 10).all()  # GSPO's clamp of the sequence log-ratio at 10 never acts
    seq_advantage = (micro["advantages"].to(F64) * valid).sum(-1) / valid.sum(-1)
    assert (seq_advantage.abs() > KINK_MARGIN).all(), "a row's mean advantage (geo_mean's sign) is near 0"

    # the teacher's log-probs (actor.distill), drawn from a generator of their own so the inputs
    # above are unchanged: gaps of both signs, one token past k3's clamp; read only by the
    # workers that distil
    teacher_gen = torch.Generator().manual_seed(314)
    teacher_gap = torch.randn(micro.batch_size[0], R, generator=teacher_gen, dtype=F64) * 0.5
    teacher_gap[0, 2] = 3.1
    teacher_gap = away_from(teacher_gap, (0.0, k3_kink), margin=10 * KINK_MARGIN)
    micro["teacher_log_prob"] = torch.where(valid, (log_prob + teacher_gap).float(), junk.float())
    eff_teacher_gap = micro["teacher_log_prob"].to(F64) - log_prob
    assert min_distance(eff_teacher_gap, mask, (0.0,)) > KINK_MARGIN, "a teacher gap sits on |x|'s kink"
    assert min_distance(k3_value(eff_teacher_gap), mask, (10.0,)) > KINK_MARGIN, "a k3 value sits on its clamp"
    assert (k3_value(eff_teacher_gap)[valid] > 10).any() and (eff_teacher_gap[valid].abs() < 20).all()
    return micro


# ----------------------------------------------------------------- the independent float64 formulas


def aggregate(per_token, mask, mode, meta: BatchMeta, *, own_token_count=False):
    """The contract of docs/CONVENTIONS.md, written out. own_token_count: the bug (local normalisation)."""
    valid = mask != 0
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if mode == "token-mean":
        tokens = valid.sum() if own_token_count else meta.batch_num_tokens
        total = per_token.sum() / tokens
    elif mode == "token-sum":
        total = per_token.sum()
    else:
        row_sums = per_token.sum(-1)
        if mode == "seq-mean-token-mean":
            row_sums = row_sums / valid.sum(-1)  # every row here has >= 1 valid token
        total = row_sums.sum() / meta.global_batch_size
        if mode == "seq-mean-token-sum-norm":
            total = total / meta.loss_scale_factor
    return total * meta.dp_size


def local_mean(x, mask) -> float:
    valid = mask != 0
    return float(x[valid].to(F64).sum() / valid.sum())


def policy_per_token(name, log_prob, old_log_prob, advantages, mask, geo_clip=GEO_CLIP, cispo_eps=CISPO_EPS,
                     sapo_tau=SAPO_TAU):
    """(per-token loss carrying the gradient, {statistic: per-token 0/1 or value}) of each loss."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pos, neg = advantages > 0, advantages < 0
    valid = mask != 0
    zero = torch.zeros_like(log_prob)
    stats = {"ppo_kl": -log_ratio.detach(), "pg_clipfrac": zero.detach(), "pg_clipfrac_lower": zero.detach()}
    if name == "vanilla":
        # A > 0: -A * min(r, 1 + high). A < 0: |A| * min(max(r, 1 - low), c) (dual clip)
        upper = -advantages * torch.minimum(ratio, torch.full_like(ratio, 1 + CLIP_HIGH))
        lower = -advantages * torch.minimum(torch.maximum(ratio, torch.full_like(ratio, 1 - CLIP_LOW)),
                                            torch.full_like(ratio, CLIP_C))
        loss = torch.where(pos, upper, torch.where(neg, lower, zero))
        r = ratio.detach()
        stats["pg_clipfrac"] = ((pos & (r > 1 + CLIP_HIGH)) | (neg & (r < 1 - CLIP_LOW))).to(F64)
        stats["pg_clipfrac_lower"] = (neg & (r > CLIP_C)).to(F64)
    elif name == "gspo":
        # sequence ratio s_i = exp(mean_t log-ratio); each token's gradient is that of its own
        # log-prob times s_i (straight-through), zero where PPO's clip holds the loss constant
        seq_log_ratio = torch.where(valid, log_ratio, zero).sum(-1) / valid.sum(-1)
        seq_ratio = torch.exp(seq_log_ratio.detach()).unsqueeze(-1).expand_as(log_prob)
        value = torch.where(
            pos, -advantages * torch.clamp(seq_ratio, max=1 + CLIP_HIGH),
            torch.where(neg, -advantages * torch.clamp(seq_ratio, min=1 - CLIP_LOW), zero),
        )
        unclipped = (pos & (seq_ratio < 1 + CLIP_HIGH)) | (neg & (seq_ratio > 1 - CLIP_LOW))
        slope = torch.where(unclipped, -advantages * seq_ratio, zero)
        loss = value + slope * (log_prob - log_prob.detach())
        stats["pg_clipfrac"] = ((pos & (seq_ratio > 1 + CLIP_HIGH)) | (neg & (seq_ratio < 1 - CLIP_LOW))).to(F64)
    elif name == "reinforce":
        loss = -advantages * ratio
    elif name == "geo_mean":
        # A_i = the row's mean advantage; a log-space clip pessimistic for A_i's sign on every token
        # of the row, then -A_i * exp(mean clipped log-ratio)
        low, high = geo_clip
        n = valid.sum(-1)
        seq_advantage = torch.where(valid, advantages, zero).sum(-1) / n
        row_pos = (seq_advantage > 0).unsqueeze(-1).expand_as(log_prob)
        row_neg = (seq_advantage < 0).unsqueeze(-1).expand_as(log_prob)
        clipped_log_ratio = torch.where(
            row_pos, torch.clamp(log_ratio, max=high), torch.where(row_neg, torch.clamp(log_ratio, min=-low), zero)
        )
        seq_log_ratio = torch.where(valid, clipped_log_ratio, zero).sum(-1) / n
        seq_loss = -seq_advantage * torch.exp(seq_log_ratio)
        loss = seq_loss.unsqueeze(-1).expand_as(log_prob)
        lr = log_ratio.detach()
        stats["pg_clipfrac"] = ((row_pos & (lr > high)) | (row_neg & (lr < -low))).to(F64)
    elif name == "cispo":
        # MiniMax-M1 Eq. 4-5: a constant weight clip(r, 1 - eps_low, 1 + eps_high) times -A log pi;
        # the gradient reaches log pi on every token, clipped or not
        low, high = 1.0 - cispo_eps[0], 1.0 + cispo_eps[1]
        r = ratio.detach()
        weight = torch.where(r > high, torch.full_like(r, high), torch.where(r < low, torch.full_like(r, low), r))
        loss = -weight * advantages * log_prob
        stats["pg_clipfrac"] = ((r > high) | (r < low)).to(F64)
        stats["pg_is_weight_mean"] = weight
    elif name == "sapo":
        # SAPO Eq. 5: -A * (4 / tau) * sigmoid(tau (r - 1)), tau by the token's advantage sign; the
        # statistic is the gradient's weight 4 p (1 - p)
        tau = torch.where(pos, torch.full_like(ratio, sapo_tau[0]), torch.full_like(ratio, sapo_tau[1]))
        p = 1.0 / (1.0 + torch.exp(-tau * (ratio - 1.0)))
        loss = -advantages * 4.0 * p / tau
        stats["pg_gate_weight_mean"] = (4.0 * p * (1.0 - p)).detach()
    elif name in ("dppo_tv", "dppo_kl"):
        # DPPO (arXiv 2602.04879): -A * sg(min(r, c)) * log pi inside the trust region, nothing
        # outside it; the region bounds the sampled token's probability change (tv) or its
        # Bernoulli's KL (kl), in the direction the token's advantage pushes (A > 0: rising)
        p, p_old = torch.exp(log_prob.detach()), torch.exp(old_log_prob)
        if name == "dppo_tv":
            outside = torch.where(pos, p - p_old > DPPO_DELTA, p_old - p > DPPO_DELTA)
        else:
            binary_kl = p_old * (old_log_prob - log_prob.detach()) + (1 - p_old) * torch.log((1 - p_old) / (1 - p))
            outside = torch.where(pos, (p > p_old) & (binary_kl > DPPO_DELTA), (p < p_old) & (binary_kl > DPPO_DELTA))
        kept = (~outside).to(F64)
        r = ratio.detach()
        loss = -advantages * torch.clamp(r, max=CLIP_C) * log_prob * kept
        stats["pg_clipfrac"] = 1.0 - kept
        stats["pg_clipfrac_lower"] = (r > CLIP_C).to(F64) * kept
    elif name == "nll":
        # SFT: the negative log-likelihood of each token; no ratio (ppo_kl 0)
        loss = -log_prob
        stats["ppo_kl"] = zero.detach()
    else:
        raise AssertionError(f"policy loss {name!r} has no independent formula in this test: add one")
    return loss, stats


def kl_per_token(kl_type, log_prob, ref_log_prob):
    diff = log_prob - ref_log_prob
    if kl_type in ("kl", "k1"):
        return diff
    if kl_type == "abs":
        return diff.abs()
    if kl_type in ("mse", "k2"):
        return 0.5 * diff * diff
    if kl_type in ("low_var_kl", "k3"):
        x = -diff  # log(ref / pi); |x| < 20 here, so the inner clamp never acts
        k3 = torch.exp(x) - x - 1.0
        return torch.where(k3 > 10.0, torch.full_like(k3, 10.0), k3)  # the outer clamp at 10
    raise AssertionError(f"KL type {kl_type!r} has no independent formula in this test: add one")


def expected_actor(model, micro, name, mode, kl_type, meta, *, entropy_sign=1.0, own_token_count=False,
                   geo_clip=GEO_CLIP, cispo_eps=CISPO_EPS, sapo_tau=SAPO_TAU, is_weights=None, distill=None):
    """(loss, gradients by parameter name, metric values) from the float64 reference model.
    is_weights: the rollout correction's per-token weights, [B, R], which multiply the policy loss
    only (the counts of the aggregation and the policy statistics stay those of every valid token).
    distill: (coef, kl_type, with the policy loss) of actor.distill, or None."""
    if distill is not None:
        return expected_distilling_actor(model, micro, name, mode, kl_type, meta, distill)
    model.zero_grad(set_to_none=True)
    mask = micro["response_mask"]
    log_prob, entropy = reference_log_probs_and_entropy(model, micro)
    old = micro["old_log_probs"].to(F64)
    advantages = micro["advantages"].to(F64)
    ref = micro["ref_log_prob"].to(F64)

    def agg(x):
        return aggregate(x, mask, mode, meta, own_token_count=own_token_count)

    pg_tokens, stats = policy_per_token(name, log_prob, old, advantages, mask, geo_clip, cispo_eps, sapo_tau)
    if is_weights is not None:
        pg_tokens = pg_tokens * is_weights
    pg_loss = agg(pg_tokens)
    entropy_loss = agg(entropy)
    kl_loss = agg(kl_per_token(kl_type, log_prob, ref))
    loss = pg_loss - entropy_sign * ENTROPY_COEFF * entropy_loss + KL_COEF * kl_loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    dp = meta.dp_size
    metrics = {
        "actor/pg_loss": float(pg_loss.detach()) / dp,
        "actor/entropy_loss": float(entropy_loss.detach()) / dp,
        "actor/kl_loss": float(kl_loss.detach()) / dp,
        "actor/entropy": local_mean(entropy.detach(), mask),
        **{f"actor/{k}": local_mean(v, mask) for k, v in stats.items()},
    }
    # the total can nearly cancel (its terms have both signs): float32's error is relative to the
    # size of the terms, not to the total
    magnitude = float(pg_loss.detach().abs() + ENTROPY_COEFF * entropy_loss.detach().abs() + KL_COEF * kl_loss.detach().abs())
    return float(loss.detach()), grads, metrics, magnitude


def expected_distilling_actor(model, micro, name, mode, kl_type, meta, distill):
    """expected_actor with actor.distill's term: coef * agg(exp(log pi - old) * k(log pi, teacher)),
    the ratio carrying the gradient (1 on-policy); without the policy loss and its statistics when
    actor.distill.use_policy_loss is false."""
    coef, distill_type, with_policy = distill
    model.zero_grad(set_to_none=True)
    mask = micro["response_mask"]
    log_prob, entropy = reference_log_probs_and_entropy(model, micro)
    old, advantages = micro["old_log_probs"].to(F64), micro["advantages"].to(F64)
    ref, teacher = micro["ref_log_prob"].to(F64), micro["teacher_log_prob"].to(F64)

    def agg(x):
        return aggregate(x, mask, mode, meta)

    pg_tokens, stats = policy_per_token(name, log_prob, old, advantages, mask)
    pg_loss = agg(pg_tokens)
    entropy_loss = agg(entropy)
    kl_loss = agg(kl_per_token(kl_type, log_prob, ref))
    distill_loss = agg(torch.exp(log_prob - old) * kl_per_token(distill_type, log_prob, teacher))
    loss = (pg_loss if with_policy else 0.0) - ENTROPY_COEFF * entropy_loss + KL_COEF * kl_loss + coef * distill_loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    dp = meta.dp_size
    metrics = {
        "actor/entropy_loss": float(entropy_loss.detach()) / dp,
        "actor/kl_loss": float(kl_loss.detach()) / dp,
        "actor/distill_loss": float(distill_loss.detach()) / dp,
        "actor/distill_reverse_kl": local_mean((log_prob - teacher).detach(), mask),
        "actor/entropy": local_mean(entropy.detach(), mask),
    }
    if with_policy:
        metrics["actor/pg_loss"] = float(pg_loss.detach()) / dp
        metrics.update({f"actor/{k}": local_mean(v, mask) for k, v in stats.items()})
    magnitude = float((pg_loss.detach().abs() if with_policy else 0.0) + ENTROPY_COEFF * entropy_loss.detach().abs()
                      + KL_COEF * kl_loss.detach().abs() + coef * distill_loss.detach().abs())
    return float(loss.detach()), grads, metrics, magnitude


# ----------------------------------------------------------------------------------- comparison

LOSS_METRICS = {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/distill_loss", "critic/vf_loss"}
MAX_METRICS = {"rollout_corr/abs_diff_max"}  # the largest value over micro-batches and ranks


def run_worker(worker, micro, meta: BatchMeta):
    worker.model.zero_grad(set_to_none=True)
    num_tokens = int(micro["response_mask"].sum())
    loss, metrics = worker.micro_loss(micro, meta)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in worker.model.named_parameters()}
    return float(loss.detach()), grads, metrics, num_tokens


def compare(worker_out, expected, rtol=RTOL_F32):
    """Loss value, every parameter's gradient, every metric (value and aggregation)."""
    loss, grads, metrics, num_tokens = worker_out
    exp_loss, exp_grads, exp_metrics, magnitude = expected
    assert abs(loss - exp_loss) <= rtol * magnitude, (loss, exp_loss)
    assert grads.keys() == exp_grads.keys()
    for name, expected_grad in exp_grads.items():
        # entries near 0 are judged against the parameter's largest entry: float32 rounding of the
        # logits is relative to the whole gradient's size, not to each entry's
        scale = float(expected_grad.abs().max())
        assert scale > 0, f"{name} gets no gradient: the check would be vacuous"
        torch.testing.assert_close(grads[name], expected_grad, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")
    assert metrics.keys() == exp_metrics.keys()
    for key, expected_value in exp_metrics.items():
        metric = metrics[key]
        if key in LOSS_METRICS:  # the #6957 rule: SUM of loss / dp_size under global metadata
            assert metric.aggregation is Aggregation.SUM, key
        elif key in MAX_METRICS:
            assert metric.aggregation is Aggregation.MAX, key
        else:  # per-token statistic: local mean weighted by the local token count
            assert metric.aggregation is Aggregation.MEAN and metric.weight == num_tokens, key
        assert metric.value == pytest.approx(expected_value, rel=rtol, abs=rtol * 1e-2), key


def check_same_weights(worker_model, reference_model):
    ours = reference_model.state_dict()
    for key, tensor in worker_model.state_dict().items():
        assert torch.equal(tensor, ours[key]), key


# --------------------------------------------------------------------------------------- actor


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_actor_composed_loss_matches_independent_float64(tiny_model_dir, reference_lm, actor_batch, name, mode):
    # the KL estimator rotates over the grid, so every type also meets several losses and modes
    grid_index = sorted(POLICY_LOSSES).index(name) * len(LOSS_AGG_MODES) + LOSS_AGG_MODES.index(mode)
    kl_type = KL_PENALTY_MODES[grid_index % len(KL_PENALTY_MODES)]
    worker = actor_worker(tiny_model_dir, policy_loss=name, loss_agg_mode=mode, kl_loss_type=kl_type)
    check_same_weights(worker.model, reference_lm)
    for dp_size in (1, 2):  # dp 2: the loss (and gradient) times 2, the loss metrics divided by 2
        meta = meta_for(actor_batch, dp_size)
        expected = expected_actor(reference_lm, actor_batch, name, mode, kl_type, meta)
        if name == "vanilla":  # the data exercises every clip region (else the check would be weak)
            assert expected[2]["actor/pg_clipfrac"] > 0 and expected[2]["actor/pg_clipfrac_lower"] > 0
        if name in ("gspo", "geo_mean", "cispo"):
            assert expected[2]["actor/pg_clipfrac"] > 0
        if name == "sapo":  # the gate attenuates some tokens' gradients
            assert expected[2]["actor/pg_gate_weight_mean"] < 0.99
        compare(run_worker(worker, actor_batch, meta), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_actor_packed_layout_matches_independent_float64(tiny_model_dir, reference_lm, actor_batch, name, mode):
    """actor.use_remove_padding: the micro-batch runs as one packed row (workers/sequence.py), and
    the composed loss, every gradient and every metric are still the padded float64 formulas'."""
    kl_type = KL_PENALTY_MODES[LOSS_AGG_MODES.index(mode) % len(KL_PENALTY_MODES)]
    worker = actor_worker(tiny_model_dir, policy_loss=name, loss_agg_mode=mode, kl_loss_type=kl_type,
                          use_remove_padding=True)
    assert worker.layout.packs
    check_same_weights(worker.model, reference_lm)
    meta = meta_for(actor_batch, 2)
    compare(run_worker(worker, actor_batch, meta), expected_actor(reference_lm, actor_batch, name, mode, kl_type, meta))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_options_from_the_config_reach_the_worker(tiny_model_dir, reference_lm, actor_batch, mode):
    """geo_mean with its own clip range, set as actor.policy_loss_options through load_config,
    is the loss the worker computes; the default range would not match on this batch."""
    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
        **BASE_OVERRIDES,
        "actor.policy_loss": "geo_mean",
        "actor.loss_agg_mode": mode,
        "actor.policy_loss_options.clip_ratio_low": GEO_OWN_CLIP[0],
        "actor.policy_loss_options.clip_ratio_high": GEO_OWN_CLIP[1],
    })))
    worker = actor_worker(tiny_model_dir, cfg)
    meta = meta_for(actor_batch, 2)
    kl_type = cfg.actor.kl_loss_type
    out = run_worker(worker, actor_batch, meta)
    compare(out, expected_actor(reference_lm, actor_batch, "geo_mean", mode, kl_type, meta, geo_clip=GEO_OWN_CLIP))
    with pytest.raises(AssertionError):
        compare(out, expected_actor(reference_lm, actor_batch, "geo_mean", mode, kl_type, meta, geo_clip=GEO_CLIP))


OWN_OPTIONS = {
    "cispo": ({"epsilon_low": CISPO_OWN_EPS[0], "epsilon_high": CISPO_OWN_EPS[1]},
              {"cispo_eps": CISPO_OWN_EPS}, {"cispo_eps": CISPO_EPS}),
    "sapo": ({"tau_pos": SAPO_OWN_TAU[0], "tau_neg": SAPO_OWN_TAU[1]},
             {"sapo_tau": SAPO_OWN_TAU}, {"sapo_tau": SAPO_TAU}),
}


@pytest.mark.parametrize("name", sorted(OWN_OPTIONS))
def test_cispo_and_sapo_options_from_the_config_reach_the_worker(tiny_model_dir, reference_lm, actor_batch, name):
    """cispo's IS-weight bounds (the lower one active too) and sapo's temperatures, set as
    actor.policy_loss_options through load_config, are what the worker computes with; the defaults
    would not match on this batch."""
    mode = "seq-mean-token-mean"
    own, formula, default_formula = OWN_OPTIONS[name]
    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
        **BASE_OVERRIDES, "actor.policy_loss": name, "actor.loss_agg_mode": mode,
        **{f"actor.policy_loss_options.{key}": value for key, value in own.items()}})))
    worker = actor_worker(tiny_model_dir, cfg)
    meta = meta_for(actor_batch, 2)
    kl_type = cfg.actor.kl_loss_type
    out = run_worker(worker, actor_batch, meta)
    expected = expected_actor(reference_lm, actor_batch, name, mode, kl_type, meta, **formula)
    if name == "cispo":  # both bounds clip some token (r < 1 - eps_low exists on this batch)
        log_ratio = reference_log_probs_and_entropy(reference_lm, actor_batch)[0].detach() - actor_batch["old_log_probs"].to(F64)
        valid = actor_batch["response_mask"] != 0
        assert (log_ratio[valid] < math.log(1 - CISPO_OWN_EPS[0])).any()
    compare(out, expected)
    with pytest.raises(AssertionError):
        compare(out, expected_actor(reference_lm, actor_batch, name, mode, kl_type, meta, **default_formula))


@pytest.mark.parametrize("kl_type", KL_PENALTY_MODES)
def test_actor_every_kl_loss_type(tiny_model_dir, reference_lm, actor_batch, kl_type):
    mode = "seq-mean-token-mean"
    worker = actor_worker(tiny_model_dir, policy_loss="vanilla", loss_agg_mode=mode, kl_loss_type=kl_type)
    meta = meta_for(actor_batch, 2)
    compare(run_worker(worker, actor_batch, meta),
            expected_actor(reference_lm, actor_batch, "vanilla", mode, kl_type, meta))


def test_actor_dp_size_multiplies_loss_and_gradient(tiny_model_dir, actor_batch):
    """With the same counts, dp_size=2 doubles the loss and the gradient (it cancels DDP's mean);
    the reported loss metric (loss / dp_size, SUM) is unchanged."""
    worker = actor_worker(tiny_model_dir, loss_agg_mode="token-mean")
    loss1, grads1, metrics1, _ = run_worker(worker, actor_batch, meta_for(actor_batch, 1))
    loss2, grads2, metrics2, _ = run_worker(worker, actor_batch, meta_for(actor_batch, 2))
    assert loss2 == pytest.approx(2 * loss1, rel=1e-12)
    for name, grad in grads1.items():
        torch.testing.assert_close(grads2[name], 2 * grad, rtol=1e-12, atol=0)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss"):
        assert metrics2[key].value == pytest.approx(metrics1[key].value, rel=1e-12)


def test_the_actor_check_can_fail(tiny_model_dir, reference_lm, actor_batch):
    """Negative controls: the comparison detects a flipped entropy sign and a micro-batch that
    normalises by its own token count (the bug the contract prevents)."""
    mode = "token-mean"
    worker = actor_worker(tiny_model_dir, policy_loss="vanilla", loss_agg_mode=mode, kl_loss_type="low_var_kl")
    meta = meta_for(actor_batch, 1)
    out = run_worker(worker, actor_batch, meta)
    compare(out, expected_actor(reference_lm, actor_batch, "vanilla", mode, "low_var_kl", meta))
    with pytest.raises(AssertionError):
        compare(out, expected_actor(reference_lm, actor_batch, "vanilla", mode, "low_var_kl", meta, entropy_sign=-1.0))
    with pytest.raises(AssertionError):
        compare(out, expected_actor(reference_lm, actor_batch, "vanilla", mode, "low_var_kl", meta, own_token_count=True))


# ------------------------------------------------------------------------ on-policy distillation

DISTILL_COEF = 0.6


@pytest.mark.parametrize("distill_type", KL_PENALTY_MODES)
def test_actor_distill_loss_matches_independent_float64(tiny_model_dir, reference_lm, actor_batch, distill_type):
    """actor.distill's term (every estimator; the aggregation mode rotates) in the composed actor
    loss, beside the policy loss, the entropy bonus and the KL loss: loss, gradients, metrics."""
    from rlflow.config import DistillConfig

    mode = LOSS_AGG_MODES[KL_PENALTY_MODES.index(distill_type) % len(LOSS_AGG_MODES)]
    worker = actor_worker(tiny_model_dir, policy_loss="vanilla", loss_agg_mode=mode,
                          distill=DistillConfig(coef=DISTILL_COEF, kl_type=distill_type))
    check_same_weights(worker.model, reference_lm)
    kl_type = worker.cfg.actor.kl_loss_type
    for dp_size in (1, 2):
        meta = meta_for(actor_batch, dp_size)
        expected = expected_actor(reference_lm, actor_batch, "vanilla", mode, kl_type, meta,
                                  distill=(DISTILL_COEF, distill_type, True))
        compare(run_worker(worker, actor_batch, meta), expected)
    # the teacher's log-probs matter: with the reference's in their place the comparison fails
    swapped = actor_batch.clone()
    swapped["teacher_log_prob"] = actor_batch["ref_log_prob"]
    with pytest.raises(AssertionError):
        compare(run_worker(worker, swapped, meta), expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("packed", [False, True])
def test_actor_pure_distill_matches_independent_float64(tiny_model_dir, reference_lm, actor_batch, mode, packed):
    """actor.distill.use_policy_loss=false through load_config: no policy loss and none of its
    metrics; the distillation term (k3, the default) with the entropy bonus and the KL loss, padded
    and packed (actor.use_remove_padding)."""
    cfg = to_dataclass(load_config(None, tiny_overrides(tiny_model_dir, **{
        **BASE_OVERRIDES, "actor.loss_agg_mode": mode, "actor.use_remove_padding": packed,
        "actor.distill.coef": DISTILL_COEF, "actor.distill.use_policy_loss": False,
        "teacher.enable": True, "teacher.model.path": tiny_model_dir})))
    worker = actor_worker(tiny_model_dir, cfg)
    assert worker.layout.packs == packed
    meta = meta_for(actor_batch, 2)
    out = run_worker(worker, actor_batch, meta)
    assert "actor/pg_loss" not in out[2]
    compare(out, expected_actor(reference_lm, actor_batch, "vanilla", mode, cfg.actor.kl_loss_type, meta,
                                distill=(DISTILL_COEF, "low_var_kl", False)))


# --------------------------------------------------------------------------- rollout correction

# Not the config's defaults (2, 0.5, 2): the worker must apply what algorithm.rollout_correction says.
IS_CAP, IS_LOW, IS_HIGH = 1.8, 0.6, 1.7
IS_KINKS = (math.log(IS_CAP), math.log(IS_LOW), math.log(IS_HIGH))  # in log-ratio space
IS_LOG_RATIO_CLAMP = 20.0  # every d = old - rollout, and every sequence's sum of them
FAR_OFF_POLICY = -25.0  # one token's d, beyond the clamp (see corrected_batch)
CORRECTED_LOSSES = [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean")]


@functools.lru_cache(maxsize=None)
def correction_cfg(model_dir: str, correction: str):
    """The base config with algorithm.rollout_correction set, through load_config (validated)."""
    return to_dataclass(load_config(None, tiny_overrides(model_dir, **{
        **BASE_OVERRIDES,
        "algorithm.rollout_correction.mode": correction,
        "algorithm.rollout_correction.cap": IS_CAP,
        "algorithm.rollout_correction.low": IS_LOW,
        "algorithm.rollout_correction.high": IS_HIGH,
    })))


def raw_rollout_log_ratio(micro) -> torch.Tensor:
    """old - rollout on the float32 values the worker receives, unclamped."""
    return micro["old_log_probs"].to(F64) - micro["rollout_log_probs"].to(F64)


def rollout_log_ratio(micro) -> torch.Tensor:
    """d = old - rollout clamped to [-20, 20], 0 outside the mask."""
    d = torch.clamp(raw_rollout_log_ratio(micro), -IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP)
    return torch.where(micro["response_mask"] != 0, d, torch.zeros_like(d))


def sequence_log_ratio(d: torch.Tensor) -> torch.Tensor:
    """Each row's sum of d (the log of its product of token ratios), clamped, [B]; d is 0 outside
    the mask."""
    return torch.clamp(d.sum(-1), -IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP)


@pytest.fixture(scope="module")
def corrected_batch(actor_batch):
    """actor_batch plus rollout_log_probs whose log-ratios to old_log_probs reach every branch of
    every mode: tokens and sequences above the cap and under it, below, inside and above the band.
    A copy: the workers of the other tests would report rollout_corr/* metrics for it."""
    micro = actor_batch.clone()
    mask = micro["response_mask"]
    valid = mask != 0
    gen = torch.Generator().manual_seed(2024)
    offset = torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 0.5  # d, token by token
    offset[1, 0] = 0.9  # the single-token row: above the cap and the band, as a token and as a sequence
    offset[3, :2] = torch.tensor([0.3, -0.2], dtype=F64)  # a sequence inside the band, under the cap
    # beyond the clamp, on the negative side: the k3 = e^d - 1 - d of the other tokens stays visible
    # next to this token's 19 (d = +25 would give e^20). An engine's log-prob above 0 cannot happen,
    # but nothing in the correction assumes it cannot.
    offset[4, 3] = FAR_OFF_POLICY
    offset = away_from(offset, IS_KINKS)
    rollout = micro["old_log_probs"].to(F64) - offset
    # padding junk: d = 3 - (-30) = 33 there, which any unmasked use would show
    micro["rollout_log_probs"] = torch.where(valid, rollout, torch.full_like(rollout, -30.0)).float()

    # the premises, on the float32 values the worker receives; if they fail, change the seed above
    d = rollout_log_ratio(micro)
    seq = sequence_log_ratio(d)
    assert min_distance(d, mask, IS_KINKS) > KINK_MARGIN / 2, "a token's log-ratio sits on the cap or a band edge"
    assert min_distance(seq, torch.ones_like(seq), IS_KINKS) > KINK_MARGIN / 2, \
        "a sequence's log-ratio sits on the cap or a band edge"
    assert int((raw_rollout_log_ratio(micro)[valid].abs() > IS_LOG_RATIO_CLAMP).sum()) == 1  # the clamp acts once
    tokens = d[valid]
    assert (tokens < math.log(IS_LOW)).any() and (tokens > math.log(IS_HIGH)).any(), "the band is left on both sides"
    return micro


def expected_rollout_correction(micro, correction: str):
    """(weights [B, R], rollout_corr/* metric values) of one mode, by hand in float64. The weights
    are 1 outside the mask; truncated: the cap lowered the weight; dropped: weight 0."""
    mask = micro["response_mask"]
    valid = mask != 0
    d = rollout_log_ratio(micro)
    token_ratio = torch.exp(d)
    level, kind = correction.split("_")
    if level == "token":
        ratio = token_ratio
    elif level == "seq":  # the row's product of token ratios, on each of its tokens
        ratio = torch.exp(sequence_log_ratio(d)).unsqueeze(-1).expand_as(d)
    else:
        raise AssertionError(f"rollout correction {correction!r} has no independent formula in this test: add one")
    if kind == "tis":  # min(ratio, cap)
        truncated = ratio > IS_CAP
        weights = torch.where(truncated, torch.full_like(ratio, IS_CAP), ratio)
    elif kind == "mis":  # the ratio inside [low, high], else 0
        truncated = torch.zeros_like(valid)
        weights = torch.where((ratio >= IS_LOW) & (ratio <= IS_HIGH), ratio, torch.zeros_like(ratio))
    else:
        raise AssertionError(f"rollout correction {correction!r} has no independent formula in this test: add one")
    weights = torch.where(valid, weights, torch.ones_like(weights))
    # every statistic is over all valid tokens, the dropped ones included
    metrics = {
        "rollout_corr/log_ratio_mean": local_mean(d, mask),
        "rollout_corr/k3_kl": local_mean(torch.exp(d) - 1.0 - d, mask),
        "rollout_corr/abs_diff_max": float(d[valid].abs().max()),
        # the band of the token ratio, whatever the mode
        "rollout_corr/out_of_band_frac": local_mean(((token_ratio < IS_LOW) | (token_ratio > IS_HIGH)).to(F64), mask),
        "rollout_corr/is_weight_mean": local_mean(weights, mask),
        "rollout_corr/truncated_frac": local_mean((truncated & valid).to(F64), mask),
        "rollout_corr/dropped_frac": local_mean((valid & (weights == 0)).to(F64), mask),
    }
    return weights, metrics


def expected_corrected_actor(model, micro, name, mode, kl_type, meta, correction, *, apply_weights=True):
    """expected_actor with the correction's weights on the policy loss and its metrics.
    apply_weights=False: every weight 1, the metrics unchanged (a negative control)."""
    weights, correction_metrics = expected_rollout_correction(micro, correction)
    loss, grads, metrics, magnitude = expected_actor(model, micro, name, mode, kl_type, meta,
                                                     is_weights=weights if apply_weights else None)
    return loss, grads, {**metrics, **correction_metrics}, magnitude


@pytest.mark.parametrize("correction", sorted(ROLLOUT_CORRECTIONS))
@pytest.mark.parametrize("name, mode", CORRECTED_LOSSES)
def test_actor_rollout_correction_matches_independent_float64(tiny_model_dir, reference_lm, corrected_batch,
                                                              name, mode, correction):
    cfg = correction_cfg(tiny_model_dir, correction)
    worker = actor_worker(tiny_model_dir, cfg, policy_loss=name, loss_agg_mode=mode)
    check_same_weights(worker.model, reference_lm)
    kl_type = cfg.actor.kl_loss_type
    for dp_size in (1, 2):
        meta = meta_for(corrected_batch, dp_size)
        expected = expected_corrected_actor(reference_lm, corrected_batch, name, mode, kl_type, meta, correction)
        # the data reach both branches of the mode (for seq_*: some whole rows, not all)
        lowered = "truncated_frac" if correction.endswith("_tis") else "dropped_frac"
        assert 0 < expected[2][f"rollout_corr/{lowered}"] < 1, expected[2][f"rollout_corr/{lowered}"]
        out = run_worker(worker, corrected_batch, meta)
        compare(out, expected)
    # the correction changed the loss: with every weight 1 the same comparison fails
    with pytest.raises(AssertionError):
        compare(out, expected_corrected_actor(reference_lm, corrected_batch, name, mode, kl_type, meta, correction,
                                              apply_weights=False))


# -------------------------------------------------------------------------------------- critic


@pytest.fixture(scope="module")
def critic_setup(tiny_model_dir):
    """A float64 copy of a critic worker's model taken before any step (the scalar head is freshly
    initialised at load, from the worker's seed, so it cannot be re-loaded from the folder) and
    the batch."""
    reference = copy.deepcopy(critic_worker(tiny_model_dir).model)
    config = reference.config
    micro = base_micro_batch(config.pad_token_id, config.vocab_size)
    mask = micro["response_mask"]
    valid = mask != 0
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        vpreds = full_forward_logits(reference, micro).squeeze(-1).to(F64)
    # old values: some within the clip range, some beyond it (both sides)
    offset = away_from(torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 0.4,
                       (CLIPRANGE_VALUE, -CLIPRANGE_VALUE))
    returns = vpreds + torch.randn(micro.batch_size[0], R, generator=gen, dtype=F64) * 0.8
    junk = torch.full_like(vpreds, 3.0)
    micro["values"] = torch.where(valid, vpreds + offset, junk).float()
    micro["returns"] = torch.where(valid, returns, -junk).float()

    # premises on the float32 values the worker receives: the clip is active, and where it is,
    # both outcomes occur (the clipped error larger: no gradient; smaller: the plain error counts)
    values, returns = micro["values"].to(F64), micro["returns"].to(F64)
    moved = (vpreds - values).abs() > CLIPRANGE_VALUE
    v_clipped = values + torch.clamp(vpreds - values, -CLIPRANGE_VALUE, CLIPRANGE_VALUE)
    larger = (v_clipped - returns) ** 2 > (vpreds - returns) ** 2
    assert (valid & moved & larger).any() and (valid & moved & ~larger).any() and (valid & ~moved).any()
    assert min_distance((vpreds - values).abs(), mask, (CLIPRANGE_VALUE,)) > KINK_MARGIN / 2
    gap = ((v_clipped - returns) ** 2 - (vpreds - returns) ** 2).abs()
    assert float(gap[valid & moved].min()) > KINK_MARGIN
    return reference, micro


def expected_critic(model, micro, mode, meta, *, clip=True):
    """clip=False: the plain squared error (a negative control)."""
    model.zero_grad(set_to_none=True)
    mask = micro["response_mask"]
    vpreds = full_forward_logits(model, micro).squeeze(-1).to(F64)
    values, returns = micro["values"].to(F64), micro["returns"].to(F64)
    # clip(v, v_old ± c): only where v left the range does it differ from v
    beyond = (vpreds - values).abs() > CLIPRANGE_VALUE
    v_clipped = torch.where(beyond, values + CLIPRANGE_VALUE * torch.sign(vpreds - values), vpreds).detach()
    plain, clipped = (vpreds - returns) ** 2, (v_clipped - returns) ** 2
    clip_wins = beyond & (clipped > plain) & clip
    per_token = torch.where(clip_wins, clipped, plain)  # the max of the two
    vf_loss = 0.5 * aggregate(per_token, mask, mode, meta)
    vf_loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    metrics = {
        "critic/vf_loss": float(vf_loss.detach()) / meta.dp_size,
        "critic/vf_clipfrac": local_mean(clip_wins.to(F64), mask),
        "critic/vpred_mean": local_mean(vpreds.detach(), mask),
    }
    return float(vf_loss.detach()), grads, metrics, abs(float(vf_loss.detach()))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_critic_value_loss_matches_independent_float64(tiny_model_dir, critic_setup, mode):
    reference, micro = critic_setup
    worker = critic_worker(tiny_model_dir, loss_agg_mode=mode)
    check_same_weights(worker.model, reference)  # the same seed gives the same head
    for dp_size in (1, 2):
        meta = meta_for(micro, dp_size)
        expected = expected_critic(reference, micro, mode, meta)
        assert 0 < expected[2]["critic/vf_clipfrac"] < 1
        compare(run_worker(worker, micro, meta), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_critic_packed_layout_matches_independent_float64(tiny_model_dir, critic_setup, mode):
    reference, micro = critic_setup
    worker = critic_worker(tiny_model_dir, loss_agg_mode=mode, use_remove_padding=True)
    assert worker.layout.packs
    check_same_weights(worker.model, reference)
    meta = meta_for(micro, 2)
    compare(run_worker(worker, micro, meta), expected_critic(reference, micro, mode, meta))


def test_the_critic_check_can_fail(tiny_model_dir, critic_setup):
    """Negative controls: the comparison detects a value loss without its clip, and one that
    normalises by the micro-batch's own token count."""
    reference, micro = critic_setup
    mode = "token-mean"
    worker = critic_worker(tiny_model_dir, loss_agg_mode=mode)
    meta = meta_for(micro, 1)
    out = run_worker(worker, micro, meta)
    compare(out, expected_critic(reference, micro, mode, meta))
    with pytest.raises(AssertionError):
        compare(out, expected_critic(reference, micro, mode, meta, clip=False))
    own_count = BatchMeta(1, int(micro["response_mask"].sum()), meta.global_batch_size, LOSS_SCALE_FACTOR)
    with pytest.raises(AssertionError):
        compare(out, expected_critic(reference, micro, mode, own_count))
