"""Metrics that declare how they aggregate over micro-batches and dp ranks.

A worker reports one `Metric` per micro-batch (or per mini-batch, e.g. grad_norm); the driver
reduces the records of all micro-batches and ranks of one mini-batch with `reduce_metrics`, then
averages mini-batches with `mean_over_minibatches`. Per-token statistics are MEAN weighted by
their token count, which is the exact whole-mini-batch mean (never a mean of means).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum


class Aggregation(str, Enum):
    MEAN = "mean"  # sum(value * weight) / sum(weight)
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    # sqrt(sum(value^2)): a norm whose parts are disjoint pieces (dp shards of one gradient tensor)
    L2 = "l2"


@dataclass(frozen=True)
class Metric:
    value: float
    aggregation: Aggregation
    weight: float = 1.0


def loss_metric(micro_loss: float, dp_size: int, has_global_meta: bool) -> Metric:
    """The #6957 rule for a loss value.

    Under global metadata each micro-batch loss is its slice of the mini-batch loss times dp_size
    (the factor that cancels DDP/FSDP's mean over ranks), so SUM of loss/dp_size over all
    micro-batches and ranks is the whole mini-batch's loss. Without metadata every micro-batch
    is normalised by itself, and only a MEAN is meaningful.
    """
    if has_global_meta:
        return Metric(micro_loss / dp_size, Aggregation.SUM)
    return Metric(micro_loss, Aggregation.MEAN)


def token_mean_metric(local_mean: float, local_num_tokens: float) -> Metric:
    """A per-token statistic computed as a local masked mean, weighted to an exact global mean."""
    return Metric(local_mean, Aggregation.MEAN, weight=float(local_num_tokens))


def reduce_metrics(records: Iterable[Mapping[str, Metric]]) -> dict[str, float]:
    """Reduce the metric records of all micro-batches and ranks of one mini-batch."""
    grouped: dict[str, list[Metric]] = {}
    for record in records:
        for name, metric in record.items():
            grouped.setdefault(name, []).append(metric)
    reduced: dict[str, float] = {}
    for name, metrics in grouped.items():
        kinds = {m.aggregation for m in metrics}
        if len(kinds) != 1:
            raise ValueError(f"metric {name!r} was reported with mixed aggregations {sorted(k.value for k in kinds)}")
        kind = kinds.pop()
        values = [float(m.value) for m in metrics]
        if kind is Aggregation.SUM:
            reduced[name] = math.fsum(values)
        elif kind is Aggregation.MIN:
            reduced[name] = min(values)
        elif kind is Aggregation.MAX:
            reduced[name] = max(values)
        elif kind is Aggregation.L2:
            reduced[name] = math.sqrt(math.fsum(v * v for v in values))
        else:
            total_weight = math.fsum(m.weight for m in metrics)
            if total_weight == 0:
                reduced[name] = 0.0
            else:
                reduced[name] = math.fsum(m.value * m.weight for m in metrics) / total_weight
    return reduced


def mean_over_minibatches(per_minibatch: list[Mapping[str, float]]) -> dict[str, float]:
    """One value per step: the mean over the step's mini-batches (and ppo epochs)."""
    names: dict[str, list[float]] = {}
    for metrics in per_minibatch:
        for name, value in metrics.items():
            names.setdefault(name, []).append(float(value))
    return {name: math.fsum(values) / len(values) for name, values in names.items()}
