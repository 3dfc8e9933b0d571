#!/usr/bin/env python
"""Learning with asynchronous rollout: validation accuracy of the synchronous loop against
trainer.max_staleness=k, over several seeds, on the default run (configs/default.yaml: the tiny
model, the reverse task, PPO with a critic, 40 steps) or that run with --extra overrides.

    .venv/bin/python scripts/async_curves.py                          # seeds 0 1 2, staleness 0 and 1
    .venv/bin/python scripts/async_curves.py --extra algorithm.adv_estimator=grpo --out docs/results/async_curves_grpo.png

Prints, per run, the validation accuracy at each evaluation (@ training seconds so far) and the
run's wall time, then whether
the final accuracy of each staleness lies within the seeds' spread (min..max) of the synchronous
runs; draws every run (thin) and each staleness's mean (thick) to a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(seed: int, staleness: int, extra: list[str], out_dir: str) -> tuple[list[tuple[int, float, float]], float]:
    """[(step, validation accuracy, training seconds so far: the sum of timing/step)], wall seconds."""
    from rlflow import RLFlow, load_config

    overrides = [f"trainer.seed={seed}", f"trainer.max_staleness={staleness}", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={out_dir}", f"trainer.experiment_name=seed{seed}_k{staleness}",
                 "trainer.resume_mode=disable", *extra]
    start = time.perf_counter()
    history = RLFlow(load_config(None, overrides)).fit()
    wall = time.perf_counter() - start
    points, train_s = [], 0.0
    for record in history:
        train_s += record.get("timing/step", 0.0)
        if "val/acc_mean" in record:
            points.append((record["step"], record["val/acc_mean"], train_s))
    return points, wall


def mean_gap(values: list[float], reference: list[float]) -> str:
    """The difference of the means and its standard error (Welch: each sample's own variance), so
    a gap can be read against the seeds' noise; needs 2 or more seeds."""
    if min(len(values), len(reference)) < 2:
        return "-"
    gap = statistics.fmean(values) - statistics.fmean(reference)
    error = (statistics.variance(values) / len(values) + statistics.variance(reference) / len(reference)) ** 0.5
    return f"{gap:+.3f} ({error:.3f}, {gap / error:+.1f} se)" if error > 0 else f"{gap:+.3f} (0)"


def plot(curves: dict[tuple[int, int], list[tuple[int, float, float]]], path: str, title: str) -> None:
    """Left: accuracy by step; right: by training seconds (sum of timing/step: validation and
    worker start-up excluded)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.0))
    FigureCanvasAgg(fig)
    by_step, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2, sharey=None)
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:red"}
    for staleness in sorted({k for _, k in curves}):
        runs = [points for (seed, k), points in sorted(curves.items()) if k == staleness]
        color = colors.get(staleness, "black")
        for points in runs:
            by_step.plot([p[0] for p in points], [p[1] for p in points], color=color, alpha=0.35, linewidth=0.8)
            by_time.plot([p[2] for p in points], [p[1] for p in points], color=color, alpha=0.35, linewidth=0.8)
        columns = list(zip(*runs))  # one tuple of runs' points per evaluation
        mean = [statistics.fmean(p[1] for p in column) for column in columns]
        seconds = [statistics.fmean(p[2] for p in column) for column in columns]
        label = "synchronous" if staleness == 0 else f"max_staleness={staleness}"
        by_step.plot([p[0] for p in runs[0]], mean, color=color, linewidth=2.2, label=f"{label} (mean of {len(runs)} seeds)")
        by_time.plot(seconds, mean, color=color, linewidth=2.2, label=label)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training seconds (sum of timing/step)")
    for ax in (by_step, by_time):
        ax.set_ylabel("validation accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    p.add_argument("--extra", action="append", default=[], help="an rlflow override for every run, key=value")
    p.add_argument("--out", default="async_curves.png")
    args = p.parse_args()
    if 0 not in args.staleness:
        p.error("--staleness must include 0: the synchronous runs are the reference")

    curves, walls = {}, {}
    with tempfile.TemporaryDirectory(prefix="rlflow-async-curves-") as tmp:
        for seed in args.seeds:
            for staleness in args.staleness:
                curves[(seed, staleness)], walls[(seed, staleness)] = run(seed, staleness, args.extra, tmp)
                points = " ".join(f"{s}:{a:.3f}@{t:.0f}s" for s, a, t in curves[(seed, staleness)])
                print(f"seed {seed} max_staleness {staleness}: wall {walls[(seed, staleness)]:.1f} s  val acc {points}",
                      flush=True)

    finals = {key: points[-1][1] for key, points in curves.items()}
    sync = [finals[(seed, 0)] for seed in args.seeds]
    low, high = min(sync), max(sync)
    print("\n| max_staleness | final val acc per seed | mean | mean - sync mean (standard error) | training s (mean) | "
          "wall s per run (mean) | within the sync spread |")
    print("|---|---|---|---|---|---|---|")
    for staleness in args.staleness:
        values = [finals[(seed, staleness)] for seed in args.seeds]
        mean = statistics.fmean(values)
        wall = statistics.fmean(walls[(seed, staleness)] for seed in args.seeds)
        train_s = statistics.fmean(curves[(seed, staleness)][-1][2] for seed in args.seeds)
        verdict = "(reference)" if staleness == 0 else ("yes" if low <= mean <= high else f"no: {mean:.3f} vs {low:.3f}..{high:.3f}")
        gap = "" if staleness == 0 else mean_gap(values, sync)
        print(f"| {staleness} | {' / '.join(f'{v:.3f}' for v in values)} | {mean:.3f} | {gap} | {train_s:.1f} | {wall:.1f} "
              f"| {verdict} |")
    title = "default run (tiny model, reverse task, 40 steps)" + (f": {' '.join(args.extra)}" if args.extra else ": PPO + critic")
    plot(curves, args.out, title)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
