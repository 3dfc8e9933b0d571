"""Validation with rollout.val_n samples per prompt: the unbiased pass@k estimator (against its
closed form and a brute-force count over k-subsets), mean@n, the config rule, and the driver's
validate() end to end on the tiny model."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from conftest import tiny_overrides
from rlflow.algos import (
    group_samples,
    mean_at_k,
    pass_at_k,
    pass_at_k_ks,
    pass_at_k_metrics,
    pass_at_k_per_prompt,
    sample_passes,
)
from rlflow.config import ConfigError, load_config

OLD_VAL_KEYS = {"val/score_mean", "val/response_length_mean", "val/acc_mean"}


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def chen_numpy_free(n: int, c: int, k: int) -> float:
    """Chen et al.'s reference code (the float product), without numpy."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# -- the estimator ---------------------------------------------------------------------------------
def test_pass_at_k_equals_the_closed_form_exactly():
    """Every (n, c, k) with n <= 40: the correctly rounded value of 1 - C(n-c,k)/C(n,k)."""
    cases = 0
    for n in range(1, 41):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert got == float(closed_form(n, c, k)), (n, c, k)
                assert math.isclose(got, chen_numpy_free(n, c, k), rel_tol=1e-12, abs_tol=1e-15), (n, c, k)
                cases += 1
    assert cases == sum(n * (n + 1) for n in range(1, 41))


@pytest.mark.parametrize("n, c, k", [(100, 37, 50), (256, 1, 1), (256, 1, 255), (1000, 3, 500), (2000, 1999, 1),
                                     (2000, 1, 2000), (512, 0, 64), (512, 512, 64), (300, 150, 151)])
def test_pass_at_k_large_n_is_exact(n, c, k):
    got = pass_at_k(n, c, k)
    assert got == float(closed_form(n, c, k))
    assert 0.0 <= got <= 1.0


def test_pass_at_k_edge_cases():
    for n in (1, 2, 5, 16, 64):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0  # c = 0: nothing passes
            assert pass_at_k(n, n, k) == 1.0  # c = n: everything passes
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == c / n  # pass@1 is the fraction passing
            assert pass_at_k(n, c, n) == (1.0 if c else 0.0)  # all n drawn
            for k in range(n - c + 1, n + 1):  # n - c < k: a k-subset cannot miss every pass
                assert pass_at_k(n, c, k) == 1.0


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_brute_force_over_all_k_subsets(n):
    for c in range(n + 1):
        for passing in itertools.combinations(range(n), c):  # which samples pass does not matter
            passing = set(passing)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hits = sum(any(i in passing for i in subset) for subset in subsets)
                assert pass_at_k(n, c, k) == float(Fraction(hits, len(subsets))), (n, sorted(passing), k)


def test_pass_at_k_is_non_decreasing_in_k():
    for n in range(1, 33):
        for c in range(n + 1):
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values) and all(0.0 <= v <= 1.0 for v in values)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_out_of_range_arguments(args):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(*args)


# -- aggregation -----------------------------------------------------------------------------------
def test_reported_ks():
    assert pass_at_k_ks(1) == [1]
    assert pass_at_k_ks(2) == [1, 2]
    assert pass_at_k_ks(4) == [1, 2, 4]
    assert pass_at_k_ks(5) == [1, 2, 4, 5]
    assert pass_at_k_ks(8) == [1, 2, 4, 8]
    assert pass_at_k_ks(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        pass_at_k_ks(0)


def test_the_pass_rule():
    assert sample_passes(0.0, 1.0) and not sample_passes(5.0, 0.0)  # acc decides when reported
    assert not sample_passes(1.0, 0.5)  # partial accuracy is not a pass
    assert sample_passes(0.1) and not sample_passes(0.0) and not sample_passes(-1.0)  # no acc: score > 0
    assert sample_passes(0.1, float("nan")) and not sample_passes(0.0, float("nan"))  # NaN: that sample has no acc


def test_metrics_of_hand_made_groups():
    passed = [[True, False, False, False], [True, True, False, False], [False] * 4]
    scores = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.5], [0.0, 0.0, 0.0, -1.0]]
    metrics = pass_at_k_metrics(passed, scores)
    assert set(metrics) == {"val/pass@1", "val/pass@2", "val/pass@4", "val/mean@4"}
    assert metrics["val/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    # pass@2: 1 - C(3,2)/C(4,2) = 1/2 ; 1 - C(2,2)/C(4,2) = 5/6 ; 0
    assert metrics["val/pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 3)
    assert metrics["val/pass@4"] == pytest.approx(2 / 3)
    assert metrics["val/mean@4"] == pytest.approx((0.25 + 0.75 - 0.25) / 3)
    assert mean_at_k(scores) == metrics["val/mean@4"]
    assert pass_at_k_per_prompt(passed, 2) == [pass_at_k(4, 1, 2), pass_at_k(4, 2, 2), 0.0]
    assert group_samples([1, 2, 3, 4, 5, 6], 3) == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError):
        group_samples([1, 2, 3], 2)
    with pytest.raises(ValueError, match="same number of samples"):
        pass_at_k_metrics([[True], [True, False]], [[1.0], [1.0, 0.0]])


# -- config ----------------------------------------------------------------------------------------
def test_val_n_defaults_to_one():
    assert load_config().rollout.val_n == 1


def test_val_n_above_one_needs_val_do_sample():
    with pytest.raises(ConfigError, match=r"rollout\.val_n=4 needs rollout\.val_do_sample=true"):
        load_config(None, ["rollout.val_n=4"])
    with pytest.raises(ConfigError, match=r"rollout\.val_n must be >= 1, got 0"):
        load_config(None, ["rollout.val_n=0"])
    assert load_config(None, ["rollout.val_n=4", "rollout.val_do_sample=true"]).rollout.val_n == 4


# -- validate() end to end -------------------------------------------------------------------------
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # about a third of the random tiny model's responses "pass"; the score is not the accuracy
    acc = float(sum(map(ord, solution_str)) % 3 == 0)
    return {"score": 2.0 * acc - 0.5 + 0.01 * len(solution_str), "acc": acc}
'''


def test_validate_with_val_n_samples(ray_session, tiny_model_dir, tmp_path):
    from controllers.ppo import PPOTrainer

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, **{
        "algorithm.adv_estimator": "grpo", "rollout.val_n": 4, "rollout.val_do_sample": True,
        "rollout.val_temperature": 1.5, "rollout.val_top_p": 0.9, "data.synthetic_val_size": 12, "data.val_batch_size": 5,
        "reward.custom_function.path": str(reward), "trainer.default_local_dir": str(tmp_path)}))
    trainer = PPOTrainer(cfg)
    trainer.setup()
    try:
        calls, scored = [], []
        group = trainer.groups["rollout"]
        dispatch, score = group.dispatch_dp, trainer.score

        def recording_dispatch(method, td, *args):
            calls.append((method, td.batch_size[0], args))
            return dispatch(method, td, *args)

        def recording_score(batch, rows):
            token_scores, extras = score(batch, rows)
            scored.append((batch["responses"].clone(), batch["response_mask"].clone(), token_scores.sum(-1).tolist(),
                           list(extras["acc"]), list(rows["ground_truth"])))
            return token_scores, extras

        group.dispatch_dp, trainer.score = recording_dispatch, recording_score
        metrics = trainer.validate()

        assert set(metrics) == OLD_VAL_KEYS | {"val/pass@1", "val/pass@2", "val/pass@4", "val/mean@4"}
        # 12 prompts in chunks of 5, 5, 2; each asks for 4 samples at the validation temperature and
        # top-p, seed 0
        assert calls == [("generate", 5, (4, True, 0, False, 1.5, 0.9)), ("generate", 5, (4, True, 0, False, 1.5, 0.9)),
                         ("generate", 2, (4, True, 0, False, 1.5, 0.9))]
        accs = [a for chunk in scored for a in chunk[3]]
        scores = [s for chunk in scored for s in chunk[2]]
        assert len(accs) == 48 and 0 < sum(accs) < 48  # the reward leaves room for pass@k > pass@1
        # the row data follows its prompt: row r of a chunk answers prompt r // 4
        for chunk in scored:
            truths = chunk[4]
            assert all(truths[r] == truths[4 * (r // 4)] for r in range(len(truths)))
        # pass@1 is the mean accuracy over all samples; pass@k grows with k and stays <= 1
        assert metrics["val/pass@1"] == pytest.approx(metrics["val/acc_mean"], abs=1e-12)
        assert metrics["val/acc_mean"] == pytest.approx(sum(accs) / 48, abs=1e-12)
        assert metrics["val/pass@1"] <= metrics["val/pass@2"] <= metrics["val/pass@4"] <= 1.0
        assert metrics["val/score_mean"] == pytest.approx(sum(scores) / 48, abs=1e-12)
        assert metrics["val/mean@4"] == pytest.approx(metrics["val/score_mean"], abs=1e-12)  # equal-size groups
        # every pass@k against the closed form, from the scored samples
        groups = group_samples(accs, 4)
        for k in (1, 2, 4):
            expected = sum(1 - math.comb(4 - int(sum(g)), k) / math.comb(4, k) for g in groups) / len(groups)
            assert metrics[f"val/pass@{k}"] == pytest.approx(expected, abs=1e-12)
        # the 4 draws of a prompt differ (sampled, not one response repeated) ...
        distinct = []
        for responses, mask, *_ in scored:
            texts = [tuple(ids[m.bool()].tolist()) for ids, m in zip(responses, mask)]
            distinct += [len(set(texts[i : i + 4])) for i in range(0, len(texts), 4)]
        assert len(distinct) == 12 and max(distinct) > 1 and sum(distinct) > 24
        # ... and the run repeats them: the same seed, the same weights, the same samples
        first = scored[:]
        scored.clear()
        assert trainer.validate() == metrics
        assert all(a[0].equal(b[0]) for a, b in zip(first, scored))

        # val_n = 1 (the default): the metric keys and the generate calls of before
        trainer.cfg.rollout.val_n = 1
        calls.clear()
        assert set(trainer.validate()) == OLD_VAL_KEYS
        assert calls == [("generate", 5, (1, True, 0, False, 1.5, 0.9)), ("generate", 5, (1, True, 0, False, 1.5, 0.9)),
                         ("generate", 2, (1, True, 0, False, 1.5, 0.9))]
        trainer.cfg.rollout.val_do_sample = False
        calls.clear()
        greedy = trainer.validate()
        assert set(greedy) == OLD_VAL_KEYS and calls[0] == ("generate", 5, (1, False, 0, False, 1.5, 0.9))
    finally:
        trainer.shutdown()


def test_pass_rule_without_acc_uses_the_score():
    from controllers.ppo import PPOTrainer

    assert PPOTrainer._val_passes([1.0, 0.0, -0.5, 0.2], None) == [True, False, False, True]
    assert PPOTrainer._val_passes([1.0, 0.0, 0.0], []) == [True, False, False]
    assert PPOTrainer._val_passes([0.0, 1.0, 1.0], [1.0, 0.0, float("nan")]) == [True, False, True]
