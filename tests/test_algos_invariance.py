"""The normalisation contract: losses, gradients and metrics do not depend on the split.

A mini-batch is cut into dp shards (random sizes, random row order) and each shard into
micro-batches (random sizes, each optionally trimmed to its own last valid column, as unpadding
does). Every rank sums the gradients of its micro-batch losses (backward per micro-batch); the
"all-reduce" is the MEAN over ranks, as DDP/FSDP take it. With the whole mini-batch's metadata
passed to every micro-batch, that gradient must equal the gradient of the whole mini-batch in one
piece with dp_size=1. The policy-loss test iterates the registry, so a newly registered loss is
covered automatically.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
    masked_mean,
)

DTYPE = torch.float64
RTOL, ATOL = 1e-9, 1e-12
LOSS_SCALE_FACTOR = 7.0  # a configured constant, deliberately not any padded width
HYPOTHESIS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------ the harness


def random_mask(gen: torch.Generator, rows: int, width: int, holes: bool) -> torch.Tensor:
    """Right-padded variable lengths (0..width, so fully masked and full rows both occur),
    optionally with holes inside the valid span (e.g. masked tool output)."""
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    # Make very uneven lengths likely: one row empty, one row full (when there are enough rows).
    if rows >= 3:
        lengths[0], lengths[1] = 0, width
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(DTYPE)
    if holes:
        mask = mask * (torch.rand(rows, width, generator=gen) > 0.3).to(DTYPE)
    return mask


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
    batch_num_tokens = mask.sum()
    global_batch_size = (mask.sum(-1) > 0).sum()
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

    rank_grads, loss_metric_sum = [], 0.0
    stat_weighted_sums: dict[str, float] = {name: 0.0 for name in whole_stats}
    for shard in plan:
        rank_leaf = leaf_init.clone().requires_grad_(True)  # each rank has its own .grad
        for rows in shard:
            width = micro_width(mask, rows, trim)
            micro_loss, micro_stats = loss_fn(rank_leaf, rows, width, dp_size, meta)
            micro_loss.backward()
            loss_metric_sum += float(micro_loss.detach()) / dp_size
            local_tokens = float(mask[rows][:, :width].sum())
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
        total_tokens=float(mask.sum()),
    )


def assert_invariant(result):
    assert torch.isfinite(result["whole_grad"]).all()
    torch.testing.assert_close(result["allreduced_grad"], result["whole_grad"], rtol=RTOL, atol=ATOL)
    assert result["loss_metric_sum"] == pytest.approx(result["whole_loss"], rel=RTOL, abs=ATOL)
    if result["total_tokens"] > 0:
        for name, whole_value in result["whole_stats"].items():
            weighted_mean = result["stat_weighted_sums"][name] / result["total_tokens"]
            assert weighted_mean == pytest.approx(whole_value, rel=RTOL, abs=ATOL), name


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
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def setup_case(case):
    gen = torch.Generator().manual_seed(case["seed"])
    mask = random_mask(gen, case["rows"], case["width"], case["holes"])
    plan = random_plan(gen, case["rows"], case["dp_size"])
    meta = global_meta(mask, case["meta_as_tensor"])
    return gen, mask, plan, meta


def randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=DTYPE) * scale


def sliced(tensor, rows, width):
    return tensor[rows][:, :width]


# -------------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_agg_loss_split_invariance(mode, case):
    gen, mask, plan, meta = setup_case(case)
    theta = randn(gen, case["rows"], case["width"])
    target = randn(gen, case["rows"], case["width"])

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
@given(case=splits())
def test_value_loss_split_invariance(mode, case):
    gen, mask, plan, meta = setup_case(case)
    shape = (case["rows"], case["width"])
    vpreds = randn(gen, *shape)
    old_values = vpreds + randn(gen, *shape, scale=0.3)  # some beyond the clip range, some inside
    returns = randn(gen, *shape)

    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        vf_loss, vf_clipfrac = compute_value_loss(
            sliced(leaf, rows, width),
            sliced(returns, rows, width),
            sliced(old_values, rows, width),
            sliced(mask, rows, width),
            cliprange_value=0.2,
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
    logits = randn(gen, case["rows"], case["width"], vocab, scale=2.0)

    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        entropy = entropy_from_logits(leaf[rows][:, :width])
        micro_mask = sliced(mask, rows, width)
        loss = compute_entropy_loss(entropy, micro_mask, mode, dp_size=dp_size, **meta)
        return loss, {"entropy": masked_mean(entropy, micro_mask).detach()}

    assert_invariant(
        check_split_invariance(loss_fn, logits, mask, plan, case["dp_size"], meta, case["trim"])
    )


def policy_loss_case(gen, rows, width):
    log_prob = randn(gen, rows, width, scale=0.5) - 1.0
    # Wide log-ratios: many tokens outside [1-eps, 1+eps] and some beyond the dual-clip bound 3.
    old_log_prob = log_prob + randn(gen, rows, width, scale=0.8)
    advantages = randn(gen, rows, width, scale=1.5)
    return log_prob, old_log_prob, advantages


def policy_loss_fn_for(fn, mode, old_log_prob, advantages, mask):
    def loss_fn(leaf, rows, width, dp_size, meta):
        meta = meta or {"loss_scale_factor": LOSS_SCALE_FACTOR}
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = fn(
            sliced(old_log_prob, rows, width),
            sliced(leaf, rows, width),
            sliced(advantages, rows, width),
            sliced(mask, rows, width),
            mode,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            dp_size=dp_size,
            **meta,
        )
        stats = {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}
        return pg_loss, stats

    return loss_fn


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_every_registered_policy_loss_split_invariance(name, mode, case):
    gen, mask, plan, meta = setup_case(case)
    log_prob, old_log_prob, advantages = policy_loss_case(gen, case["rows"], case["width"])
    loss_fn = policy_loss_fn_for(POLICY_LOSSES[name], mode, old_log_prob, advantages, mask)
    assert_invariant(
        check_split_invariance(loss_fn, log_prob, mask, plan, case["dp_size"], meta, case["trim"])
    )


def test_loss_metric_rule_through_rlflow_metrics():
    """The driver's reduction (rlflow.metrics) recovers the whole-batch loss and statistics."""
    metrics = pytest.importorskip("rlflow.metrics")
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
