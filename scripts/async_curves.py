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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from seed_curves import compare  # noqa: E402  (the arms x seeds runner this script specialises)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    p.add_argument("--extra", action="append", default=[], help="an rlflow override for every run, key=value")
    p.add_argument("--out", default="async_curves.png")
    args = p.parse_args()
    if 0 not in args.staleness:
        p.error("--staleness must include 0: the synchronous runs are the reference")
    ordered = [0] + [k for k in args.staleness if k != 0]
    arms = [("synchronous" if k == 0 else f"max_staleness={k}", [f"trainer.max_staleness={k}"]) for k in ordered]
    title = "default run (tiny model, reverse task, 40 steps)" + ("" if args.extra else ": PPO + critic")
    return compare(None, arms, args.seeds, args.extra, args.out, None, title)


if __name__ == "__main__":
    raise SystemExit(main())
