#!/usr/bin/env python
"""Time the actor -> rollout weight sync of each rollout.weight_sync mode, in one run.

    .venv/bin/python scripts/bench_weight_sync.py                        # smollm2-135m, 5 syncs each
    .venv/bin/python scripts/bench_weight_sync.py --model tiny --syncs 20

Each mode gets the worker groups rlflow builds (PPOTrainer.setup: one actor rank, one HF rollout
rank, GRPO so no critic) and calls PPOTrainer.sync_weights, the call a step makes, once untimed
(first touches of the buffers) and then --syncs times; the table gives the driver's wall time per
sync. The modes run one after the other in the same processes (a finished setup parks them for
the next), so a machine whose load changes slows them alike only roughly: rerun to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("shared_memory", "object_store", "collective")


def overrides(model: str, mode: str, bucket_mb: int, extra: list[str]) -> list[str]:
    return [
        f"actor.model.path={model}",
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=false",
        "rollout.name=hf",
        f"rollout.weight_sync={mode}",
        f"rollout.weight_sync_bucket_mb={bucket_mb}",
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "reward.num_workers=0",
        *extra,
    ]


def time_mode(model: str, mode: str, syncs: int, bucket_mb: int, extra: list[str]) -> dict:
    from controllers.ppo import PPOTrainer
    from rlflow import load_config

    trainer = PPOTrainer(load_config(None, overrides(model, mode, bucket_mb, extra)))
    trainer.setup()
    try:
        if trainer.weight_sync != mode:
            raise RuntimeError(f"asked for {mode}, the trainer chose {trainer.weight_sync}")
        weights = trainer.groups["actor"].call_all("get_weights")[0]
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        del weights
        trainer.sync_weights()  # untimed: the first sync touches every buffer's pages
        times = []
        for _ in range(syncs):
            start = time.perf_counter()
            trainer.sync_weights()
            times.append(time.perf_counter() - start)
    finally:
        trainer.shutdown(keep_workers=True)  # the next mode's setup takes these processes
    return {"mode": mode, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times), "mib": nbytes / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="actor.model.path (an alias, 'tiny' or a folder)")
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per mode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--bucket-mb", type=int, default=256, help="rollout.weight_sync_bucket_mb (collective)")
    p.add_argument("--extra", action="append", default=[], help="another override key=value")
    args = p.parse_args()

    import ray

    from controllers.cluster import local_ray_options

    ray.init(**local_ray_options(num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False))
    try:
        rows = [time_mode(args.model, mode, args.syncs, args.bucket_mb, args.extra) for mode in args.modes.split(",")]
    finally:
        ray.shutdown()
    load = os.getloadavg()[0]
    print(f"\nweight sync, {args.model}, {args.syncs} syncs per mode, 1-min load {load:.1f}, {os.cpu_count()} cores")
    print(f"{'mode':<14} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'MiB':>7} {'GiB/s':>6}")
    for r in rows:
        rate = r["mib"] / 1024 / (r["median_ms"] / 1e3)
        print(f"{r['mode']:<14} {r['median_ms']:>10.0f} {r['min_ms']:>8.0f} {r['max_ms']:>8.0f} {r['mib']:>7.0f} "
              f"{rate:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
