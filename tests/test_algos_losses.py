"""Hand-checked values and error messages of rlflow.algos losses, KL and helpers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    compute_policy_loss_gspo,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    masked_whiten,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
D = torch.float64

# Rows of 2, 1 and 0 valid tokens; 100 sits in padding and must never count.
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=D)
LOSS = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0], [100.0, 100.0, 100.0]], dtype=D)


# ----------------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 6 / 3),  # (1 + 2 + 3) / 3 tokens
        ("token-sum", 6.0),
        ("seq-mean-token-sum", (3 + 3) / 2),  # 2 sequences with a valid token
        ("seq-mean-token-mean", (1.5 + 3) / 2),  # the empty row contributes nothing
        ("seq-mean-token-sum-norm", (3 + 3) / 2 / 4),  # loss_scale_factor = 4
    ],
)
def test_agg_loss_values_without_metadata(mode, expected):
    loss = agg_loss(LOSS, MASK, mode, loss_scale_factor=4.0)
    assert float(loss.detach()) == pytest.approx(expected)


def test_agg_loss_uses_global_metadata_and_dp_size():
    # This micro-batch is one of several: the mini-batch had 12 tokens in 5 sequences, 2 ranks.
    meta = dict(dp_size=2, batch_num_tokens=12, global_batch_size=5, loss_scale_factor=4.0)
    assert float(agg_loss(LOSS, MASK, "token-mean", **meta)) == pytest.approx(6 / 12 * 2)
    assert float(agg_loss(LOSS, MASK, "token-sum", **meta)) == pytest.approx(6 * 2)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum", **meta)) == pytest.approx(6 / 5 * 2)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-mean", **meta)) == pytest.approx(4.5 / 5 * 2)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", **meta)) == pytest.approx(6 / 5 * 2 / 4)


def test_agg_loss_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "token-avg")
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)


@pytest.mark.parametrize(
    "mode, missing",
    [
        ("token-mean", "batch_num_tokens"),
        ("seq-mean-token-sum", "global_batch_size"),
        ("seq-mean-token-mean", "global_batch_size"),
        ("seq-mean-token-sum-norm", "global_batch_size"),
    ],
)
def test_agg_loss_dp_without_metadata_is_an_error(mode, missing):
    with pytest.raises(ValueError, match=f"dp_size=2.*{missing}"):
        agg_loss(LOSS, MASK, mode, dp_size=2, loss_scale_factor=4.0)


def test_token_sum_needs_no_metadata_even_with_dp():
    # token-sum divides by nothing, so "* dp_size" alone is exact.
    assert float(agg_loss(LOSS, MASK, "token-sum", dp_size=3)) == pytest.approx(18.0)


def test_norm_mode_requires_loss_scale_factor():
    with pytest.raises(ValueError, match="loss_scale_factor.*set"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)


def test_agg_loss_rejects_bad_dp_size():
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(LOSS, MASK, "token-sum", dp_size=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("with_meta", [False, True])
def test_micro_batch_without_valid_tokens_gives_zero_loss_with_grad(mode, with_meta):
    # inf/NaN in padding (e.g. exp of a huge log-ratio) must not leak either.
    theta = torch.tensor([[float("inf"), float("nan")], [1.0, 2.0]], dtype=D, requires_grad=True)
    mask = torch.zeros(2, 2, dtype=D)
    meta = dict(batch_num_tokens=0, global_batch_size=0) if with_meta else {}
    loss = agg_loss(theta * 2, mask, mode, loss_scale_factor=3.0, **meta)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(theta.grad, torch.zeros_like(theta))


def test_token_counts_are_exact_for_low_precision_masks():
    # 3000 ones summed in bf16 would stall at 256; counts are taken in integers.
    mask = torch.ones(3, 1000, dtype=torch.bfloat16)
    loss = torch.ones(3, 1000, dtype=torch.float32)
    assert float(agg_loss(loss, mask, "token-mean")) == 1.0
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == 1.0


def test_masked_helpers():
    assert float(masked_mean(LOSS, MASK)) == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(LOSS, MASK, axis=-1), torch.tensor([1.5, 3.0, 0.0], dtype=D))
    assert float(masked_mean(LOSS, torch.zeros_like(MASK))) == 0.0  # not NaN
    whitened = masked_whiten(LOSS, MASK)
    valid = MASK.bool()
    # mean 0, unbiased std 1 over valid positions (1, 2, 3: mean 2, std 1)
    torch.testing.assert_close(whitened[valid], torch.tensor([-1.0, 0.0, 1.0], dtype=D), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------ policy losses


def test_vanilla_dual_clip_hand_example():
    # clip 0.2/0.2, dual clip c = 3. Per token (A, ratio) -> loss:
    #  1: (-1, 5)   unclipped 5, clipped 1.2 -> max 5 -> dual min(5, 3) = 3   (lower-clipped)
    #  2: (-1, 2)   unclipped 2, clipped 1.2 -> max 2 -> min(2, 3) = 2
    #  3: (+1, 5)   unclipped -5, clipped -1.2 -> max -1.2                   (clipped)
    #  4: (+1, 0.5) unclipped -0.5, clipped -0.8 -> max -0.5
    #  5: (-1, 0.5) unclipped 0.5, clipped 0.8 -> max 0.8 -> min(0.8, 3)     (clipped)
    #  6: padding with a huge log-ratio: ignored
    # token-mean = (3 + 2 - 1.2 - 0.5 + 0.8) / 5 = 0.82; clipfrac 2/5; lower 1/5.
    ratio = torch.tensor([[5.0, 2.0, 5.0, 0.5, 0.5, math.exp(60.0)]], dtype=D)
    log_prob = ratio.log().clone().requires_grad_(True)
    old_log_prob = torch.zeros_like(ratio)
    advantages = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -1.0, -1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=D)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, mask, "token-mean", clip_ratio_c=3.0
    )
    assert float(pg_loss.detach()) == pytest.approx(0.82)
    assert float(clipfrac) == pytest.approx(0.4)
    assert float(clipfrac_lower) == pytest.approx(0.2)
    assert float(ppo_kl) == pytest.approx(-float(ratio.log()[0, :5].mean()))
    pg_loss.backward()
    # d(-A * ratio)/d log_prob = -A * ratio on unclipped tokens, / 5 tokens; clipped ones get 0.
    expected = torch.tensor([[0.0, 2.0, 0.0, -0.5, 0.0, 0.0]], dtype=D) / 5
    torch.testing.assert_close(log_prob.grad, expected)


def test_vanilla_rejects_clip_ratio_c_at_most_one():
    x = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(x, x, x, torch.ones_like(x), clip_ratio_c=1.0)


def test_gspo_token_form_equals_sequence_objective():
    """With seq-mean-token-mean, GSPO's token-level form has the value and gradient of
    mean_i max(-A_i s_i, -A_i clip(s_i)) with s_i = exp(mean_t log-ratio of row i)."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=D)
    old_log_prob = torch.randn(4, 4, generator=gen, dtype=D)
    log_prob_init = old_log_prob + 0.3 * torch.randn(4, 4, generator=gen, dtype=D)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=D)
    advantages = seq_adv.unsqueeze(-1).expand(4, 4)

    log_prob = log_prob_init.clone().requires_grad_(True)
    pg_loss, *_ = compute_policy_loss_gspo(
        old_log_prob, log_prob, advantages, mask, "seq-mean-token-mean",
        clip_ratio_low=0.1, clip_ratio_high=0.1,
    )
    pg_loss.backward()

    direct_lp = log_prob_init.clone().requires_grad_(True)
    s = torch.exp(masked_mean(direct_lp - old_log_prob, mask, axis=-1))
    direct = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(0.9, 1.1)).mean()
    direct.backward()
    assert float(pg_loss.detach()) == pytest.approx(float(direct.detach()))
    torch.testing.assert_close(log_prob.grad, direct_lp.grad)


def test_reinforce_on_policy_gradient():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=D, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 5.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    loss, *_ = compute_policy_loss_reinforce(lp.detach(), lp, adv, mask, "token-mean")
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5, 0.0]], dtype=D))


def test_policy_loss_registry():
    assert {"vanilla", "gspo", "reinforce", "geo_mean"} <= set(POLICY_LOSSES)
    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    with pytest.raises(ValueError) as err:
        get_policy_loss_fn("ppo2")
    for name in POLICY_LOSSES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_refuses_dp_without_metadata(name):
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match="dp_size=2"):
        get_policy_loss_fn(name)(x, x, x, torch.ones_like(x), "token-mean", dp_size=2)


# --------------------------------------------------------------------------------- value loss


def test_value_loss_hand_example():
    # token 1: v=1.5, v_old=1.0, R=2: clipped v 1.2 -> (0.8)^2=0.64 > (0.5)^2=0.25 -> 0.64 (clipped)
    # token 2: v=1.1, v_old=1.0, R=0: inside the range -> 1.21 both ways (not counted as clipped)
    # token 3: padding. loss = 0.5 * (0.64 + 1.21) / 2 = 0.4625; clipfrac 1/2
    vpreds = torch.tensor([[1.5, 1.1, 50.0]], dtype=D)
    values = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert float(vf_loss) == pytest.approx(0.4625)
    assert float(vf_clipfrac) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------ entropy


def test_entropy_from_logits_matches_direct_computation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=gen, dtype=D) * 3
    direct = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), direct)
    # Stable at extreme scales: a near one-hot distribution has entropy ~0, not NaN.
    huge = torch.tensor([[1e4, 0.0, -1e4]], dtype=torch.float32)
    assert torch.isfinite(entropy_from_logits(huge)).all()
    assert float(entropy_from_logits(huge)) == pytest.approx(0.0, abs=1e-6)
    uniform = torch.zeros(1, 8, dtype=D)
    assert float(entropy_from_logits(uniform)) == pytest.approx(math.log(8))


# ----------------------------------------------------------------------------------------- KL


def test_kl_penalty_known_values():
    log2 = math.log(2.0)
    logprob = torch.tensor([math.log(0.5), math.log(0.25)], dtype=D)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=D)
    expected = {
        "kl": [log2, -log2],
        "k1": [log2, -log2],
        "abs": [log2, log2],
        "mse": [0.5 * log2**2, 0.5 * log2**2],
        "k2": [0.5 * log2**2, 0.5 * log2**2],
        # r = ref/pi: 0.5 -> 0.5 + log 2 - 1; 2 -> 2 - log 2 - 1
        "low_var_kl": [log2 - 0.5, 1 - log2],
        "k3": [log2 - 0.5, 1 - log2],
    }
    for mode, values in expected.items():
        torch.testing.assert_close(kl_penalty(logprob, ref, mode), torch.tensor(values, dtype=D), msg=mode)


def test_low_var_kl_is_clamped():
    logprob = torch.tensor([0.0, -30.0], dtype=D)
    ref = torch.tensor([-30.0, 0.0], dtype=D)
    out = kl_penalty(logprob, ref, "low_var_kl")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0], dtype=D))


def test_kl_penalty_unknown_mode():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(x, x, "k9")
    with pytest.raises(NotImplementedError):
        kl_penalty(x, x, "full")


def test_adaptive_kl_controller_moves_towards_target():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=10)
    ctl.update(current_kl=0.2, n_steps=1)  # KL too high -> coefficient up, error clipped at 0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 / 10))
    before = ctl.value
    ctl.update(current_kl=0.09, n_steps=2)  # slightly low -> down by (0.9 - 1) * 2 / 10
    assert ctl.value == pytest.approx(before * (1 - 0.1 * 2 / 10))
    ctl.update(current_kl=0.1, n_steps=5)  # on target -> unchanged
    assert ctl.value == pytest.approx(before * 0.98)

    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.1, horizon=10)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.state_dict() == ctl.state_dict()


def test_fixed_kl_controller_and_factory():
    ctl = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctl, FixedKLController)
    ctl.update(current_kl=10.0, n_steps=100)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    adaptive = get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="fixed"):
        get_kl_controller("pid", kl_coef=0.1)


# ------------------------------------------------------------------------------------ layering


def test_import_rlflow_algos_stays_light():
    code = (
        "import sys, rlflow.algos\n"
        "heavy = [m for m in ('ray', 'transformers', 'omegaconf') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import rlflow.algos pulled in: {out.stdout.strip()}"
