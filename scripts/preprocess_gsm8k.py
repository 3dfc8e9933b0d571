#!/usr/bin/env python
"""Turn GSM8K's published jsonl (one {"question": ..., "answer": "...\\n#### 72"} per line) into
rlflow's (= verl's) prompt parquet layout.

    python scripts/preprocess_gsm8k.py --input train.jsonl --output data/gsm8k/train.parquet

Each output row::

    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    data_source   "openai/gsm8k"
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}     (commas removed: "1,200" -> "1200")
    extra_info    {"split", "index", "question", "answer"}

The output is written to a temporary file beside it and moved into place (os.replace), so an
interrupted run never leaves a half-written parquet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


class PreprocessError(ValueError):
    pass


def ground_truth_of(answer: str) -> str | None:
    """The text after the last "####" in a reference answer, stripped, commas removed."""
    if "####" not in answer:
        return None
    gt = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return gt or None


def convert_records(lines, split: str, source: str = "<input>") -> list[dict]:
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PreprocessError(f"{source}, line {lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(rec, dict):
            raise PreprocessError(
                f"{source}, line {lineno}: expected a JSON object, got {type(rec).__name__}"
            )
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str):
                raise PreprocessError(
                    f"{source}, line {lineno}: no string {key!r} (keys: {sorted(rec)})"
                )
        question, answer = rec["question"], rec["answer"]
        gt = ground_truth_of(answer)
        if gt is None:
            raise PreprocessError(
                f"{source}, line {lineno}: the answer has no final '#### <number>' "
                f"(answer ends with {answer[-60:]!r})"
            )
        rows.append(
            {
                "prompt": [{"role": "user", "content": question + INSTRUCTION}],
                "data_source": DATA_SOURCE,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "question": question,
                    "answer": answer,
                },
            }
        )
    if not rows:
        raise PreprocessError(f"{source}: no records (the file is empty)")
    return rows


def write_parquet_atomic(rows: list[dict], output: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(output) + "-", dir=out_dir)
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _default_split(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0].lower()
    return "test" if stem.startswith("test") else "train"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="GSM8K jsonl as published (train.jsonl / test.jsonl)")
    ap.add_argument("--output", required=True, help="parquet file to write")
    ap.add_argument(
        "--split", default=None,
        help="stored in extra_info.split (default: 'test' if the input is named test*, else 'train')",
    )
    args = ap.parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"error: input file not found: {args.input}", file=sys.stderr)
        return 2
    split = args.split or _default_split(args.input)
    try:
        with open(args.input, encoding="utf-8") as f:
            rows = convert_records(f, split=split, source=args.input)
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write_parquet_atomic(rows, args.output)
    print(f"wrote {len(rows)} rows ({split}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
