#!/usr/bin/env python
"""Where the actor's update time goes: rlflow's ActorWorker.update against a bare loop on the same
model, batch and micro-batches, in this one process, one thread, nothing else running.

    .venv/bin/python scripts/profile_update.py                    # SmolLM2-135M (the converted cache folder)
    .venv/bin/python scripts/profile_update.py --model tiny --repeats 5

Both run the same on-policy PPO update: one mini-batch of --rows sequences (prompt --prompt-len,
response --response-len tokens, all valid), micro-batches of --micro, token-mean, AdamW, grad clip.
The bare loop is scripts/bench.py's (log-softmax + gather, the policy loss term, backward, clip,
step). Printed: the median seconds of each over --repeats updates, then torch.profiler's top ops
by self CPU time for one update of each, so that a gap shows which operators it is made of.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402


def make_batch(vocab: int, rows: int, prompt_len: int, response_len: int, n: int = 1, seed: int = 0) -> TensorDict:
    """rows // n prompts, each repeated for n consecutive rows (a GRPO group's responses)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (rows // n, prompt_len), generator=gen).repeat_interleave(n, dim=0)
    responses = torch.randint(0, vocab, (rows, response_len), generator=gen)
    input_ids = torch.cat([prompts, responses], dim=1)
    attention = torch.ones_like(input_ids)
    return TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
        "position_ids": torch.arange(input_ids.shape[1]).expand(rows, -1).clone(),
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "advantages": torch.randn(rows, response_len, generator=gen),
    }, batch_size=[rows])


def rlflow_actor(model_dir: str, rows: int, micro: int, response_len: int, overrides: list[str]):
    """An ActorWorker on one rank in this process (as the tests build one), its loss normalised by
    the driver's BatchMeta for the whole mini-batch."""
    from rlflow import load_config
    from workers.actor import ActorWorker

    worker = object.__new__(ActorWorker)
    worker.cfg = load_config(None, [f"actor.model.path={model_dir}", f"actor.ppo_mini_batch_size={rows}",
                                    f"actor.ppo_micro_batch_size_per_gpu={micro}", "actor.ppo_epochs=1",
                                    f"data.max_response_length={response_len}", f"data.train_batch_size={rows // 2}",
                                    "rollout.n=2", "algorithm.adv_estimator=grpo", "actor.optim.lr=1e-6",
                                    "algorithm.rollout_correction.mode=none", *overrides])
    worker.rank, worker.world_size, worker.device = 0, 1, torch.device("cpu")
    worker.init_model(model_dir, 100)
    return worker


def rlflow_update(worker, batch: TensorDict) -> None:
    from rlflow.protocol import attach_meta, compute_batch_meta

    shard = batch.clone()
    attach_meta(shard, compute_batch_meta(shard, dp_size=1, loss_scale_factor=1.0))
    worker.update([shard])


class Bare:
    """scripts/bench.py's bare actor update, on its own copy of the model."""

    def __init__(self, model_dir: str, micro: int):
        from transformers import AutoModelForCausalLM

        from rlflow import load_config
        from rlflow.algos import policy_loss_term

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.micro = micro
        self.term = policy_loss_term(load_config(None, []).actor)

    def update(self, b: TensorDict) -> None:
        from rlflow.protocol import BatchMeta

        self.model.train()
        mask = b["response_mask"]
        meta = BatchMeta(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=b.batch_size[0],
                         loss_scale_factor=1.0)
        self.opt.zero_grad(set_to_none=True)
        width = b["prompts"].shape[1]
        for idx in torch.arange(b.batch_size[0]).split(self.micro):
            logits = self.model(input_ids=b["input_ids"][idx], attention_mask=b["attention_mask"][idx],
                                position_ids=b["position_ids"][idx], use_cache=False).logits[:, width - 1: -1]
            log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, b["responses"][idx].unsqueeze(-1)).squeeze(-1)
            loss = self.term({"log_probs": log_probs, "old_log_probs": log_probs.detach(),
                              "advantages": b["advantages"][idx], "response_mask": mask[idx]}, meta)[0]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def timed(fn, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def top_ops(fn, count: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=count)


def measure(args) -> dict[str, list[float]]:
    """Each update's seconds, bare and rlflow interleaved, in the calling process (--threads)."""
    torch.set_num_threads(args.threads)
    from controllers.setup import resolve_model_path
    from rlflow import load_config
    from transformers import AutoConfig

    model_dir = resolve_model_path(load_config(None, [f"actor.model.path={args.model}"]))
    batch = make_batch(AutoConfig.from_pretrained(model_dir).vocab_size, args.rows, args.prompt_len, args.response_len,
                       args.n)
    worker = rlflow_actor(model_dir, args.rows, args.micro, args.response_len, args.extra)
    bare = Bare(model_dir, args.micro)
    runs = {"bare": lambda: bare.update(batch), "rlflow": lambda: rlflow_update(worker, batch)}
    for fn in runs.values():
        fn()  # warm-up (allocations, Adam state)
    results = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so a change of load hits both
        for name, fn in runs.items():
            results[name] += timed(fn, 1)
    if args.top:
        for name, fn in runs.items():
            print(f"\n-- {name}: top ops by self CPU time, one update --")
            print(top_ops(fn, args.top))
    return results


def in_ray_worker(args) -> dict[str, list[float]]:
    """measure() inside a Ray actor placed and configured as rlflow places its workers (0.5 CPU,
    OMP_WAIT_POLICY=PASSIVE): whether the worker process itself is slower than a plain one."""
    import ray

    from controllers.setup import worker_env

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    try:
        remote = ray.remote(num_cpus=0.5, runtime_env={"env_vars": worker_env()})(lambda a: measure(a))
        return ray.get(remote.remote(args))
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="an HF folder, 'tiny' or a packaged alias")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="responses per prompt (rows sharing a prompt; must divide --rows)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--extra", nargs="*", default=[], help="config overrides for the rlflow actor")
    parser.add_argument("--in-ray", action="store_true", help="measure inside a Ray worker set up as rlflow's")
    args = parser.parse_args()
    if args.n < 1 or args.rows % args.n:
        parser.error(f"--n {args.n} must divide --rows {args.rows}")
    results = in_ray_worker(args) if args.in_ray else measure(args)
    bare_s = statistics.median(results["bare"])
    where = "in a Ray worker as rlflow's" if args.in_ray else "in this process"
    print(f"\n{args.model}: {args.rows} rows ({args.n} per prompt) x ({args.prompt_len} + {args.response_len}) tokens, micro {args.micro}, "
          f"{args.threads} thread(s), {where}, median of {args.repeats}")
    for name, seconds in results.items():
        median = statistics.median(seconds)
        print(f"  {name:7s} {median:7.2f} s/update  ({median / bare_s:.3f}x bare)  all: "
              + " ".join(f"{s:.2f}" for s in seconds))


if __name__ == "__main__":
    main()
