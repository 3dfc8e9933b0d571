#!/usr/bin/env python
"""Learning with asynchronous rollout: validation accuracy of the synchronous loop against
trainer.max_staleness=k, over several seeds, on the default run (configs/default.yaml: the tiny
model, the reverse task, PPO with a critic, 40 steps) or that run with --extra overrides.

    .venv/bin/python scripts/async_curves.py                          # seeds 0 1 2, staleness 0 and 1
    .venv/bin/python scripts/async_curves.py --extra algorithm.adv_estimator=grpo --out docs/async_curves_grpo.png

Prints, per run, the validation accuracy at each evaluation and the run's wall time, then whether
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


def run(seed: int, staleness: int, extra: list[str], out_dir: str) -> tuple[list[tuple[int, float]], float]:
    from rlflow import RLFlow, load_config

    overrides = [f"trainer.seed={seed}", f"trainer.max_staleness={staleness}", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={out_dir}", f"trainer.experiment_name=seed{seed}_k{staleness}",
                 "trainer.resume_mode=disable", *extra]
    start = time.perf_counter()
    history = RLFlow(load_config(None, overrides)).fit()
    wall = time.perf_counter() - start
    return [(h["step"], h["val/acc_mean"]) for h in history if "val/acc_mean" in h], wall


def plot(curves: dict[tuple[int, int], list[tuple[int, float]]], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:red"}
    for staleness in sorted({k for _, k in curves}):
        runs = [points for (seed, k), points in sorted(curves.items()) if k == staleness]
        color = colors.get(staleness, "black")
        for points in runs:
            ax.plot([s for s, _ in points], [a for _, a in points], color=color, alpha=0.35, linewidth=0.8)
        steps = [s for s, _ in runs[0]]
        mean = [statistics.fmean(points[i][1] for points in runs) for i in range(len(steps))]
        label = "synchronous" if staleness == 0 else f"max_staleness={staleness}"
        ax.plot(steps, mean, color=color, linewidth=2.2, label=f"{label} (mean of {len(runs)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
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
                points = " ".join(f"{s}:{a:.3f}" for s, a in curves[(seed, staleness)])
                print(f"seed {seed} max_staleness {staleness}: wall {walls[(seed, staleness)]:.1f} s  val acc {points}",
                      flush=True)

    finals = {key: points[-1][1] for key, points in curves.items()}
    sync = [finals[(seed, 0)] for seed in args.seeds]
    low, high = min(sync), max(sync)
    print("\n| max_staleness | final val acc per seed | mean | wall s per run (mean) | within the sync spread |")
    print("|---|---|---|---|---|")
    for staleness in args.staleness:
        values = [finals[(seed, staleness)] for seed in args.seeds]
        mean = statistics.fmean(values)
        wall = statistics.fmean(walls[(seed, staleness)] for seed in args.seeds)
        verdict = "(reference)" if staleness == 0 else ("yes" if low <= mean <= high else f"no: {mean:.3f} vs {low:.3f}..{high:.3f}")
        print(f"| {staleness} | {' / '.join(f'{v:.3f}' for v in values)} | {mean:.3f} | {wall:.1f} | {verdict} |")
    title = "default run (tiny model, reverse task, 40 steps)" + (f": {' '.join(args.extra)}" if args.extra else ": PPO + critic")
    plot(curves, args.out, title)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
