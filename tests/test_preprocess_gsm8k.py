import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "preprocess_gsm8k.py"

# made-up problems in GSM8K's published format
SAMPLE = [
    {
        "question": "Tom has 3 boxes with 4 pencils each. He gives away 5 pencils. How many are left?",
        "answer": "Tom has 3 * 4 = <<3*4=12>>12 pencils.\nHe has 12 - 5 = <<12-5=7>>7 left.\n#### 7",
    },
    {
        "question": "A shop sells 1,000 apples a day for 2 days. How many apples is that?",
        "answer": "1,000 * 2 = <<1000*2=2000>>2,000 apples.\n#### 2,000",
    },
    {
        "question": "Mia reads 15 pages on Monday and twice as many on Tuesday. How many pages in total?",
        "answer": "Tuesday: 15 * 2 = <<15*2=30>>30.\nTotal: 15 + 30 = <<15+30=45>>45.\n#### 45",
    },
]


def _load_script():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pre():
    return _load_script()


def _write(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_cli_writes_verl_layout(tmp_path):
    inp = _write(tmp_path / "train.jsonl", SAMPLE)
    out = tmp_path / "out" / "train.parquet"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", inp, "--output", str(out), "--split", "train"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote 3 rows" in r.stdout
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 3
    first = rows[0]
    assert first["prompt"] == [{
        "role": "user",
        "content": SAMPLE[0]["question"]
        + ' Let\'s think step by step and output the final answer after "####".',
    }]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "7"}
    assert first["extra_info"] == {
        "split": "train", "index": 0, "question": SAMPLE[0]["question"], "answer": SAMPLE[0]["answer"],
    }
    assert rows[1]["reward_model"]["ground_truth"] == "2000"  # commas removed
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    # no temp files left behind
    assert os.listdir(out.parent) == ["train.parquet"]


def test_output_loads_into_dataset_and_scores(tmp_path, pre):
    from rlflow.data.dataset import load_rows
    from rlflow.rewards import compute_score

    inp = _write(tmp_path / "test.jsonl", SAMPLE)
    out = str(tmp_path / "test.parquet")
    assert pre.main(["--input", inp, "--output", out]) == 0
    rows = load_rows([out])
    assert [r["extra_info"]["split"] for r in rows] == ["test"] * 3  # inferred from the name
    r = rows[2]
    assert compute_score(r["data_source"], "15 + 30 = 45\n#### 45", r["reward_model"]["ground_truth"]) == 1.0


def test_errors_name_the_line(tmp_path, pre, capsys):
    bad_json = _write(tmp_path / "a.jsonl", SAMPLE[:1], extra_lines=["{oops"])
    assert pre.main(["--input", bad_json, "--output", str(tmp_path / "a.parquet")]) == 1
    err = capsys.readouterr().err
    assert "line 2: not valid JSON" in err and "a.jsonl" in err
    no_marker = _write(tmp_path / "b.jsonl", SAMPLE[:2] + [{"question": "q?", "answer": "just 5"}])
    assert pre.main(["--input", no_marker, "--output", str(tmp_path / "b.parquet")]) == 1
    assert "line 3: the answer has no final '#### <number>'" in capsys.readouterr().err
    missing = _write(tmp_path / "c.jsonl", [{"question": "q?"}])
    assert pre.main(["--input", missing, "--output", str(tmp_path / "c.parquet")]) == 1
    assert "line 1: no string 'answer'" in capsys.readouterr().err
    assert pre.main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "d.parquet")]) == 2
    assert "input file not found" in capsys.readouterr().err
    # nothing was written on failure
    assert not any(p.suffix == ".parquet" or p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_atomic_write_keeps_old_file_on_failure(tmp_path, pre, monkeypatch):
    out = tmp_path / "x.parquet"
    out.write_bytes(b"old")
    import pyarrow.parquet as pq

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        pre.write_parquet_atomic([{"a": 1}], str(out))
    assert out.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.parquet"]
