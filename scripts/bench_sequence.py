#!/usr/bin/env python
"""Where packing and sequence parallelism pay (workers/sequence.py), measured at 135M.

    .venv/bin/python scripts/bench_sequence.py --part pack   # the word-problem recipe's update: padded vs packed
    .venv/bin/python scripts/bench_sequence.py --part sp     # one long sequence: sp=2 vs sp=1

pack: one step of configs/smollm2_135m_word_problems_grpo.yaml is run with trainer.record_rollouts
(once; --record reuses a folder), then the actor's update over that recorded batch (32 rows, the
recipe's micro-batches of 8) is timed in a fresh process per layout: padded without and with the
shared-prompt forward (the default), and packed. Printed per layout: the tokens the forwards
compute (padded: rows x the micro-batch's trimmed width; shared prompt: the packed groups' width;
packed: the valid tokens) and the padding fraction among them, seconds per update (median of
--repeats after a warm-up), response tokens per second and the process's peak resident memory
during the timed updates.

attention: the CPU mechanism of the packed attention, chosen by this measurement: a forward +
backward of one packed row (--rows sequences of random lengths up to --row-len, the 135M model)
through rlflow's per-sequence sdpa (`rlflow_varlen`) against transformers' own packed-sequence
support (sdpa with a block-diagonal mask it builds from the restarting position ids).

sp: one sequence of --seq-len tokens (a --prompt-len prompt, the rest response) through the actor's
update with gradient checkpointing, at sp=1 (one process, --threads threads) and at sp=2 (two gloo
processes, --threads / 2 each, FSDP2 over both). Printed: each rank's peak resident memory during
the update and the update's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RECIPE = os.path.join(REPO, "configs", "smollm2_135m_word_problems_grpo.yaml")
PACK_LAYOUTS = {
    "padded": ["actor.model.share_prompt_forward=false"],
    "padded + shared prompt (default)": [],
    "packed": ["actor.use_remove_padding=true"],
}


def record_step(folder: str) -> None:
    """One recipe step (generation at 135M included), its rollout batch written to `folder`."""
    subprocess.run([sys.executable, "-m", "rlflow.cli", "train", RECIPE, "trainer.total_steps=1",
                    "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[console]",
                    f"trainer.record_rollouts={folder}", f"trainer.default_local_dir={folder}/run"],
                   check=True, cwd=REPO)


def actor_worker(overrides: list[str], rank: int = 0, world_size: int = 1, threads: int = 1):
    from rlflow import load_config
    from workers.actor import ActorWorker

    cfg = load_config(RECIPE, ["algorithm.rollout_correction.mode=none", *overrides])
    return ActorWorker(cfg, rank, world_size, threads)


def computed_tokens(worker, batch) -> tuple[int, int]:
    """(tokens the update's forwards run, valid tokens among them) over the worker's micro-batches."""
    from rlflow.protocol import prompt_groups, split_micro_batches
    from workers.forward import _forward_cost, _hf_model, _packing, _trim_window
    from workers.trainable import micro_batch_plan

    micros, _ = split_micro_batches(batch, **micro_batch_plan(worker.cfg.actor, batch, worker.share_prompt))
    computed = valid = 0
    for micro in micros:
        left, prompt_width, kept = _trim_window(micro)
        valid += int(micro["attention_mask"][:, : prompt_width + kept].sum())
        if worker.layout.packs:
            computed += int(micro["attention_mask"][:, : prompt_width + kept].sum())
            continue
        plain = micro.batch_size[0] * (prompt_width + kept - left)
        if worker.share_prompt:  # as workers/forward.py chooses: the shared-prompt row when it costs less
            config = _hf_model(worker.model).config
            packing = _packing(micro, prompt_groups(micro), prompt_width - left, prompt_width, kept)
            if (_forward_cost(config, packing.num_groups, packing.length)
                    < _forward_cost(config, micro.batch_size[0], prompt_width + kept - left)):
                plain = packing.num_groups * packing.length
        computed += plain
    return computed, valid


def pack_variant(record: str, overrides: list[str], repeats: int, threads: int) -> dict:
    """In this process: the layout's update over the recorded batch."""
    import torch

    from controllers.setup import resolve_model_path
    from controllers.rollout_source import read_recorded
    from rlflow.algos import get_adv_estimator_fn
    from rlflow.protocol import attach_meta, compute_batch_meta
    from workers.base import peak_memory_bytes

    torch.set_num_threads(threads)
    batch = read_recorded(record, 0).batch
    worker = actor_worker(overrides, threads=threads)
    worker.init_model(resolve_model_path(worker.cfg), 100)
    # the recipe's GRPO advantages of the recorded scores
    batch["advantages"], _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=batch["token_level_scores"], response_mask=batch["response_mask"], gamma=1.0, lam=1.0,
        index=batch["group_index"], norm_adv_by_std_in_grpo=True)
    keys = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "advantages")
    batch = batch.select(*keys)

    def update():
        shard = batch.clone()
        attach_meta(shard, compute_batch_meta(shard, dp_size=1, loss_scale_factor=worker.cfg.actor.loss_scale_factor))
        worker.update([shard])

    update()  # warm-up: allocations, AdamW's state
    peak_memory_bytes(worker.device, reset=True)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        update()
        seconds.append(time.perf_counter() - start)
    computed, valid = computed_tokens(worker, batch)
    return {"seconds": statistics.median(seconds), "all": seconds, "computed": computed, "valid": valid,
            "response_tokens": int(batch["response_mask"].sum()), "rows": batch.batch_size[0],
            "peak_mib": peak_memory_bytes(worker.device, reset=False) / 2**20}


def sp_rank(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    """One rank of the long-sequence update (sp = world_size)."""
    import torch

    from controllers.setup import resolve_model_path
    from rlflow.protocol import assemble_rollout, attach_meta, compute_batch_meta
    from workers.base import peak_memory_bytes

    threads = max(1, args.threads // world_size)
    response_len = args.seq_len - args.prompt_len
    worker = actor_worker([f"actor.sp_size={world_size}", "actor.use_remove_padding=true",
                           "actor.model.gradient_checkpointing=true", "actor.ppo_mini_batch_size=4",
                           "actor.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=1",
                           f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={response_len}"],
                          rank, world_size, threads)
    worker.init_distributed("127.0.0.1", port)
    worker.init_model(resolve_model_path(worker.cfg), 100)
    vocab = worker.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (1, args.prompt_len), generator=gen)
    responses = torch.randint(3, vocab, (1, response_len), generator=gen).tolist()
    batch = assemble_rollout(prompts, torch.ones_like(prompts), responses, 1, response_len, pad_token_id=0,
                             eos_token_id=-1)
    batch["advantages"] = torch.randn(1, response_len, generator=gen)
    attach_meta(batch, compute_batch_meta(batch, dp_size=1, loss_scale_factor=float(response_len)))
    peak_memory_bytes(worker.device, reset=True)
    start = time.perf_counter()
    worker.update([batch])
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "peak_mib": peak_memory_bytes(worker.device, reset=False) / 2**20}, f)
    worker.shutdown()


def run_sp(args) -> dict[int, list[dict]]:
    import torch.multiprocessing as mp

    from workers.base import free_port

    results = {}
    for sp_size in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(sp_rank, args=(sp_size, free_port(), args, out), nprocs=sp_size, start_method="spawn")
            results[sp_size] = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(sp_size)]
    return results


def run_attention(args) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from controllers.setup import resolve_model_path
    from rlflow import load_config
    from workers.sequence import use_packed_attention

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(load_config(RECIPE, [])), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.row_len // 4, args.row_len + 1, (args.rows,), generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (1, int(lengths.sum())), generator=gen)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).int()])
    packed = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": int(lengths.max()),
              "max_length_k": int(lengths.max())}

    def step(**extra):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, **extra).logits.sum().backward()

    seconds = {}
    for name in ("block-diagonal mask (transformers sdpa)", "per-sequence sdpa (rlflow_varlen)"):
        if name.startswith("per-sequence"):
            use_packed_attention(model)
        extra = packed if name.startswith("per-sequence") else {}
        step(**extra)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step(**extra)
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times)
    seconds["tokens"] = int(lengths.sum())
    return seconds


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("pack", "sp", "attention"), required=True)
    parser.add_argument("--rows", type=int, default=8, help="attention: sequences in the packed row")
    parser.add_argument("--row-len", type=int, default=160, help="attention: the longest sequence")
    parser.add_argument("--record", help="pack: a trainer.record_rollouts folder of the recipe (made when absent)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one pack layout in this process
    args = parser.parse_args()
    print(f"load average before: {load_average()}; {os.cpu_count()} cores")
    if args.part == "attention":
        seconds = run_attention(args)
        tokens = seconds.pop("tokens")
        print(f"\n## packed attention on CPU: {args.rows} sequences, {tokens} tokens, 135M, forward + backward, "
              f"{args.threads} threads, median of {args.repeats}")
        print("| mechanism | seconds |\n|---|---|")
        for name, value in seconds.items():
            print(f"| {name} | {value:.3f} |")
        print(f"\nload average after: {load_average()}")
        return 0
    if args.part == "sp":
        results = run_sp(args)
        print(f"\n## one sequence of {args.seq_len} tokens at 135M, gradient checkpointing, {args.threads} threads in all")
        print("| layout | update s | peak memory per rank MiB |\n|---|---|---|")
        for sp_size, ranks in results.items():
            print(f"| sp={sp_size} | {max(r['seconds'] for r in ranks):.1f} | "
                  + ", ".join(f"{r['peak_mib']:.0f}" for r in ranks) + " |")
        ratio = max(r["peak_mib"] for r in results[2]) / results[1][0]["peak_mib"]
        print(f"\nsp=2 / sp=1 peak memory per rank: {ratio:.2f}x; step time "
              f"{max(r['seconds'] for r in results[2]) / results[1][0]['seconds']:.2f}x; load average after: {load_average()}")
        return 0
    if args.variant is not None:
        print("RESULT " + json.dumps(pack_variant(args.record, PACK_LAYOUTS[args.variant], args.repeats, args.threads)))
        return 0
    record = args.record or os.path.join(tempfile.gettempdir(), "rlflow_bench_sequence_record")
    if not os.path.isdir(record) or not os.listdir(record):
        record_step(record)
    rows = {}
    for name in PACK_LAYOUTS:  # a fresh process each: its peak memory is its own
        out = subprocess.run([sys.executable, __file__, "--part", "pack", "--record", record, "--variant", name,
                              "--repeats", str(args.repeats), "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True, cwd=REPO).stdout
        rows[name] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    base = rows["padded"]
    print(f"\n## the word-problem recipe's actor update at 135M ({base['rows']} rows, {args.threads} threads, "
          f"median of {args.repeats})")
    print("| layout | tokens computed | padding fraction | update s | response tokens/s | time vs padded | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        # the shared-prompt forward computes fewer tokens than the rows hold (a prompt once per group)
        padding = f"{1 - row['valid'] / row['computed']:.3f}" if row["computed"] >= row["valid"] else "-"
        print(f"| {name} | {row['computed']} | {padding} | {row['seconds']:.2f} | "
              f"{row['response_tokens'] / row['seconds']:.0f} | {row['seconds'] / base['seconds']:.3f} | {row['peak_mib']:.0f} |")
    print(f"\nload average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
