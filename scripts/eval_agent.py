#!/usr/bin/env python
"""Offline multi-turn evaluation of a model with an environment (default: the calculator task).

    python scripts/eval_agent.py [--model tiny|DIR] [--task calc] [--n 500] [--split val]
                                 [--mode both|greedy|sample] [--temperature 1.0] [--max-turns 3]

Plays one episode per row with HF generate, laid out as the agent loop does (prompt ids, then each
model turn up to and including its first EOS, then the observation's ids when the episode goes on)
and prints, per decoding mode, the accuracy (info["acc"] of the final step), the tool-use rate
(episodes with at least one call), the accuracy of episodes with and without a call, the rate of
malformed calls and of episodes that ended without an answer (max turns, or the response budget),
plus the mean probability of the tool-call token "@" as the first response token. A measurement
script; the framework does not use it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def first_token_prob(model, tok, rows, token: str, batch_size: int = 256) -> float:
    import torch

    tid = tok.encode(token, add_special_tokens=False)
    if len(tid) != 1:
        return float("nan")
    total = 0.0
    tok.padding_side = "left"
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            chunk = [r["prompt"] for r in rows[i : i + batch_size]]
            enc = tok(chunk, return_tensors="pt", padding=True)
            pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding
            logits = model(**enc, position_ids=pos).logits[:, -1, :]
            total += float(torch.softmax(logits.float(), -1)[:, tid[0]].sum())
    return total / max(len(rows), 1)


def run_episodes(model, tok, rows, env_cls, env_kwargs, *, do_sample: bool, temperature: float = 1.0,
                 max_turns: int = 3, max_response_length: int = 32, batch_size: int = 128,
                 seed: int = 0, first_prefix: str = "") -> list[dict]:
    """One episode per row; returns per-episode {"acc", "tool_calls", "bad_tool_calls", "turns",
    "answered", "texts"}. ``first_prefix`` is forced as the start of the first model turn (e.g.
    "@": what the episodes would give if the policy always chose the tool)."""
    forced = tok.encode(first_prefix, add_special_tokens=False) if first_prefix else []
    import torch

    eos, pad = tok.eos_token_id, tok.pad_token_id
    tok.padding_side = "left"
    results: list[dict] = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            eps = []
            for row in chunk:
                env = env_cls(**env_kwargs)
                first = env.reset({"ground_truth": row["reward_model"]["ground_truth"],
                                   "data_source": row["data_source"],
                                   "extra_info": row.get("extra_info", {}),
                                   "raw_prompt": row["prompt"], "source_prompt": row["prompt"]})
                ctx = list(tok(row["prompt"])["input_ids"])
                if first:
                    ctx += tok.encode(first, add_special_tokens=False)
                eps.append({"env": env, "ctx": ctx + forced, "resp": len(forced), "live": True, "acc": 0.0,
                            "tool_calls": 0, "bad_tool_calls": 0, "turns": 0, "answered": False,
                            "texts": []})
            for turn_index in range(max_turns):
                live = [e for e in eps if e["live"]]
                if not live:
                    break
                budget = max(max_response_length - e["resp"] for e in live)
                width = max(len(e["ctx"]) for e in live)
                ids = torch.full((len(live), width), pad, dtype=torch.long)
                mask = torch.zeros((len(live), width), dtype=torch.long)
                for i, e in enumerate(live):
                    ids[i, width - len(e["ctx"]):] = torch.tensor(e["ctx"])
                    mask[i, width - len(e["ctx"]):] = 1
                out = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=budget, do_sample=do_sample,
                    temperature=temperature if do_sample else None, top_k=0 if do_sample else None,
                    top_p=1.0 if do_sample else None, eos_token_id=eos, pad_token_id=pad,
                )
                for i, e in enumerate(live):
                    gen = out[i, width:].tolist()[: max_response_length - e["resp"]]
                    turn = gen[: gen.index(eos) + 1] if eos in gen else gen
                    e["ctx"] += turn
                    e["resp"] += len(turn)
                    if turn_index == 0 and forced:
                        turn = forced + turn
                    e["turns"] += 1
                    text = tok.decode(turn, skip_special_tokens=True)
                    e["texts"].append(text)
                    if not turn or turn[-1] != eos:  # ran out of response budget mid-turn
                        e["live"] = False
                        continue
                    res = e["env"].step(text)
                    if res.done:
                        e["live"] = False
                        e["answered"] = True
                        e["acc"] = float(res.info.get("acc", 0.0))
                        e["tool_calls"] = res.info.get("tool_calls", e["tool_calls"])
                        e["bad_tool_calls"] = res.info.get("bad_tool_calls", e["bad_tool_calls"])
                        continue
                    e["tool_calls"] = getattr(e["env"], "tool_calls", e["tool_calls"] + 1)
                    e["bad_tool_calls"] = getattr(e["env"], "bad_tool_calls", e["bad_tool_calls"])
                    e["texts"].append(res.observation)
                    obs = tok.encode(res.observation, add_special_tokens=False)
                    e["ctx"] += obs
                    e["resp"] += len(obs)
                    if e["resp"] >= max_response_length:
                        e["live"] = False
            for e in eps:
                e.pop("env")
                e.pop("ctx")
                e.pop("live")
                results.append(e)
    return results


def summarize(eps: list[dict]) -> dict:
    n = max(len(eps), 1)
    tool = [e for e in eps if e["tool_calls"] > 0]
    direct = [e for e in eps if e["tool_calls"] == 0]

    def mean(xs):
        return round(sum(xs) / len(xs), 4) if xs else None

    return {
        "n": len(eps),
        "acc": round(sum(e["acc"] for e in eps) / n, 4),
        "tool_use_rate": round(len(tool) / n, 4),
        "acc_with_tool": mean([e["acc"] for e in tool]),
        "acc_without_tool": mean([e["acc"] for e in direct]),
        "bad_call_rate": round(sum(e["bad_tool_calls"] > 0 for e in eps) / n, 4),
        "no_answer_rate": round(sum(not e["answered"] for e in eps) / n, 4),
        "mean_turns": round(sum(e["turns"] for e in eps) / n, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a model folder, or 'tiny': rlflow.tiny.warm_start(--task)")
    ap.add_argument("--task", default="calc")
    ap.add_argument("--env", default="rlflow.agents.calculator:CalculatorEnv")
    ap.add_argument("--env-kwargs", default="{}", help="JSON object passed to the environment")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--split", default="val", choices=["train", "val", "test"])
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--mode", default="both", choices=["both", "greedy", "sample"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-response-length", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--first-prefix", default="",
                    help="force this text as the start of the first turn, e.g. '@' (the tool's ceiling)")
    ap.add_argument("--show", type=int, default=0, help="print this many episodes of each mode")
    ap.add_argument("--sft", default="{}", help="JSON SFT options for --model tiny (rlflow.tiny.warm_start)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.agents import load_env_class
    from rlflow.data.synthetic import make_synthetic_rows

    torch.set_num_threads(args.threads)
    path = args.model
    if path == "tiny":
        from rlflow.tiny import warm_start

        t0 = time.time()
        path = warm_start(args.task, **json.loads(args.sft))
        print(f"model {path} ({time.time() - t0:.1f}s to get)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    env_cls = load_env_class(args.env)
    env_kwargs = json.loads(args.env_kwargs)
    rows = make_synthetic_rows(args.task, args.n, seed=args.data_seed, split=args.split)

    report = {"model": path, "p_first_token_@": round(first_token_prob(model, tok, rows, "@"), 4)}
    modes = ["greedy", "sample"] if args.mode == "both" else [args.mode]
    for mode in modes:
        t0 = time.time()
        eps = run_episodes(model, tok, rows, env_cls, env_kwargs, do_sample=(mode == "sample"),
                           temperature=args.temperature, max_turns=args.max_turns,
                           max_response_length=args.max_response_length,
                           batch_size=args.batch_size, seed=args.seed, first_prefix=args.first_prefix)
        report[mode] = {**summarize(eps), "seconds": round(time.time() - t0, 1)}
        for row, e in list(zip(rows, eps))[: args.show]:
            print(f"{mode}: {row['prompt']}{' | '.join(e['texts'])}  (truth "
                  f"{row['reward_model']['ground_truth']}, acc {e['acc']})")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
