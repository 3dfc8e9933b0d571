#!/usr/bin/env python
"""On-policy distillation on the tiny task: a student distilled from a better teacher, against the
same student trained by GRPO on the task's reward (and by both), one run each, in this process.

    .venv/bin/python scripts/distill_tiny.py --steps 100 --test-freq 20 --out /tmp/distill.md

The teacher is the tiny model warm-started on right answers only (rlflow.tiny.warm_start with
correct_frac=1.0: it reverses the digits); the student is the default run's warm start
(correct_frac=0.4: it has seen both strategies and prefers the distractor, so its greedy answers are
mostly wrong). Both are built locally and cached (~45 s of SFT each the first time). Arms:

- distill: pure distillation (actor.distill.coef=1, actor.distill.use_policy_loss=false): the
  student's loss is the per-token reverse KL to the teacher on its own samples; rewards are scored
  and logged but nothing trains on them.
- grpo: the default GRPO run on the task's reward (no teacher), the same steps and batch.
- grpo+distill: the GRPO loss with the distillation term added (actor.distill.coef=1).
- distill-topk (not in the default arms): pure distillation by the forward KL from the teacher's top
  8 tokens at each sampled position (actor.distill.top_k=8) instead of the sampled token's reverse KL.

Prints the teacher's and the student's greedy validation accuracy before training, then each arm's
validation accuracy at every evaluation and its wall time, and writes them as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def greedy_accuracy(model_dir: str, rows) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.tiny import evaluate_exact_match

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return evaluate_exact_match(model, AutoTokenizer.from_pretrained(model_dir), rows, max_new_tokens=8)


def run_arm(name: str, overrides: list[str], workdir: str) -> tuple[list[tuple[int, float]], float, dict]:
    from rlflow import RLFlow, load_config

    cfg = load_config(None, overrides + [f"trainer.default_local_dir={os.path.join(workdir, name)}"])
    start = time.time()
    history = RLFlow(cfg).fit()
    seconds = time.time() - start
    curve = [(record["step"], record["val/acc_mean"]) for record in history if "val/acc_mean" in record]
    # the sampled reverse KL (the top-k arm logs its forward KL instead): the mean of the first and
    # of the last 5 steps
    key = "actor/distill_forward_kl" if any("actor/distill_forward_kl" in record for record in history) \
        else "actor/distill_reverse_kl"
    kl = [record[key] for record in history if key in record]
    kl_ends = (sum(kl[:5]) / len(kl[:5]), sum(kl[-5:]) / len(kl[-5:])) if kl else None
    return curve, seconds, kl_ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--test-freq", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4, help="actor.optim.lr of every arm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=["distill", "grpo", "grpo+distill"])
    parser.add_argument("--out", default=None, help="a markdown file for the table")
    args = parser.parse_args()

    from rlflow.data.synthetic import make_synthetic_rows
    from rlflow.tiny import warm_start

    teacher_dir = warm_start("reverse", correct_frac=1.0)
    student_dir = warm_start("reverse")
    val_rows = make_synthetic_rows("reverse", 128, seed=0, split="val")
    before = {"teacher": greedy_accuracy(teacher_dir, val_rows), "student": greedy_accuracy(student_dir, val_rows)}
    print(f"greedy val accuracy before training: teacher {before['teacher']:.3f}, student {before['student']:.3f}",
          flush=True)

    common = [f"actor.model.path={student_dir}", f"trainer.total_steps={args.steps}",
              f"trainer.test_freq={args.test_freq}", "trainer.val_before_train=true", f"trainer.seed={args.seed}",
              "trainer.logger=[jsonl]", "algorithm.adv_estimator=grpo", "rollout.n=4", "data.train_batch_size=16",
              "actor.ppo_mini_batch_size=64", f"actor.optim.lr={args.lr}"]
    arms = {
        "distill": common + ["actor.distill.coef=1.0", "actor.distill.use_policy_loss=false", "teacher.enable=true",
                             f"teacher.model.path={teacher_dir}"],
        "grpo": common,
        # both: the GRPO loss plus the distillation term
        "grpo+distill": common + ["actor.distill.coef=1.0", "teacher.enable=true", f"teacher.model.path={teacher_dir}"],
        "distill-topk": common + ["actor.distill.coef=1.0", "actor.distill.top_k=8", "actor.distill.use_policy_loss=false",
                                  "teacher.enable=true", f"teacher.model.path={teacher_dir}"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.arms:
            curve, seconds, kl = run_arm(name, arms[name], workdir)
            text = ", ".join(f"{step}: {acc:.3f}" for step, acc in curve)
            extra = f", sampled reverse KL {kl[0]:.3f} -> {kl[1]:.3f}" if kl else ""
            print(f"{name}: val acc by step {text} ({seconds:.0f} s{extra})", flush=True)
            rows.append((name, curve, seconds, kl))

    if args.out:
        lines = [
            "| arm | val acc (greedy) by step | wall s | sampled reverse KL, first 5 -> last 5 steps |",
            "|---|---|---|---|",
        ]
        for name, curve, seconds, kl in rows:
            text = ", ".join(f"{step}: {acc:.3f}" for step, acc in curve)
            lines.append(f"| {name} | {text} | {seconds:.0f} | {'' if kl is None else f'{kl[0]:.3f} -> {kl[1]:.3f}'} |")
        header = (f"Teacher (warm start on right answers) greedy val accuracy {before['teacher']:.3f}; "
                  f"student (the default warm start) {before['student']:.3f} before training.\n\n")
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
