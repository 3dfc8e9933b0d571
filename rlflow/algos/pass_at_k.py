"""pass@k and mean@k of validation with several samples per prompt (pure Python, no torch needed).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", eq. 1): with n samples of a prompt of which c pass, the probability that a k-subset drawn
without replacement holds at least one passing sample,

    pass@k = 1 - C(n - c, k) / C(n, k),

averaged over prompts. It is computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i) (their
numerically stable form), here over Python integers, prod (i - k) / prod i, so the result is the
exact rational rounded once to a float: no cancellation, no overflow, no comb() of huge numbers.

A sample passes (`sample_passes`) when its accuracy is 1 — the reward reports "acc" — and, where the
reward reports no accuracy (or NaN for that sample), when its score is > 0.

mean@n is the average over prompts of the mean score of the prompt's n samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "group_samples",
    "mean_at_k",
    "pass_at_k",
    "pass_at_k_ks",
    "pass_at_k_metrics",
    "pass_at_k_per_prompt",
    "sample_passes",
]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k), for 1 <= k <= n, 0 <= c <= n."""
    n, c, k = int(num_samples), int(num_correct), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: num_samples must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: num_correct must be in [0, num_samples={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, num_samples={n}], got {k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i, exactly, over integers
    numerator, denominator = 1, 1
    for i in range(n - c + 1, n + 1):
        numerator *= i - k
        denominator *= i
    return (denominator - numerator) / denominator  # int / int: correctly rounded


def pass_at_k_ks(num_samples: int) -> list[int]:
    """The k reported for n samples per prompt: 1, the powers of 2 below n, and n."""
    n = int(num_samples)
    if n < 1:
        raise ValueError(f"num_samples must be >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sample_passes(score: float, acc: float | None = None) -> bool:
    """The pass rule: acc == 1 when the reward reports an accuracy (not None/NaN), else score > 0."""
    if acc is not None and not math.isnan(acc):
        return acc == 1.0
    return score > 0.0


def group_samples(values: Sequence, group_size: int) -> list[list]:
    """Cut a flat list in repeat_interleave order (row r answers prompt r // group_size) into the
    per-prompt groups."""
    if group_size < 1 or len(values) % group_size:
        raise ValueError(f"{len(values)} samples cannot be cut into groups of {group_size}")
    return [list(values[i : i + group_size]) for i in range(0, len(values), group_size)]


def pass_at_k_per_prompt(passed: Sequence[Sequence[bool]], k: int) -> list[float]:
    """pass@k of each prompt from the pass/fail of its samples (every group must hold >= k)."""
    return [pass_at_k(len(group), sum(bool(p) for p in group), k) for group in passed]


def mean_at_k(scores: Sequence[Sequence[float]]) -> float:
    """The average over prompts of the mean score of each prompt's samples."""
    if not scores:
        raise ValueError("mean_at_k: no prompts")
    return sum(sum(group) / len(group) for group in scores) / len(scores)


def pass_at_k_metrics(passed: Sequence[Sequence[bool]], scores: Sequence[Sequence[float]],
                      prefix: str = "val/") -> dict[str, float]:
    """{prefix}pass@k for k in pass_at_k_ks(n) (averaged over prompts) and {prefix}mean@n, for
    groups of n samples per prompt (every group the same size)."""
    if not passed or len(passed) != len(scores):
        raise ValueError(f"pass_at_k_metrics: {len(passed)} pass groups and {len(scores)} score groups")
    sizes = {len(group) for group in passed} | {len(group) for group in scores}
    if len(sizes) != 1:
        raise ValueError(f"pass_at_k_metrics: every prompt needs the same number of samples, got sizes {sorted(sizes)}")
    (n,) = sizes
    metrics = {}
    for k in pass_at_k_ks(n):
        values = pass_at_k_per_prompt(passed, k)
        metrics[f"{prefix}pass@{k}"] = sum(values) / len(values)
    metrics[f"{prefix}mean@{n}"] = mean_at_k(scores)
    return metrics
