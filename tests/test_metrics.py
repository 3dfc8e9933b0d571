"""Metric reduction: every metric declares its aggregation; per-token stats are exact token means."""

from __future__ import annotations

import pytest

from rlflow.metrics import Aggregation, Metric, loss_metric, mean_over_minibatches, reduce_metrics, token_mean_metric


def test_each_aggregation():
    records = [{"s": Metric(1.0, Aggregation.SUM), "mn": Metric(3.0, Aggregation.MIN), "mx": Metric(3.0, Aggregation.MAX)},
               {"s": Metric(2.5, Aggregation.SUM), "mn": Metric(-1.0, Aggregation.MIN), "mx": Metric(7.0, Aggregation.MAX)}]
    assert reduce_metrics(records) == {"s": 3.5, "mn": -1.0, "mx": 7.0}


def test_l2_is_the_norm_of_the_concatenated_shards():
    # a gradient tensor [3, 4, 12] cut into dp shards [3, 4] and [12] (and an empty one): each shard
    # reports its own norm; the reduction is the norm of the whole tensor
    records = [{"g": Metric(5.0, Aggregation.L2)}, {"g": Metric(12.0, Aggregation.L2)}, {"g": Metric(0.0, Aggregation.L2)}]
    assert reduce_metrics(records)["g"] == 13.0


def test_token_weighted_mean_is_the_exact_token_mean():
    # micro-batch A: 3 tokens with clip indicator mean 1/3; B: 1 token with mean 1.0 -> 2/4 overall
    records = [{"clip": token_mean_metric(1 / 3, 3)}, {"clip": token_mean_metric(1.0, 1)}]
    assert reduce_metrics(records)["clip"] == pytest.approx(0.5)
    # the naive mean of means would say 2/3: the bug class this project exists to prevent
    assert reduce_metrics(records)["clip"] != pytest.approx((1 / 3 + 1.0) / 2)


def test_loss_metric_rule():
    assert loss_metric(4.0, dp_size=2, has_global_meta=True) == Metric(2.0, Aggregation.SUM)
    assert loss_metric(4.0, dp_size=1, has_global_meta=False) == Metric(4.0, Aggregation.MEAN)


def test_mixed_aggregations_are_an_error():
    with pytest.raises(ValueError, match="'x'.*mixed"):
        reduce_metrics([{"x": Metric(1, Aggregation.SUM)}, {"x": Metric(1, Aggregation.MEAN)}])


def test_mean_over_minibatches():
    assert mean_over_minibatches([{"a": 1.0}, {"a": 3.0, "b": 2.0}]) == {"a": 2.0, "b": 2.0}
