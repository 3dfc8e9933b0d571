import json
import math
import struct
import zlib

import matplotlib  # noqa: F401  (a test dependency: rlflow[loggers]; rlflow.plot imports it lazily)
import pytest

from rlflow.plot import default_panels, main, plot_run, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, n=20, extra=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, n + 1):
            rec = {
                "step": step,
                "critic/score/mean": 1 - math.exp(-step / 5),
                "critic/score/max": 1.0,
                "actor/pg_loss": math.exp(-step / 7),
                "critic/vf_loss": 0.5 * math.exp(-step / 4),
                "actor/ppo_kl": 0.001 * step,
                "timing/step": 1.5,
            }
            if step == 3:
                rec["actor/ppo_kl"] = None  # non-finite values are written as null
            rec.update(extra or {})
            f.write(json.dumps(rec) + "\n")


def _png_info(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    crc = struct.unpack(">I", data[29:33])[0]
    assert crc == zlib.crc32(data[12:29]) & 0xFFFFFFFF
    assert data.endswith(b"IEND\xaeB`\x82")
    return width, height, len(data)


def test_plot_run_default_panels(tmp_path):
    run = tmp_path / "run1"
    _write_metrics(run)
    path = plot_run(run)
    assert path == str(run / "curves.png")
    w, h, size = _png_info(path)
    assert (w, h) == (1500, 360)  # three panels side by side
    assert size > 10_000


def test_plot_run_keys_and_out_path(tmp_path):
    run = tmp_path / "run2"
    _write_metrics(run)
    out = tmp_path / "plots" / "kl.png"
    assert plot_run(run, out_path=out, keys=["actor/ppo_kl"]) == str(out)
    w, h, size = _png_info(out)
    assert (w, h) == (500, 360) and size > 5_000
    with pytest.raises(KeyError, match=r"\['nope'\].*available: \['critic/score/mean'"):
        plot_run(run, keys=["nope"])


def test_default_panels_groups():
    keys = ["critic/score/mean", "critic/score/max", "actor/pg_loss", "critic/vf_loss", "actor/ppo_kl",
            "timing/step", "actor/entropy"]
    assert default_panels(keys) == {
        "reward": ["critic/score/mean"], "loss": ["actor/pg_loss", "critic/vf_loss"], "KL": ["actor/ppo_kl"],
    }
    assert default_panels(["actor/pg_loss"]) == {"loss": ["actor/pg_loss"]}


def test_plot_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"no metrics file at .*metrics\.jsonl.*'jsonl' logger"):
        plot_run(tmp_path / "missing")
    run = tmp_path / "only_timing"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing/step": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"no reward, loss or KL metrics.*timing/step"):
        plot_run(run)
    assert main([str(tmp_path / "missing")]) == 1
    assert "no metrics file" in capsys.readouterr().err


def test_read_metrics_truncated_last_line(tmp_path):
    run = tmp_path / "run3"
    _write_metrics(run, n=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "critic/sc')  # killed mid-write
    recs = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert math.isnan(recs[2]["actor/ppo_kl"])
    assert main([str(run), "--out", str(tmp_path / "c.png")]) == 0
    _png_info(tmp_path / "c.png")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\n{oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        read_metrics(str(bad / "metrics.jsonl"))


def test_read_metrics_keeps_the_last_record_of_a_step_run_again(tmp_path):
    """A recovered (or resumed) run logs the steps after its checkpoint again: the re-run counts."""
    run = tmp_path / "again"
    run.mkdir()
    rows = [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.4), (2, 0.25), (3, 0.36), (4, 0.45), (5, 0.5)]
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "actor/pg_loss": {v}}}\n' for s, v in rows))
    recs = read_metrics(str(run / "metrics.jsonl"))
    assert [(r["step"], r["actor/pg_loss"]) for r in recs] == [(1, 0.1), (2, 0.25), (3, 0.36), (4, 0.45), (5, 0.5)]


def test_plot_from_jsonl_tracker(tmp_path):
    from rlflow.logging import make_trackers

    t = make_trackers(["jsonl"], tmp_path, 5)
    for s in range(1, 6):
        t.log({"critic/score/mean": s / 5, "actor/pg_loss": 1 / s}, s)
    t.close()
    _png_info(plot_run(tmp_path))
