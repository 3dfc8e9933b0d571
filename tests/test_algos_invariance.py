"""The normalisation contract: losses, gradients and metrics do not depend on the split.

A mini-batch is cut into dp shards (random sizes, random row order) and each shard into
micro-batches (random sizes, each optionally trimmed to its own last valid column, as unpadding
does). Every rank sums the gradients of its micro-batch losses (backward per micro-batch); the
"all-reduce" is the MEAN over ranks, as DDP/FSDP take it. With the whole mini-batch's BatchMeta
passed to every micro-batch, that gradient must equal the gradient of the whole mini-batch in one
piece (no metadata, dp_size=1), and the metrics the micro-batches report, reduced by
rlflow.metrics by their declared aggregations, must equal the whole mini-batch's.

The term test iterates the registry of loss terms (every policy loss and the value, entropy and KL
terms, rlflow.algos.registered_terms), draws every option of each term's options dataclass, and
differentiates with respect to every float input the term declares (its optional inputs, such as
the policy losses' rollout_is_weights, drawn in or out); so a newly registered term or option is
covered automatically (or fails until this file can draw it). The rollout-correction test iterates
that registry too (rlflow.algos.ROLLOUT_CORRECTIONS): each mode's weights and the mismatch metrics,
computed per micro-batch, feed every policy loss. Hypothesis also draws
the values' dtype (float64, float32) and the mask's dtype (float64, float32, long, bool).
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
    LOSS_TERMS,
    POLICY_LOSSES,
    ROLLOUT_IS_WEIGHTS,
    EntropyBonusOptions,
    LossOptions,
    RolloutCorrectionOptions,
    agg_loss,
    compose_loss,
    compute_rollout_correction,
    correction_modes,
    entropy_bonus_term,
    entropy_from_logits,
    masked_mean,
    masked_mean_metric,
    option_names,
    registered_terms,
)
from rlflow.algos.terms import LossTerm
from rlflow.protocol import BatchMeta

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
TOP_K = 3  # the teacher's tokens per position of the top-k distillation term
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


def global_meta(mask: torch.Tensor, dp_size: int, as_tensor: bool) -> BatchMeta:
    """The driver's BatchMeta (from a mask of any dtype: float, long or bool)."""
    valid = mask != 0
    batch_num_tokens = valid.sum()
    global_batch_size = valid.any(-1).sum()
    assert int(batch_num_tokens) == int(mask.to(torch.float64).sum())  # 0/1 masks: the same count
    if not as_tensor:  # BatchMeta may carry Python numbers or tensors; both must work
        batch_num_tokens, global_batch_size = int(batch_num_tokens), int(global_batch_size)
    return BatchMeta(dp_size, batch_num_tokens, global_batch_size, LOSS_SCALE_FACTOR)


def agg_kwargs(meta: BatchMeta | None) -> dict:
    """agg_loss's keywords of a loss written against agg_loss directly (not a term)."""
    return meta.loss_kwargs() if meta is not None else {"dp_size": 1, "loss_scale_factor": LOSS_SCALE_FACTOR}


def micro_width(mask: torch.Tensor, rows: torch.Tensor, trim: bool) -> int:
    """Trimmed width: up to the micro-batch's last valid column (1 if it has none)."""
    if not trim:
        return mask.shape[1]
    valid_cols = (mask[rows] != 0).any(0).nonzero()
    return int(valid_cols.max()) + 1 if valid_cols.numel() else 1


def check_split_invariance(loss_fn, leaf_init, mask, plan, meta, trim):
    """loss_fn(leaf, rows, width, meta) -> (loss, {name: rlflow.metrics.Metric}); the whole
    mini-batch runs with meta None (its own counts are the whole's), each micro-batch with `meta`.

    Returns the pieces for assert_invariant and for negative controls to inspect.
    """
    leaf = leaf_init.clone().requires_grad_(True)
    whole_loss, whole_metrics = loss_fn(leaf, torch.arange(mask.shape[0]), mask.shape[1], None)
    whole_loss.backward()
    whole_grad = leaf.grad.clone()

    rank_grads, loss_sum, micro_loss_dtypes, records = [], 0.0, set(), []
    for shard in plan:
        rank_leaf = leaf_init.clone().requires_grad_(True)  # each rank has its own .grad
        for rows in shard:
            micro_loss, micro_metrics = loss_fn(rank_leaf, rows, micro_width(mask, rows, trim), meta)
            micro_loss.backward()
            micro_loss_dtypes.add(micro_loss.dtype)
            loss_sum += float(micro_loss.detach()) / meta.dp_size
            for name, metric in micro_metrics.items():
                assert math.isfinite(metric.value), f"{name} is not finite on a micro-batch"
            records.append(micro_metrics)
        rank_grads.append(rank_leaf.grad)
    allreduced_grad = torch.stack(rank_grads).mean(0)  # DDP/FSDP average over ranks

    return dict(
        whole_loss=float(whole_loss.detach()),
        whole_grad=whole_grad,
        whole_metrics=whole_metrics,
        loss_sum=loss_sum,
        allreduced_grad=allreduced_grad,
        micro_records=records,
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
    assert result["loss_sum"] == pytest.approx(result["whole_loss"], rel=rtol, abs=loss_atol)

    whole = metrics.reduce_metrics([result["whole_metrics"]])
    reduced = metrics.reduce_metrics(result["micro_records"])  # raises on mixed aggregations
    assert reduced.keys() == whole.keys()
    for name, metric in result["whole_metrics"].items():
        split_kinds = {record[name].aggregation for record in result["micro_records"]}
        if split_kinds == {metrics.Aggregation.SUM}:  # a loss value under metadata (the #6957 rule)
            assert metric.aggregation is metrics.Aggregation.MEAN, name  # without metadata: MEAN
            assert reduced[name] == pytest.approx(whole[name], rel=rtol, abs=loss_atol), name
        else:
            assert split_kinds == {metric.aggregation}, name
            assert reduced[name] == pytest.approx(whole[name], rel=rtol, abs=atol), name


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


def setup_case(case):
    """The mask is drawn as 0/1 floats, then given to the losses in the drawn mask dtype; the
    values are drawn (randn below) in the drawn value dtype."""
    gen = torch.Generator().manual_seed(case["seed"])
    mask = random_mask(gen, case["rows"], case["width"], case["holes"]).to(case["mask_dtype"])
    plan = random_plan(gen, case["rows"], case["dp_size"])
    meta = global_meta(mask, case["dp_size"], case["meta_as_tensor"])
    return gen, mask, plan, meta


def randn(gen, *shape, scale=1.0, dtype=DTYPE):
    # drawn in float64 and rounded, so a case's float32 values are its float64 values rounded
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def sliced(tensor, rows, width):
    return tensor[rows][:, :width]


# ---------------------------------------------------------------- inputs and options of a term

# Every option of every registered term's options dataclass, drawn over its meaningful range.
OPTION_STRATEGIES = {
    "clip_ratio_low": st.floats(0.05, 0.5),
    "clip_ratio_high": st.floats(0.05, 0.5),
    "clip_ratio_c": st.floats(1.5, 5.0),
    # cispo's IS-weight clip: 1 (no lower bound, its default) included; the log-ratios drawn below
    # reach beyond both bounds
    "epsilon_low": st.floats(0.05, 1.0),
    "epsilon_high": st.floats(0.05, 2.0),
    # sapo's gate temperatures: gentle (0.5) to steep (5: the gate saturates within the drawn ratios)
    "tau_pos": st.floats(0.5, 5.0),
    "tau_neg": st.floats(0.5, 5.0),
    # dppo's trust region on the token probability's change (tv) or its binary KL: the drawn
    # log-probs (about -1 +- 0.5, old ones 0.8 further) put tokens on both sides of it
    "delta_low": st.floats(0.01, 0.5),
    "delta_high": st.floats(0.01, 0.5),
    "cliprange_value": st.floats(0.05, 0.5),
    "entropy_coeff": st.floats(-1.0, 1.0).filter(lambda c: abs(c) > 1e-3),
    "kl_loss_coef": st.floats(0.001, 1.0),
    "kl_loss_type": st.sampled_from(KL_PENALTY_MODES),
    # the distillation term's (actor.distill): its weight and its per-token estimator
    "coef": st.floats(0.001, 2.0),
    "kl_type": st.sampled_from(KL_PENALTY_MODES),
}


def term_options(options_cls, mode: str, draw) -> LossOptions:
    values = {}
    for name in option_names(options_cls):
        assert name in OPTION_STRATEGIES, f"option {name!r} of {options_cls.__name__}: add a strategy to OPTION_STRATEGIES"
        values[name] = draw(OPTION_STRATEGIES[name])
    return options_cls(loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE_FACTOR, **values)


def term_inputs(gen, keys, rows, width, dtype, outcome_advantages: bool) -> dict[str, torch.Tensor]:
    """Random values of every batch key a term reads (but the mask). Wide log-ratios: many tokens
    outside any clip range, some beyond the dual-clip bound; ref gaps past k3's clamp; old values
    some beyond the value clip, some inside."""
    shape = (rows, width)
    log_probs = randn(gen, *shape, scale=0.5, dtype=dtype) - 1.0
    top_k = (rows, width, TOP_K)
    vpreds = randn(gen, *shape, dtype=dtype)
    advantages = randn(gen, *shape, scale=1.5, dtype=dtype)
    if outcome_advantages:  # one advantage per response (GRPO-like)
        advantages = advantages[:, :1].expand(shape).clone()
    makers = {
        "log_probs": lambda: log_probs,
        "old_log_probs": lambda: log_probs + randn(gen, *shape, scale=0.8, dtype=dtype),
        "ref_log_prob": lambda: log_probs + randn(gen, *shape, scale=1.5, dtype=dtype),
        # the teacher's: gaps of both signs, some past k3's clamp, as the reference's
        "teacher_log_prob": lambda: log_probs + randn(gen, *shape, scale=1.5, dtype=dtype),
        # the top-k forward KL's: the teacher's log-probs of its k tokens (renormalised by the term)
        # and the actor's of the same tokens, each < 0, the actor's mass on them below 1
        "teacher_topk_log_probs": lambda: randn(gen, *top_k, scale=1.5, dtype=dtype) - 2.0,
        "topk_log_probs": lambda: torch.log_softmax(randn(gen, rows, width, TOP_K + 3, scale=1.5, dtype=dtype),
                                                    dim=-1)[..., :TOP_K],
        "advantages": lambda: advantages,
        "entropy": lambda: randn(gen, *shape, dtype=dtype).abs() * 2,
        "vpreds": lambda: vpreds,
        "values": lambda: vpreds + randn(gen, *shape, scale=0.3, dtype=dtype),
        "returns": lambda: randn(gen, *shape, dtype=dtype),
        # the rollout correction's weights: >= 0, some exactly 0 (dropped tokens), some above 1
        ROLLOUT_IS_WEIGHTS: lambda: torch.where(randn(gen, *shape, dtype=dtype) > 0.8, torch.zeros(shape, dtype=dtype),
                                                torch.exp(randn(gen, *shape, scale=0.7, dtype=dtype))),
    }
    missing = [key for key in keys if key not in makers]
    assert not missing, f"a term reads batch keys {missing}: add their generators to term_inputs"
    return {key: makers[key]() for key in keys}


def term_loss_fn(term_fn, options, inputs: dict[str, torch.Tensor], mask):
    """A term as the harness's loss_fn; the leaf [rows, width, features] holds all the float inputs
    side by side on its last axis ([rows, width] ones as one feature, [rows, width, k] ones as k),
    so the gradient with respect to every one of them is checked."""
    keys = list(inputs)
    widths = [inputs[key].shape[2] if inputs[key].dim() == 3 else 1 for key in keys]
    starts = [sum(widths[:i]) for i in range(len(keys))]

    def loss_fn(leaf, rows, width, meta):
        micro = sliced(leaf, rows, width)
        batch = {key: micro[..., start : start + size] if inputs[key].dim() == 3 else micro[..., start]
                 for key, start, size in zip(keys, starts, widths, strict=True)}
        batch["response_mask"] = sliced(mask, rows, width)
        return term_fn(batch, meta, options)

    leaf = torch.cat([inputs[key] if inputs[key].dim() == 3 else inputs[key].unsqueeze(-1) for key in keys], dim=-1)
    return loss_fn, leaf


def test_every_option_of_every_term_can_be_drawn():
    for name, spec in registered_terms().items():
        for option in option_names(spec.options):
            assert option in OPTION_STRATEGIES, f"{name}: option {option!r} has no strategy here"


# -------------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_agg_loss_split_invariance(mode, case):
    gen, mask, plan, meta = setup_case(case)
    theta = randn(gen, case["rows"], case["width"], dtype=case["dtype"])
    target = randn(gen, case["rows"], case["width"], dtype=case["dtype"])

    def loss_fn(leaf, rows, width, meta):
        # Nonlinear in the parameter so the gradient depends on each element's value.
        loss_mat = (sliced(leaf, rows, width) - sliced(target, rows, width)) ** 2 + sliced(leaf, rows, width)
        return agg_loss(loss_mat, sliced(mask, rows, width), mode, **agg_kwargs(meta)), {}

    assert_invariant(check_split_invariance(loss_fn, theta, mask, plan, meta, case["trim"]))


@pytest.mark.parametrize("term_name", sorted(registered_terms()))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits(), outcome_advantages=st.booleans(), data=st.data())
def test_every_registered_term_split_invariance(term_name, mode, case, outcome_advantages, data):
    spec = registered_terms()[term_name]
    options = term_options(spec.options, mode, data.draw)
    gen, mask, plan, meta = setup_case(case)
    keys = [key for key in spec.inputs if key != "response_mask"]
    keys += [key for key in spec.optional_inputs if data.draw(st.booleans(), label=f"with {key}")]
    inputs = term_inputs(gen, keys, case["rows"], case["width"], case["dtype"], outcome_advantages)
    loss_fn, leaf_init = term_loss_fn(spec.fn, options, inputs, mask)
    assert_invariant(check_split_invariance(loss_fn, leaf_init, mask, plan, meta, case["trim"]))


@pytest.mark.parametrize("kl_type", KL_PENALTY_MODES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@KL_HYPOTHESIS
@given(case=splits())
def test_kl_loss_split_invariance(mode, kl_type, case):
    """The KL term with every estimator for sure (the term test draws the type at random)."""
    spec = LOSS_TERMS["kl_loss"]
    options = spec.options(loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE_FACTOR, kl_loss_type=kl_type, kl_loss_coef=0.3)
    gen, mask, plan, meta = setup_case(case)
    inputs = term_inputs(gen, ["log_probs", "ref_log_prob"], case["rows"], case["width"], case["dtype"], False)
    loss_fn, leaf_init = term_loss_fn(spec.fn, options, inputs, mask)
    assert_invariant(check_split_invariance(loss_fn, leaf_init, mask, plan, meta, case["trim"]))


@pytest.mark.parametrize("kl_type", KL_PENALTY_MODES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@KL_HYPOTHESIS
@given(case=splits(), on_policy=st.booleans())
def test_distill_loss_split_invariance(mode, kl_type, case, on_policy):
    """The distillation term with every estimator for sure (the term test draws the type at
    random), on-policy too: old_log_probs the detached log_probs, as the actor's on-policy path
    passes them (the ratio 1 with gradient grad log pi)."""
    spec = LOSS_TERMS["distill_loss"]
    options = spec.options(loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE_FACTOR, kl_type=kl_type, coef=0.7)
    gen, mask, plan, meta = setup_case(case)
    inputs = term_inputs(gen, ["log_probs", "old_log_probs", "teacher_log_prob"], case["rows"], case["width"],
                         case["dtype"], False)
    if not on_policy:
        loss_fn, leaf_init = term_loss_fn(spec.fn, options, inputs, mask)
    else:
        keys = ["log_probs", "teacher_log_prob"]

        def loss_fn(leaf, rows, width, meta):
            batch = {key: sliced(leaf[i], rows, width) for i, key in enumerate(keys)}
            batch["old_log_probs"] = batch["log_probs"].detach()
            batch["response_mask"] = sliced(mask, rows, width)
            return spec.fn(batch, meta, options)

        leaf_init = torch.stack([inputs[key] for key in keys])
    result = check_split_invariance(loss_fn, leaf_init, mask, plan, meta, case["trim"])
    assert {"distill_loss", "distill_reverse_kl"} == result["whole_metrics"].keys()
    assert_invariant(result)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@HYPOTHESIS
@given(case=splits())
def test_entropy_from_logits_bonus_and_statistic_split_invariance(mode, case):
    """The actor's entropy path: entropy_from_logits, the bonus term, the entropy statistic."""
    gen, mask, plan, meta = setup_case(case)
    vocab = 5
    logits = randn(gen, case["rows"], case["width"], vocab, scale=2.0, dtype=case["dtype"])
    options = EntropyBonusOptions(loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE_FACTOR, entropy_coeff=0.7)

    def loss_fn(leaf, rows, width, meta):
        entropy = entropy_from_logits(leaf[rows][:, :width])
        micro_mask = sliced(mask, rows, width)
        loss, term_metrics = entropy_bonus_term({"entropy": entropy, "response_mask": micro_mask}, meta, options)
        return loss, {**term_metrics, "entropy": masked_mean_metric(entropy, micro_mask)}

    assert_invariant(check_split_invariance(loss_fn, logits, mask, plan, meta, case["trim"]))


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@HYPOTHESIS
@given(case=splits(), data=st.data())
def test_composed_actor_loss_split_invariance(policy_loss, case, data):
    """The actor's sum of terms (compose_loss), with its prefixed metrics."""
    mode = data.draw(st.sampled_from(LOSS_AGG_MODES))
    terms = [LossTerm("policy_loss", POLICY_LOSSES[policy_loss],
                      term_options(POLICY_LOSSES[policy_loss].options, mode, data.draw))]
    distill = data.draw(st.sampled_from(["distill_loss", "distill_topk_loss"]), label="distillation term")
    terms += [LossTerm(name, LOSS_TERMS[name], term_options(LOSS_TERMS[name].options, mode, data.draw))
              for name in ("entropy_bonus", "kl_loss", distill)]
    gen, mask, plan, meta = setup_case(case)
    keys = sorted({key for term in terms for key in term.spec.inputs} - {"response_mask"})
    inputs = term_inputs(gen, keys, case["rows"], case["width"], case["dtype"], False)

    def composed(batch, meta, _options):
        return compose_loss(terms, batch, meta, prefix="actor/")

    loss_fn, leaf_init = term_loss_fn(composed, None, inputs, mask)
    result = check_split_invariance(loss_fn, leaf_init, mask, plan, meta, case["trim"])
    distill_statistic = "actor/distill_reverse_kl" if distill == "distill_loss" else "actor/distill_forward_kl"
    assert {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/distill_loss",
            distill_statistic} <= result["whole_metrics"].keys()
    assert_invariant(result)


# Every option of the rollout correction, drawn over its valid range (low <= 1 <= high, cap >= 1).
CORRECTION_OPTION_STRATEGIES = {
    "cap": st.floats(1.0, 3.0),
    "low": st.floats(0.0, 0.95),
    "high": st.floats(1.05, 3.0),
}


def test_every_option_of_the_rollout_correction_can_be_drawn():
    import dataclasses

    for field in dataclasses.fields(RolloutCorrectionOptions):
        assert field.name == "mode" or field.name in CORRECTION_OPTION_STRATEGIES, field.name


@pytest.mark.parametrize("correction", correction_modes())
@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@HYPOTHESIS
@given(case=splits(), data=st.data())
def test_rollout_correction_split_invariance(correction, policy_loss, case, data):
    """Each correction mode (the registry, and none: the mismatch metrics alone) computed on every
    micro-batch from its slice of old_log_probs / rollout_log_probs, its weights fed to the policy
    loss: the gradient, the loss, and every metric (the MAX of |old - rollout| included) equal the
    whole mini-batch's. Dropped tokens keep their counts: the same BatchMeta serves every split."""
    mode = data.draw(st.sampled_from(LOSS_AGG_MODES))
    spec = POLICY_LOSSES[policy_loss]
    loss_options = term_options(spec.options, mode, data.draw)
    correction_options = RolloutCorrectionOptions(
        mode=correction, **{name: data.draw(strategy) for name, strategy in CORRECTION_OPTION_STRATEGIES.items()})
    gen, mask, plan, meta = setup_case(case)
    inputs = term_inputs(gen, ["log_probs", "old_log_probs", "advantages"], case["rows"], case["width"], case["dtype"], False)
    # the behaviour policy: a token-level mismatch wide enough to cross the cap and the band, and
    # some tokens exactly on-policy (ratio 1)
    noise = randn(gen, case["rows"], case["width"], scale=0.4, dtype=case["dtype"])
    noise = torch.where(randn(gen, case["rows"], case["width"], dtype=case["dtype"]) > 0.5, torch.zeros_like(noise), noise)
    inputs["rollout_log_probs"] = inputs["old_log_probs"] - noise
    keys = list(inputs)

    def loss_fn(leaf, rows, width, meta):
        batch = {key: sliced(leaf[i], rows, width) for i, key in enumerate(keys)}
        batch["response_mask"] = sliced(mask, rows, width)
        weights, correction_metrics = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], correction_options)
        assert (weights is None) == (correction == "none")
        if weights is not None:
            assert not weights.requires_grad  # detached: the weights are data, not a path of the gradient
            batch[ROLLOUT_IS_WEIGHTS] = weights
        loss, policy = spec.fn(batch, meta, loss_options)
        return loss, {**policy, **correction_metrics}

    result = check_split_invariance(loss_fn, torch.stack([inputs[key] for key in keys]), mask, plan, meta, case["trim"])
    names = set(result["whole_metrics"])
    assert {"rollout_corr/log_ratio_mean", "rollout_corr/k3_kl", "rollout_corr/abs_diff_max",
            "rollout_corr/out_of_band_frac"} <= names
    assert ("rollout_corr/dropped_frac" in names) == (correction != "none")
    assert result["whole_metrics"]["rollout_corr/abs_diff_max"].aggregation is metrics.Aggregation.MAX
    assert_invariant(result)


def test_loss_metric_rule_through_rlflow_metrics():
    """The driver's reduction (rlflow.metrics) recovers the whole-batch loss and statistics."""
    gen = torch.Generator().manual_seed(3)
    rows, width, dp_size = 9, 6, 3
    mask = random_mask(gen, rows, width, holes=True)
    plan = random_plan(gen, rows, dp_size)
    meta = global_meta(mask, dp_size, as_tensor=True)
    spec = POLICY_LOSSES["vanilla"]
    options = spec.options(loss_agg_mode="token-mean")
    inputs = term_inputs(gen, ["log_probs", "old_log_probs", "advantages"], rows, width, DTYPE, False)

    whole_loss, whole = spec.fn({**inputs, "response_mask": mask}, None, options)
    records = []
    for shard in plan:
        for rows_idx in shard:
            micro = {key: value[rows_idx] for key, value in inputs.items()}
            records.append(spec.fn({**micro, "response_mask": mask[rows_idx]}, meta, options)[1])
            assert records[-1]["pg_clipfrac"].weight == float(mask[rows_idx].sum())  # the local token count
    reduced = metrics.reduce_metrics(records)
    assert reduced["pg_loss"] == pytest.approx(float(whole_loss), rel=RTOL)
    assert reduced["pg_clipfrac"] == pytest.approx(whole["pg_clipfrac"].value, rel=RTOL, abs=ATOL)
    assert reduced["ppo_kl"] == pytest.approx(whole["ppo_kl"].value, rel=RTOL, abs=ATOL)


# ---------------------------------------------------------------------- negative controls


def uneven_example():
    """Two rows of lengths 1 and 3, one micro-batch each, dp 1."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=DTYPE)
    theta = torch.tensor([[0.5, 9.0, 9.0, 9.0], [1.0, -2.0, 3.0, 9.0]], dtype=DTYPE)
    plan = [[torch.tensor([0]), torch.tensor([1])]]
    return mask, theta, plan


def test_negative_control_token_mean_without_metadata_depends_on_split():
    mask, theta, plan = uneven_example()

    def loss_fn(leaf, rows, width, meta):
        # No metadata at all: each micro-batch normalises by its own token count.
        return agg_loss(leaf[rows] ** 2, mask[rows], "token-mean"), {}

    result = check_split_invariance(loss_fn, theta, mask, plan, global_meta(mask, 1, True), trim=False)
    # Whole: d/dθ (Σ θ²)/4 = θ/2 on valid tokens. Per micro-batch: row 0 gets 2θ/1, row 1 2θ/3.
    expected_whole = torch.tensor([[0.25, 0, 0, 0], [0.5, -1.0, 1.5, 0]], dtype=DTYPE)
    expected_accumulated = torch.tensor([[1.0, 0, 0, 0], [2 / 3, -4 / 3, 2.0, 0]], dtype=DTYPE)
    torch.testing.assert_close(result["whole_grad"], expected_whole)
    torch.testing.assert_close(result["allreduced_grad"], expected_accumulated)
    assert (result["allreduced_grad"] - result["whole_grad"]).abs().max() > 0.5
    with pytest.raises(AssertionError):
        assert_invariant(result)

    # The same split with the mini-batch metadata is invariant: the harness can also pass.
    def loss_fn_meta(leaf, rows, width, meta):
        return agg_loss(leaf[rows] ** 2, mask[rows], "token-mean", **agg_kwargs(meta)), {}

    assert_invariant(check_split_invariance(loss_fn_meta, theta, mask, plan, global_meta(mask, 1, True), False))


def test_negative_control_padded_width_as_scale_factor_depends_on_split():
    """verl's default loss_scale_factor (the padded width) breaks invariance once micro-batches
    are unpadded to their own width; a constant does not."""
    mask, theta, plan = uneven_example()

    def loss_fn(leaf, rows, width, meta):
        micro_mask = mask[rows][:, :width]
        kwargs = {**agg_kwargs(meta), "loss_scale_factor": micro_mask.shape[-1] if meta else 4}
        return agg_loss(leaf[rows][:, :width] ** 2, micro_mask, "seq-mean-token-sum-norm", **kwargs), {}

    result = check_split_invariance(loss_fn, theta, mask, plan, global_meta(mask, 1, True), trim=True)
    assert (result["allreduced_grad"] - result["whole_grad"]).abs().max() > 0.1


def test_negative_control_loss_that_bypasses_agg_loss_is_caught():
    """A policy loss that averages sequence losses itself (like verl's geo_mean, PR #5614) is
    K times off with K micro-batches; the harness used over the registry detects it."""

    def bypassing_loss(batch, meta, options):
        ratio = torch.exp(batch["log_probs"] - batch["old_log_probs"])
        seq_loss = -masked_mean(batch["advantages"] * ratio, batch["response_mask"], axis=-1)
        return seq_loss.mean(), {}  # ignores dp_size and the global counts

    gen = torch.Generator().manual_seed(0)
    rows, width = 6, 5
    mask = torch.ones(rows, width, dtype=DTYPE)
    plan = [[torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]]
    inputs = term_inputs(gen, ["log_probs", "old_log_probs", "advantages"], rows, width, DTYPE, False)
    loss_fn, leaf_init = term_loss_fn(bypassing_loss, LossOptions(loss_agg_mode="seq-mean-token-mean"), inputs, mask)
    result = check_split_invariance(loss_fn, leaf_init, mask, plan, global_meta(mask, 1, True), False)
    torch.testing.assert_close(result["allreduced_grad"], 3 * result["whole_grad"])  # K = 3
    with pytest.raises(AssertionError):
        assert_invariant(result)


def test_negative_control_metric_weighted_by_the_wrong_count_is_caught():
    """A token statistic weighted by sequences instead of tokens reduces to a different mean."""
    gen = torch.Generator().manual_seed(5)
    mask, plan = random_mask(gen, 8, 6, holes=True), [[torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6, 7])]]
    values = randn(gen, 8, 6)

    def loss_fn(leaf, rows, width, meta):
        micro_mask = mask[rows]
        stat = masked_mean_metric(leaf[rows], micro_mask)
        wrong = metrics.Metric(stat.value, stat.aggregation, weight=float(len(rows)))
        return agg_loss(leaf[rows], micro_mask, "token-mean", **agg_kwargs(meta)), {"stat": wrong}

    result = check_split_invariance(loss_fn, values, mask, plan, global_meta(mask, 1, False), False)
    with pytest.raises(AssertionError, match="stat"):
        assert_invariant(result)


def test_negative_control_weights_normalised_over_the_micro_batch_are_caught():
    """IS weights renormalised to mean 1 over the micro-batch (a per-batch normalisation some
    implementations offer) depend on which rows share a micro-batch; so does a largest-difference
    metric declared a MEAN. The rollout-correction harness detects both."""
    from rlflow.algos.masked import masked_mean
    from rlflow.algos.rollout_correction import rollout_is_weights

    gen = torch.Generator().manual_seed(8)
    rows, width = 6, 5
    mask = random_mask(gen, rows, width, holes=False)
    mask[0] = 1  # no empty row: every micro-batch below has tokens
    plan = [[torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5])]]
    inputs = term_inputs(gen, ["log_probs", "old_log_probs", "advantages"], rows, width, DTYPE, False)
    inputs["rollout_log_probs"] = inputs["old_log_probs"] - randn(gen, rows, width, scale=0.4)
    keys = list(inputs)
    spec = POLICY_LOSSES["reinforce"]
    options = spec.options(loss_agg_mode="token-mean")
    correction = RolloutCorrectionOptions(mode="token_tis", cap=3.0)

    def loss_fn(leaf, rows_idx, width, meta, normalise=False, max_as_mean=False):
        batch = {key: sliced(leaf[i], rows_idx, width) for i, key in enumerate(keys)}
        batch["response_mask"] = sliced(mask, rows_idx, width)
        weights, correction_metrics = compute_rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], correction)
        if normalise:
            weights = weights / masked_mean(weights, batch["response_mask"])
        if max_as_mean:
            biggest = correction_metrics["rollout_corr/abs_diff_max"]
            correction_metrics["rollout_corr/abs_diff_max"] = metrics.Metric(biggest.value, metrics.Aggregation.MEAN, 1.0)
        loss, policy = spec.fn({**batch, ROLLOUT_IS_WEIGHTS: weights}, meta, options)
        return loss, {**policy, **correction_metrics}

    meta = global_meta(mask, 1, as_tensor=True)
    leaf = torch.stack([inputs[key] for key in keys])
    assert_invariant(check_split_invariance(loss_fn, leaf, mask, plan, meta, False))  # the real one passes
    assert rollout_is_weights(inputs["old_log_probs"], inputs["rollout_log_probs"], mask, correction) is not None
    normalised = check_split_invariance(lambda *a: loss_fn(*a, normalise=True), leaf, mask, plan, meta, False)
    with pytest.raises(AssertionError):
        assert_invariant(normalised)
    mean_of_max = check_split_invariance(lambda *a: loss_fn(*a, max_as_mean=True), leaf, mask, plan, meta, False)
    with pytest.raises(AssertionError, match="abs_diff_max"):
        assert_invariant(mean_of_max)
