#!/usr/bin/env python
"""What a checkpoint costs a step: no save, a synchronous save, and trainer.async_save, in one run.

    .venv/bin/python scripts/bench_checkpoint.py                      # SmolLM2-135M, the PPO recipe (actor + critic)
    .venv/bin/python scripts/bench_checkpoint.py --recipe configs/smollm2_135m_word_problems_grpo_fast.yaml
    .venv/bin/python scripts/bench_checkpoint.py --model tiny         # the tiny model (a quick look)

Each mode is one fit of --steps steps with a checkpoint after every step (trainer.save_freq=1;
none for "no save"), in this driver (the worker processes are reused between fits). A step's wall
time runs from the start of one step to the start of the next, so it holds the checkpoint: the
state's collection from the workers (synchronous in both modes) and, without async_save, the
writing (files, fsync, checksums, rename). Printed: median s/step over the steps after --warmup,
the checkpoint's share of it, and the driver's seconds in collect and in write per save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {"no save": ["trainer.save_freq=-1"], "synchronous save": ["trainer.save_freq=1"],
         "async_save": ["trainer.save_freq=1", "trainer.async_save=true"]}


def timed_trainer(config):
    from controllers import checkpoint
    from controllers.ppo import PPOTrainer

    class Timed(PPOTrainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.step_starts, self.collect_s, self.write_s = [], [], []

        def run_step(self, step):
            self.step_starts.append(time.perf_counter())
            super().run_step(step)

        def save_snapshot(self, snapshot):
            clock = time.perf_counter()
            super().save_snapshot(snapshot)
            self.write_s.append(time.perf_counter() - clock)

        def fit(self):
            original = checkpoint.collect

            def collect(trainer, step, workers=True):
                clock = time.perf_counter()
                try:
                    return original(trainer, step, workers)
                finally:
                    self.collect_s.append(time.perf_counter() - clock)

            checkpoint.collect = collect
            try:
                history = super().fit()
            finally:
                checkpoint.collect = original
            self.step_starts.append(time.perf_counter())
            return history

    return Timed(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/smollm2_135m_word_problems.yaml")
    parser.add_argument("--model", default=None, help="tiny: the tiny model instead of the recipe's")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more key=value overrides")
    args = parser.parse_args()
    from rlflow import load_config

    out = tempfile.mkdtemp(prefix="rlflow-bench-ckpt-")
    rows = []
    for mode, overrides in MODES.items():
        settings = [f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
                    "trainer.logger=[jsonl]", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}",
                    f"trainer.experiment_name={mode.replace(' ', '_')}", "trainer.max_to_keep=1", *overrides,
                    *args.extra]
        recipe = None if args.model == "tiny" else args.recipe
        if args.model == "tiny":
            from rlflow.tiny import build_tiny_model

            settings.insert(0, f"actor.model.path={build_tiny_model(os.path.join(out, 'tiny'))}")
        trainer = timed_trainer(load_config(recipe, settings))
        trainer.fit()
        walls = [b - a for a, b in zip(trainer.step_starts, trainer.step_starts[1:])][args.warmup:]
        size = 0
        for root, _, files in os.walk(os.path.join(trainer.run_dir, "checkpoints")):
            size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        rows.append((mode, statistics.median(walls), statistics.median(trainer.collect_s or [0.0]),
                     statistics.median(trainer.write_s or [0.0]), size / 2**20))
        print(f"{mode}: step walls {[round(w, 2) for w in walls]}", flush=True)
    base = rows[0][1]
    print(f"\n{'mode':<18}{'s/step':>9}{'vs no save':>12}{'collect s':>11}{'write s':>9}{'ckpt MiB':>10}")
    for mode, wall, collect_s, write_s, size in rows:
        print(f"{mode:<18}{wall:>9.2f}{wall / base:>11.2f}x{collect_s:>11.2f}{write_s:>9.2f}{size:>10.0f}")
    print("(write s: the driver's wait in save_snapshot: the whole write when synchronous, the wait for the "
          "previous write with async_save)")


if __name__ == "__main__":
    main()
