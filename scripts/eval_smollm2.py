"""The base SmolLM2-135M-Instruct's accuracy on the word-problem task's validation split.

    python scripts/eval_smollm2.py                       # greedy, the recipe's val rows and lengths
    python scripts/eval_smollm2.py --temperature 0.7      # sampled, as the recipe's rollout samples
    python scripts/eval_smollm2.py --num 64 max_steps=1   # another difficulty (task options)
    python scripts/eval_smollm2.py --model outputs/.../hf # a trained policy (a HF folder)

Prompts go through the chat template exactly as the recipe's dataset does (one user message,
generation prompt), responses are scored by the recipe's reward (the final number). Nothing is
downloaded: the model is the converted folder (``rlflow convert smollm2``; converted here if
missing).
"""

from __future__ import annotations

import argparse
import sys
import time


def _task_kwargs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = value if key == "ops" else int(value)
    return out


def evaluate(model, tok, rows, *, max_new_tokens: int, batch_size: int, do_sample: bool = False,
             temperature: float = 1.0, seed: int = 0) -> tuple[float, list[tuple[str, str, float]]]:
    import torch

    from rlflow.rewards import compute_score

    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    results = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(rows), batch_size):
            enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature if do_sample else None, top_k=0 if do_sample else None,
                                 top_p=1.0 if do_sample else None, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for row, answer in zip(rows[i:i + batch_size], answers):
                acc = compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"])["acc"]
                results.append((row["prompt"], answer, acc))
    return sum(r[2] for r in results) / max(len(results), 1), results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task_options", nargs="*", help="word_problems options, e.g. max_steps=1 max_operand=5")
    ap.add_argument("--model", default=None, help="a HF folder (default: the converted SmolLM2-135M)")
    ap.add_argument("--num", type=int, default=128, help="validation prompts (the recipe validates on 128)")
    ap.add_argument("--seed", type=int, default=0, help="data.seed (the recipe's: 0)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the recipe's data.max_response_length")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    ap.add_argument("--show", type=int, default=4, help="print this many prompts and answers")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.data.synthetic import make_synthetic_rows
    from rlflow.models.smollm2 import MissingDependencyError, model_path

    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        path = args.model or model_path()
    except MissingDependencyError as err:
        print(f"eval_smollm2: {err}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = make_synthetic_rows("word_problems", args.num, args.seed, split="val", **_task_kwargs(args.task_options))
    t0 = time.time()
    acc, results = evaluate(model, tok, rows, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            do_sample=args.temperature > 0, temperature=args.temperature or 1.0)
    for prompt, answer, ok in results[: args.show]:
        print(f"--- {'right' if ok else 'wrong'}\n{prompt}\n>>> {answer!r}")
    mode = f"sampled (T={args.temperature:g})" if args.temperature > 0 else "greedy"
    print(f"word_problems {args.task_options or 'defaults'}: {mode} accuracy {acc:.3f} "
          f"({int(round(acc * len(rows)))}/{len(rows)}), {args.max_new_tokens} new tokens, {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
