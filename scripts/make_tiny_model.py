#!/usr/bin/env python
"""Build the tiny Qwen2 model folder of the default run, optionally warm-started by SFT.

    python scripts/make_tiny_model.py --out DIR [--task reverse] [--no-sft] [--sft-steps N]

Without --no-sft the warm start is taken from (or trained into) the rlflow cache
($RLFLOW_CACHE, default ~/.cache/rlflow) and copied to DIR. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from rlflow import tiny
    from rlflow.data.synthetic import DEFAULT_TASK, TASKS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write (created; must be empty if it exists)")
    ap.add_argument("--task", default=DEFAULT_TASK, choices=sorted(TASKS))
    ap.add_argument("--no-sft", action="store_true", help="random init, no warm start")
    ap.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count")
    ap.add_argument("--cache-dir", default=None, help="warm start cache (default $RLFLOW_CACHE)")
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--num-layers", type=int, default=None)
    args = ap.parse_args(argv)

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty", file=sys.stderr)
        return 2
    model = {}
    if args.hidden_size is not None:
        model["hidden_size"] = args.hidden_size
    if args.num_layers is not None:
        model["num_layers"] = args.num_layers

    if args.no_sft:
        tiny.build_tiny_model(out, **model)
    else:
        sft = {} if args.sft_steps is None else {"steps": args.sft_steps}
        src = tiny.warm_start(args.task, cache_dir=args.cache_dir, model=model, **sft)
        shutil.copytree(src, out, dirs_exist_ok=True)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
