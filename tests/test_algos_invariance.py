"""The normalisation contract: losses, gradients and metrics do not depend on the split.

A mini-batch is cut into dp shards (random sizes, random row order) and each shard into
micro-batches (random sizes, each optionally trimmed to its own last valid column, as unpadding
does). Every rank sums the gradients of its micro-batch losses (backward per micro-batch); the
"all-reduce" is the MEAN over ranks, as DDP/FSDP take it. With the whole mini-batch's metadata
passed to every micro-batch, that gradient must equal the gradient of the whole mini-batch in one
piece with dp_size=1. The policy-loss test iterates the registry, so a newly registered loss is
covered automatically. Hypothesis also draws the values' dtype (float64, float32), the mask's dtype
(float64, float32, long, bool) and the clip ranges.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow import metrics
from rlflow.algos import (
    KL_PENALTY_MODES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
)

DTYPE = torch.float64  # of the fixed examples (negative controls); hypothesis draws float32 too
# (rtol, atol, extra atol of a loss value per valid token), per value dtype.
# float64: the split only reorders sums, so the differences are a few ulps.
# float32: measured over ~22,000 drawn float32 cases of the tests below (120-200 per test, one and
# two threads), the worst differences were gradients 9.5e-7 absolute (entropy: p * (z - E_p[z])
# cancels, so the error follows the logits' size, not the gradient's), token statistics 5.4e-7
# absolute / 3.7e-6 relative, and loss values 4.6e-7 per valid token: a loss whose per-token terms
# have both signs can nearly cancel, so its float32 rounding scales with the number of terms, not
# with the total (6e-5 relative was seen). The float32 bounds leave >= 5x headroom over those and
# stay far below a split bug's effect (a micro-batch normalised by its own count, or a missing dp
# factor, is off by a factor).
TOLERANCES = {torch.float64: (1e-9, 1e-12, 0.0), torch.float32: (2e-5, 5e-6, 5e-6)}
RTOL, ATOL, _ = TOLERANCES[DTYPE]
LOSS_SCALE_FACTOR = 7.0  # a configured constant, deliberately not any padded width
HYPOTHESIS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
KL_HYPOTHESIS = settings(HYPOTHESIS, max_examples=15)  # 35 (mode, type) pairs: keep the file's time


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: with more intra-op threads, torch.softmax and backward spend ~1 ms
    per call synchronising threads (measured on the 2-core machine: 2 ms vs 0.03 ms per softmax),
    which was most of this file's time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ the harness


def random_mask(gen: torch.Generator, rows: int, width: int, holes: bool) -> torch.Tensor:
    """Right-padded variable lengths (0..width, so fully masked and full rows both occur),
    optionally with holes inside the valid span (e.g. masked tool output)."""
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    # Make very uneven lengths likely: one row empty, one row full (when there are enough rows).
    if rows >= 3:
        lengths[0], lengths[1] = 0, width
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    if holes:
        mask = mask & (torch.rand(rows, width, generator=gen) > 0.3)
    return mask.to(DTYPE)


def random_composition(gen: torch.Generator, total: int, parts: int) -> list[int]:
    """total split into `parts` positive integers, uniformly among cut positions."""
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: parts - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def random_plan(gen: torch.Generator, rows: int, dp_size: int) -> list[list[torch.Tensor]]:
    """Row indices per rank per micro-batch: a random permutation cut into dp shards, each shard
    into a random number of micro-batches of random sizes."""
    order = torch.randperm(rows, generator=gen)
    plan, start = [], 0
    for shard_size in random_composition(gen, rows, dp_size):
        shard = order[start : start + shard_size]
        start += shard_size
        num_micro = int(torch.randint(1, shard_size + 1, (1,), generator=gen))
        micro_sizes = random_composition(gen, shard_size, num_micro)
        plan.append(list(torch.split(shard, micro_sizes)))
    return plan


def global_meta(mask: torch.Tensor, as_tensor: bool) -> dict:
    """The driver's counts (of any mask dtype: float, long or bool)."""
    valid = mask != 0
    batch_num_tokens = valid.sum()
    global_batch_size = valid.any(-1).sum()
    assert int(batch_num_tokens) == int(mask.to(torch.float64).sum())  # 0/1 masks: the same count
    if not as_tensor:  # BatchMeta may carry Python numbers or tensors; both must work
        batch_num_tokens, global_batch_size = int(batch_num_tokens), int(global_batch_size)
    return dict(
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=LOSS_SCALE_FACTOR,
    )


def micro_width(mask: torch.Tensor, rows: torch.Tensor, trim: bool) -> int:
    """Trimmed width: up to the micro-batch's last valid column (1 if it has none)."""
    if not trim:
        return mask.shape[1]
    valid_cols = (mask[rows] != 0).any(0).nonzero()
    return int(valid_cols.max()) + 1 if valid_cols.numel() else 1


def check_split_invariance(loss_fn, leaf_init, mask, plan, dp_size, meta, trim):
    """loss_fn(leaf, rows, width, dp_size, meta) -> (loss, {stat_name: local masked mean}).

    Asserts gradient, loss-metric and token-weighted statistic invariance; returns the pieces so
    negative controls can inspect them.
    """
    leaf = leaf_init.clone().requires_grad_(True)
    whole_loss, whole_stats = loss_fn(leaf, torch.arange(mask.shape[0]), mask.shape[1], 1, {})
    whole_loss.backward()
    whole_grad = leaf.grad.clone()

    rank_grads, loss_metric_sum, micro_loss_dtypes = [], 0.0, set()
    stat_weighted_sums: dict[str, float] = {name: 0.0 for name in whole_stats}
    for shard in plan:
        rank_leaf = leaf_init.clone().requires_grad_(True)  # each rank has its own .grad
        for rows in shard:
            width = micro_width(mask, rows, trim)
            micro_loss, micro_stats = loss_fn(rank_leaf, rows, width, dp_size, meta)
            micro_loss.backward()
            micro_loss_dtypes.add(micro_loss.dtype)
            loss_metric_sum += float(micro_loss.detach()) / dp_size
            local_tokens = float((mask[rows][:, :width] != 0).sum())
            for name, value in micro_stats.items():
                assert math.isfinite(float(value)), f"{name} is not finite on a micro-batch"
                stat_weighted_sums[name] += float(value) * local_tokens
        rank_grads.append(rank_leaf.grad)
    allreduced_grad = torch.stack(rank_grads).mean(0)  # DDP/FSDP average over ranks

    return dict(
        whole_loss=float(whole_loss.detach()),
        whole_grad=whole_grad,
        whole_stats={k: float(v) for k, v in whole_stats.items()},
        loss_metric_sum=loss_metric_sum,
        allreduced_grad=allreduced_grad,
        stat_weighted_sums=stat_weighted_sums,
        total_tokens=float((mask != 0).sum()),
        dtype=leaf_init.dtype,
        loss_dtypes={whole_loss.dtype, *micro_loss_dtypes},
    )


def assert_invariant(result):
    rtol, atol, loss_atol_per_token = TOLERANCES[result["dtype"]]
    # computed in the drawn dtype: no float64 count, mask or constant silently upcasts float32
    assert result["loss_dtypes"] == {result["dtype"]}
    assert torch.isfinite(result["whole_grad"]).all()
    torch.testing.assert_close(result["allreduced_grad"], result["whole_grad"], rtol=rtol, atol=atol)
    loss_atol = atol + loss_atol_per_token * result["total_tokens"]
    assert result["loss_metric_sum"] == pytest.approx(result["whole_loss"], rel=rtol, abs=loss_atol)
    if result["total_tokens"] > 0:
        for name, whole_value in result["whole_stats"].items():
            weighted_mean = result["stat_weighted_sums"][name] / result["total_tokens"]
            assert weighted_mean == pytest.approx(whole_value, rel=rtol, abs=atol), name


@st.composite
def splits(draw):
    rows = draw(st.integers(1, 12))
    return dict(
        rows=rows,
        width=draw(st.integers(1, 9)),
        dp_size=draw(st.integers(1, min(4, rows))),
        holes=draw(st.booleans()),
        trim=draw(st.booleans()),
        meta_as_tensor=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        mask_dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.long, torch.bool])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def clip_ranges(draw):
    """Clip ranges of the policy and value losses, instead of fixed defaults."""
    return dict(
        clip_ratio_low=draw(st.floats(0.05, 0.5)),
        clip_ratio_high=draw(st.floats(0.05, 0.5)),
        clip_ratio_c=draw(st.floats(1.5, 5.0)),
        cliprange_value=draw(st.floats(0.05, 0.5)),
    )


def setup_case(case):
    """The mask is drawn as 0/1 floats, then given to the losses in the drawn mask dtype; the
    values are drawn (randn below) in the drawn value dtype."""
    gen = torch.Generator().manual_seed(case["seed"])
    mask = random_mask(gen, case["rows"], case["width"], case["holes"]).to(case["mask_dtype"])
    plan = random_plan(gen, case["rows"], case["dp_size"])
    meta = global_meta(mask, case["meta_as_tensor"])
    return gen, mask, plan, meta


def randn(gen, *shape, scale=1.0, dtype=DTYPE):
    # drawn in float64 and rounded, so a case's float32 values are its float64 values rounded
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def sliced(tensor, rows, width):
    return tensor[rows][:, :width]


# -------------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_agg_loss_split_invariance(mode, case):
    gen, mask, plan, meta = setup_case(case)
    theta = randn(gen, case["rows"], case["width"], dtype=case["dtype"])
    target = randn(gen, case["rows"], case["width"], dtype=case["dtype"])

    def loss_fn(leaf, rows, width, dp_size, meta):
        # Nonlinear in the parameter so the gradient depends on each element's value.
        loss_mat = (sliced(leaf, rows, width) - sliced(target, rows, width)) ** 2 + sliced(leaf, rows, width)
        return agg_loss(loss_mat, sliced(mask, rows, width), mode, dp_size=dp_size, **meta), {}

    whole_meta = {"loss_scale_factor": LOSS_SCALE_FACTOR}
    result = check_split_invariance(
        lambda leaf, rows, width, dp, m: loss_fn(leaf, rows, width, dp, m or whole_meta),
        theta, mask, plan, case["dp_size"], meta, case["trim"],
    )
    assert_invariant(result)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits(), clips=clip_ranges())
def test_value_loss_split_invariance(mode, case, clips):
    gen, mask, plan, meta = setup_case(case)
    shape, dtype = (case["rows"], case["width"]), case["dtype"]
    vpreds = randn(gen, *shape, dtype=dtype)
    old_values = vpreds + randn(gen, *shape, scale=0.3, dtype=dtype)  # some beyond the clip range, some inside
    returns = randn(gen, *shape, dtype=dtype)

    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        vf_loss, vf_clipfrac = compute_value_loss(
            sliced(leaf, rows, width),
            sliced(returns, rows, width),
            sliced(old_values, rows, width),
            sliced(mask, rows, width),
            cliprange_value=clips["cliprange_value"],
            loss_agg_mode=mode,
            dp_size=dp_size,
            **meta,
        )
        return vf_loss, {"vf_clipfrac": vf_clipfrac}

    assert_invariant(
        check_split_invariance(loss_fn, vpreds, mask, plan, case["dp_size"], meta, case["trim"])
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_entropy_loss_split_invariance(mode, case):
    gen, mask, plan, meta = setup_case(case)
    vocab = 5
    logits = randn(gen, case["rows"], case["width"], vocab, scale=2.0, dtype=case["dtype"])

    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        entropy = entropy_from_logits(leaf[rows][:, :width])
        micro_mask = sliced(mask, rows, width)
        loss = compute_entropy_loss(entropy, micro_mask, mode, dp_size=dp_size, **meta)
        return loss, {"entropy": masked_mean(entropy, micro_mask).detach()}

    assert_invariant(
        check_split_invariance(loss_fn, logits, mask, plan, case["dp_size"], meta, case["trim"])
    )


def policy_loss_case(gen, rows, width, dtype=DTYPE):
    log_prob = randn(gen, rows, width, scale=0.5, dtype=dtype) - 1.0
    # Wide log-ratios: many tokens outside [1-eps, 1+eps] and some beyond the dual-clip bound.
    old_log_prob = log_prob + randn(gen, rows, width, scale=0.8, dtype=dtype)
    advantages = randn(gen, rows, width, scale=1.5, dtype=dtype)
    return log_prob, old_log_prob, advantages


DEFAULT_CLIPS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def policy_loss_fn_for(fn, mode, old_log_prob, advantages, mask, clips=DEFAULT_CLIPS):
    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = fn(
            sliced(old_log_prob, rows, width),
            sliced(leaf, rows, width),
            sliced(advantages, rows, width),
            sliced(mask, rows, width),
            mode,
            clip_ratio_low=clips["clip_ratio_low"],
            clip_ratio_high=clips["clip_ratio_high"],
            clip_ratio_c=clips["clip_ratio_c"],
            dp_size=dp_size,
            **meta,
        )
        stats = {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}
        return pg_loss, stats

    return loss_fn


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits(), clips=clip_ranges())
def test_every_registered_policy_loss_split_invariance(name, mode, case, clips):
    gen, mask, plan, meta = setup_case(case)
    log_prob, old_log_prob, advantages = policy_loss_case(gen, case["rows"], case["width"], case["dtype"])
    loss_fn = policy_loss_fn_for(POLICY_LOSSES[name], mode, old_log_prob, advantages, mask, clips)
    assert_invariant(
        check_split_invariance(loss_fn, log_prob, mask, plan, case["dp_size"], meta, case["trim"])
    )


@pytest.mark.parametrize("kl_type", KL_PENALTY_MODES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@KL_HYPOTHESIS
@given(case=splits())
def test_kl_loss_split_invariance(mode, kl_type, case):
    """The KL-in-loss term: agg_loss(kl_penalty(log_prob, ref_log_prob, type)) for every estimator."""
    gen, mask, plan, meta = setup_case(case)
    shape, dtype = (case["rows"], case["width"]), case["dtype"]
    log_prob = randn(gen, *shape, scale=0.5, dtype=dtype) - 1.0
    # both signs, and some ref - log_prob > 2.53, where k3 = e^x - x - 1 passes its clamp at 10
    ref_log_prob = log_prob + randn(gen, *shape, scale=1.5, dtype=dtype)

    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        kl = kl_penalty(sliced(leaf, rows, width), sliced(ref_log_prob, rows, width), kl_type)
        micro_mask = sliced(mask, rows, width)
        kl_loss = agg_loss(kl, micro_mask, mode, dp_size=dp_size, **meta)
        return kl_loss, {"kl": masked_mean(kl, micro_mask).detach()}

    assert_invariant(
        check_split_invariance(loss_fn, log_prob, mask, plan, case["dp_size"], meta, case["trim"])
    )


def test_loss_metric_rule_through_rlflow_metrics():
    """The driver's reduction (rlflow.metrics) recovers the whole-batch loss and statistics."""
    gen = torch.Generator().manual_seed(3)
    rows, width, dp_size = 9, 6, 3
    mask = random_mask(gen, rows, width, holes=True)
    plan = random_plan(gen, rows, dp_size)
    meta = global_meta(mask, as_tensor=True)
    log_prob, old_log_prob, advantages = policy_loss_case(gen, rows, width)
    fn = POLICY_LOSSES["vanilla"]

    whole = fn(old_log_prob, log_prob, advantages, mask, "token-mean")
    records = []
    for shard in plan:
        for rows_idx in shard:
            micro_mask = mask[rows_idx]
            pg_loss, pg_clipfrac, ppo_kl, _ = fn(
                old_log_prob[rows_idx], log_prob[rows_idx], advantages[rows_idx], micro_mask,
                "token-mean", dp_size=dp_size, **meta,
            )
            local_tokens = float(micro_mask.sum())
            records.append({
                "actor/pg_loss": metrics.loss_metric(float(pg_loss), dp_size, has_global_meta=True),
                "actor/pg_clipfrac": metrics.token_mean_metric(float(pg_clipfrac), local_tokens),
                "actor/ppo_kl": metrics.token_mean_metric(float(ppo_kl), local_tokens),
            })
    reduced = metrics.reduce_metrics(records)
    assert reduced["actor/pg_loss"] == pytest.approx(float(whole[0]), rel=RTOL)
    assert reduced["actor/pg_clipfrac"] == pytest.approx(float(whole[1]), rel=RTOL, abs=ATOL)
    assert reduced["actor/ppo_kl"] == pytest.approx(float(whole[2]), rel=RTOL, abs=ATOL)


# ---------------------------------------------------------------------- negative controls


def uneven_example():
    """Two rows of lengths 1 and 3, one micro-batch each, dp 1."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=DTYPE)
    theta = torch.tensor([[0.5, 9.0, 9.0, 9.0], [1.0, -2.0, 3.0, 9.0]], dtype=DTYPE)
    plan = [[torch.tensor([0]), torch.tensor([1])]]
    return mask, theta, plan


def test_negative_control_token_mean_without_metadata_depends_on_split():
    mask, theta, plan = uneven_example()

    def loss_fn(leaf, rows, width, dp_size, meta):
        # No metadata at all: each micro-batch normalises by its own token count.
        return agg_loss(leaf[rows] ** 2, mask[rows], "token-mean"), {}

    result = check_split_invariance(loss_fn, theta, mask, plan, 1, {}, trim=False)
    # Whole: d/dθ (Σ θ²)/4 = θ/2 on valid tokens. Per micro-batch: row 0 gets 2θ/1, row 1 2θ/3.
    expected_whole = torch.tensor([[0.25, 0, 0, 0], [0.5, -1.0, 1.5, 0]], dtype=DTYPE)
    expected_accumulated = torch.tensor([[1.0, 0, 0, 0], [2 / 3, -4 / 3, 2.0, 0]], dtype=DTYPE)
    torch.testing.assert_close(result["whole_grad"], expected_whole)
    torch.testing.assert_close(result["allreduced_grad"], expected_accumulated)
    assert (result["allreduced_grad"] - result["whole_grad"]).abs().max() > 0.5
    with pytest.raises(AssertionError):
        assert_invariant(result)

    # The same split with the mini-batch metadata is invariant: the harness can also pass.
    def loss_fn_meta(leaf, rows, width, dp_size, meta):
        return agg_loss(leaf[rows] ** 2, mask[rows], "token-mean", dp_size=dp_size, **meta), {}

    assert_invariant(
        check_split_invariance(loss_fn_meta, theta, mask, plan, 1, global_meta(mask, True), False)
    )


def test_negative_control_padded_width_as_scale_factor_depends_on_split():
    """verl's default loss_scale_factor (the padded width) breaks invariance once micro-batches
    are unpadded to their own width; a constant does not."""
    mask, theta, plan = uneven_example()
    meta = global_meta(mask, True)

    def loss_fn(leaf, rows, width, dp_size, m):
        micro_mask = mask[rows][:, :width]
        m = {**m, "loss_scale_factor": micro_mask.shape[-1]} if m else {"loss_scale_factor": 4}
        return agg_loss(leaf[rows][:, :width] ** 2, micro_mask, "seq-mean-token-sum-norm", dp_size=dp_size, **m), {}

    result = check_split_invariance(loss_fn, theta, mask, plan, 1, meta, trim=True)
    assert (result["allreduced_grad"] - result["whole_grad"]).abs().max() > 0.1


def test_negative_control_loss_that_bypasses_agg_loss_is_caught():
    """A policy loss that averages sequence losses itself (like verl's geo_mean, PR #5614) is
    K times off with K micro-batches; the harness used over the registry detects it."""

    def bypassing_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", **kw):
        seq_loss = -masked_mean(advantages * torch.exp(log_prob - old_log_prob), response_mask, axis=-1)
        zero = torch.zeros((), dtype=log_prob.dtype)
        return seq_loss.mean(), zero, zero, zero  # ignores dp_size and the global counts

    gen = torch.Generator().manual_seed(0)
    rows, width = 6, 5
    mask = torch.ones(rows, width, dtype=DTYPE)
    plan = [[torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]]
    log_prob, old_log_prob, advantages = policy_loss_case(gen, rows, width)
    loss_fn = policy_loss_fn_for(bypassing_loss, "seq-mean-token-mean", old_log_prob, advantages, mask)
    result = check_split_invariance(loss_fn, log_prob, mask, plan, 1, global_meta(mask, True), False)
    torch.testing.assert_close(result["allreduced_grad"], 3 * result["whole_grad"])  # K = 3
    with pytest.raises(AssertionError):
        assert_invariant(result)
