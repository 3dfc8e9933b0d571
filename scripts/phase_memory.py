#!/usr/bin/env python
"""Peak memory per phase of a step, each role's trainer state resident against offloaded.

    .venv/bin/python scripts/phase_memory.py                                  # SmolLM2-135M PPO+critic
    .venv/bin/python scripts/phase_memory.py --config configs/default.yaml    # the tiny model
    .venv/bin/python scripts/phase_memory.py --extra actor.mixed_precision.param_dtype=bfloat16

Runs the recipe twice for --steps steps with trainer.memory_metrics on (no validation): once as
configured, once with actor.offload / critic.offload and rollout.sleep. Prints, for the last step,
each role's peak memory in each phase (the largest rank's; CPU: resident set, CUDA: torch's
allocated memory) and the sum over every worker process, before -> after, and each run's seconds
per step. On CPU the offloaded state waits in a file (page cache, then disk): it leaves the
processes' resident sets, which is what the table measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PHASES = ("gen", "forward", "update", "sync")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, steps: int, overrides: list[str], out_dir: str) -> list[dict]:
    """One `rlflow train` in its own process (its own Ray), its metrics.jsonl rows of each step."""
    args = [sys.executable, "-m", "rlflow.cli", "train", config, f"trainer.total_steps={steps}",
            "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.memory_metrics=true",
            "trainer.logger=[jsonl]", f"trainer.default_local_dir={out_dir}", "trainer.project_name=phase_memory",
            "trainer.experiment_name=run", "trainer.resume_mode=disable", "trainer.save_freq=-1", *overrides]
    subprocess.run(args, check=True, cwd=REPO)
    with open(os.path.join(out_dir, "phase_memory", "run", "metrics.jsonl"), encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if "timing/step" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2_135m_word_problems.yaml")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both runs")
    args = parser.parse_args()
    offload = ["actor.offload=true", "critic.offload=true", "rollout.sleep=true"]
    with tempfile.TemporaryDirectory(prefix="rlflow-phase-memory-") as tmp:
        before = run(args.config, args.steps, args.extra, os.path.join(tmp, "resident"))
        after = run(args.config, args.steps, args.extra + offload, os.path.join(tmp, "offloaded"))
    last_before, last_after = before[-1], after[-1]
    roles = sorted({key.split("/")[2][: -len("_gb")] for key in last_before if key.startswith("memory/gen/")}
                   - {"all_workers"}) + ["all_workers"]
    print(f"\n{args.config} {' '.join(args.extra)}: peak memory per phase, GB (step {args.steps}), "
          "resident -> offloaded (" + ", ".join(offload) + ")\n")
    print("| phase | " + " | ".join(roles) + " |")
    print("|---|" + "---|" * len(roles))
    for phase in PHASES:
        cells = []
        for role in roles:
            key = f"memory/{phase}/{role}_gb"
            cells.append(f"{last_before[key]:.2f} -> {last_after[key]:.2f}")
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print()
    for name, rows in (("resident", before), ("offloaded", after)):
        seconds = [row["timing/step"] for row in rows]
        print(f"{name}: seconds per step {', '.join(f'{s:.1f}' for s in seconds)}")


if __name__ == "__main__":
    main()
