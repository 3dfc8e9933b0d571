#!/usr/bin/env python
"""TRL's GRPOTrainer on the tiny model: the peer that scripts/bench.py compares rlflow's GRPO with.

Runs in the TRL venv (it never imports rlflow's Ray/omegaconf side; only the pure-Python reward
functions of rlflow.rewards, from this checkout):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0
    .venv-trl/bin/pip install trl==1.16.0 accelerate datasets 'transformers<5.20'
    .venv-trl/bin/python scripts/bench_trl.py --model <tiny model folder> --prompts prompts.json

`prompts.json` is a list of {"prompt", "data_source", "ground_truth"} (bench.py writes it in the
order rlflow's loader yields them; the dataset is not shuffled here, so step k sees the same
prompts in both). The work of one TRL step is made equal to one rlflow GRPO step:
`batch` prompts x `n` generations, generated in one generation batch
(per_device_train_batch_size=micro, gradient_accumulation_steps=batch*n/micro, so one optimizer
step per generation), max_completion_length = rlflow's max_response_length, no KL (beta=0),
loss_type "dapo" (the token mean over the whole batch, as rlflow's token-mean with BatchMeta),
max_grad_norm 1.0, constant learning rate, and gradient checkpointing OFF (TRL's default is on;
rlflow's is off).

Without --gated it trains --steps steps and prints one line per step. With --gated (how bench.py
runs it) it prints `BENCH {"kind": "READY", ...}` once set up, then waits for a line on stdin before
each step and prints `BENCH {"kind": "STEP", "seconds": ...}` after it; the time it waits is not
counted. A step is timed from the go to the trainer's on_step_end (generation, reward, the
forward/backward passes and the optimizer step); TRL's own bookkeeping between steps lands in the
next step's time, so nothing is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

_T_START = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="generations per prompt (num_generations)")
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--micro", type=int, default=16, help="completions per forward/backward")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--gated", action="store_true")
    p.add_argument("--bf16", action="store_true", help="TRL's bfloat16 autocast (float32 weights)")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import accelerate
    import datasets
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from rlflow.rewards import compute_score  # pure Python: the same reward rlflow uses

    rows = json.load(open(args.prompts))
    seqs = args.batch * args.n
    if seqs % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide batch*n = {seqs}")
    need = args.batch * args.steps
    rows = (rows * (need // len(rows) + 1))[:need]
    ds = Dataset.from_list(rows)

    def reward(completions, data_source, ground_truth, **_):
        out = []
        for text, src, gt in zip(completions, data_source, ground_truth):
            s = compute_score(src, text, gt)
            out.append(float(s["score"] if isinstance(s, dict) else s))
        return out

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="bench_trl_")
    cfg = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.micro, gradient_accumulation_steps=seqs // args.micro,
        num_generations=args.n, max_completion_length=args.max_completion_length, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0,
        num_iterations=1, loss_type="dapo", temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False,
        gradient_checkpointing=args.gradient_checkpointing, use_cpu=True, bf16=args.bf16, fp16=False,
        report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=args.seed,
        dataloader_num_workers=0,
    )
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                "datasets": datasets.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "bf16": args.bf16}

    def emit(kind: str, **fields) -> None:
        print("BENCH " + json.dumps({"kind": kind, **fields}), flush=True)

    class Gate(TrainerCallback):
        t0 = 0.0

        def _wait(self):
            if args.gated:
                sys.stdin.readline()  # "" at EOF: the caller went away, carry on ungated
            self.t0 = time.perf_counter()

        def on_train_begin(self, targs, state, control, **kw):
            emit("READY", setup_s=time.perf_counter() - _T_START, versions=versions)
            self._wait()

        def on_step_end(self, targs, state, control, **kw):
            seconds = time.perf_counter() - self.t0
            lengths = trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
            emit("STEP", step=state.global_step, seconds=seconds, response_tokens=lengths[-1] * seqs)
            if not args.gated:
                print(f"step {state.global_step}: {seconds:.3f} s", file=sys.stderr, flush=True)
            if state.global_step < args.steps:
                self._wait()

    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[Gate()])
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
