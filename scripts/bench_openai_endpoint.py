#!/usr/bin/env python
"""The OpenAI endpoint's overhead per call against a direct engine call (controllers/openai_endpoint.py).

    python scripts/bench_openai_endpoint.py [--config configs/calculator_openai_agent.yaml]
                                            [--batches 1,8,32] [--repeats 5] [--max-tokens 16]

Starts the recipe's worker groups (the warm-started tiny model, the HF rollout engine in its Ray
worker), then for each batch size B, on the same B prompts with greedy decoding (so both paths
generate the same tokens), times, in one run:
- direct: one generate call of the rollout worker group for the B contexts (what AgentLoop does);
- endpoint: B concurrent chat-completion calls made with the real openai client from another
  process (B threads; the agents run outside the driver in a real rollout), answered by the
  endpoint with one engine call (checked).
Prints a table: the median wall time of each path, the overhead (endpoint - direct) per batch and
per call. A measurement script; the framework does not use it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import threading
import time


def _client_batch(urls: list[str], prompts: list[str], max_tokens: int) -> tuple[float, list[str]]:
    """In a subprocess: one chat call per url, all at once; (wall seconds, texts)."""
    import httpx
    import openai

    http = httpx.Client(timeout=60.0, trust_env=False)
    clients = [openai.OpenAI(base_url=url, api_key="none", max_retries=0, http_client=http) for url in urls]
    texts = [None] * len(urls)
    barrier = threading.Barrier(len(urls) + 1)

    def call(i):
        barrier.wait()
        reply = clients[i].chat.completions.create(model="policy", max_tokens=max_tokens,
                                                   messages=[{"role": "user", "content": prompts[i]}])
        texts[i] = reply.choices[0].message.content

    # warm the connections (not timed)
    for i, client in enumerate(clients):
        client.models.list()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(urls))]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, texts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/calculator_openai_agent.yaml")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import multiprocessing

    from controllers.ppo import PPOTrainer
    from rlflow import load_config

    cfg = load_config(args.config, ["trainer.logger=[console]", *args.overrides])
    trainer = PPOTrainer(cfg)
    trainer.setup()
    loop = trainer.agent
    endpoint = loop.endpoint
    endpoint.start()
    tok = trainer.tokenizer
    rows = [trainer.val_dataset[i] for i in range(len(trainer.val_dataset))]
    prompts = [tok.decode(row["input_ids"]) for row in rows]
    loop._sampling = (False, 0, True, None, None)  # greedy: both paths generate the same tokens
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    table = []
    try:
        for size in [int(b) for b in args.batches.split(",")]:
            batch_prompts = (prompts * (size // len(prompts) + 1))[:size]
            contexts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
                        for p in batch_prompts]
            direct, through, direct_texts = [], [], None
            for repeat in range(args.repeats + 1):  # the first of each is a warm-up
                start = time.perf_counter()
                out = loop._engine(contexts, args.max_tokens)
                elapsed = time.perf_counter() - start
                direct_texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in out]
                endpoint.concurrency = size
                urls = endpoint.open(size)
                wall, texts = pool.submit(_client_batch, urls, batch_prompts, args.max_tokens).result()
                calls = list(endpoint.engine_calls)
                endpoint.close_rollout()
                if calls != [size]:
                    print(f"batch {size}: the endpoint made engine calls of {calls}, not one of {size}", file=sys.stderr)
                if texts != direct_texts:
                    print(f"batch {size}: the endpoint's texts differ from the direct call's", file=sys.stderr)
                if repeat:
                    direct.append(elapsed)
                    through.append(wall)
            d, e = statistics.median(direct), statistics.median(through)
            table.append((size, d, e, e - d, (e - d) / size))
    finally:
        pool.shutdown()
        trainer.shutdown()
    print(f"\n{'batch':>5} | {'direct engine (s)':>17} | {'endpoint (s)':>12} | {'overhead/batch (ms)':>19} | "
          f"{'overhead/call (ms)':>18}")
    print("-" * 84)
    for size, d, e, over, per in table:
        print(f"{size:>5} | {d:>17.4f} | {e:>12.4f} | {over * 1000:>19.1f} | {per * 1000:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
