"""Plot a run's curves from ``run_dir/metrics.jsonl`` (written by the "jsonl" logger) to a PNG.

    python -m rlflow.plot <run_dir> [--out curves.png] [--keys critic/score/mean actor/pg_loss]

Uses matplotlib's Agg canvas directly (no pyplot), so it neither needs a display nor changes the
backend of a notebook it runs in. matplotlib comes with ``pip install 'rlflow[loggers]'``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

__all__ = ["read_metrics", "default_panels", "plot_run"]

logger = logging.getLogger(__name__)

#: panel title -> substrings a metric name must contain to be drawn there (first match wins)
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("score", "reward", "acc"),
    "loss": ("loss",),
    "KL": ("kl",),
}
_SKIP_SUFFIXES = ("/min", "/max", "/std")
_MAX_LINES = 6


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl; null values become NaN. A truncated last line (a run
    killed mid-write) is skipped with a warning; a bad line elsewhere is an error. A step logged
    more than once (a resumed or recovered run ran it again from its checkpoint) keeps its last
    record, so the records are those of the run as it went on, one per step, in step order."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no metrics file at {path}; plot_run needs a run logged with the 'jsonl' logger "
            f"(trainer.logger must include jsonl)"
        )
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                logger.warning("%s: skipping a truncated last line %d", path, i)
                break
            raise ValueError(f"{path}, line {i}: not valid JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{path}, line {i}: expected a JSON object")
        records.append({k: (math.nan if v is None else v) for k, v in rec.items()})
    if not records:
        raise ValueError(f"{path} has no records yet")
    if all(isinstance(r.get("step"), int) for r in records):
        last = {r["step"]: r for r in records}
        records = [last[step] for step in sorted(last)]
    return records


def _numeric_keys(records: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k, None)
    return list(keys)


def default_panels(keys: Sequence[str]) -> dict[str, list[str]]:
    """Group metric names into the reward / loss / KL panels (empty panels left out)."""
    panels: dict[str, list[str]] = {title: [] for title in PANELS}
    for k in keys:
        if k.endswith(_SKIP_SUFFIXES) or k.startswith("timing"):
            continue
        low = k.lower()
        for title, pats in PANELS.items():
            if any(p in low for p in pats):
                panels[title].append(k)
                break
    return {t: ks[:_MAX_LINES] for t, ks in panels.items() if ks}


def plot_run(
    run_dir: str | os.PathLike, out_path: str | os.PathLike | None = None,
    keys: Sequence[str] | None = None,
) -> str:
    """Render curves of run_dir/metrics.jsonl to a PNG and return its path (default
    ``run_dir/curves.png``). ``keys``: draw exactly these metrics, one panel each; default: the
    reward, loss and KL metrics present, grouped in up to three panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = os.fspath(run_dir)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    available = _numeric_keys(records)
    if keys is not None:
        keys = list(keys)
        missing = [k for k in keys if k not in available]
        if missing:
            raise KeyError(f"metrics {missing} are not in {run_dir}/metrics.jsonl; available: {available}")
        panels = {k: [k] for k in keys}
    else:
        panels = default_panels(available)
        if not panels:
            raise ValueError(
                f"{run_dir}/metrics.jsonl has no reward, loss or KL metrics to plot; pass keys= "
                f"from: {available}"
            )
    out_path = os.fspath(out_path) if out_path is not None else os.path.join(run_dir, "curves.png")

    n = len(panels)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    steps_all = [r.get("step", i) for i, r in enumerate(records)]
    for idx, (title, ks) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, ncols, idx + 1)
        for k in ks:
            pts = [(s, r[k]) for s, r in zip(steps_all, records) if isinstance(r.get(k), (int, float))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=k, linewidth=1.5, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if len(ks) > 1 or keys is None:
            ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="plot a run's metrics.jsonl to a PNG")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: <run_dir>/curves.png)")
    ap.add_argument("--keys", nargs="*", default=None, help="metric names (default: reward, loss, KL)")
    args = ap.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out, args.keys)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
