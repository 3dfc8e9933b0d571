import glob
import io
import json
import math
import os
import struct
import sys

import numpy as np
import pytest
import torch

from rlflow.logging import (
    ConsoleTracker,
    JsonlTracker,
    MultiTracker,
    Tracker,
    flatten_config,
    make_trackers,
    sanitize_metrics,
)

STEPS = [
    {"critic/score/mean": 0.1, "actor/pg_loss": 0.5, "actor/ppo_kl": 0.01, "critic/score/max": 1.0},
    {"critic/score/mean": 0.4, "actor/pg_loss": 0.3, "actor/ppo_kl": 0.02, "critic/score/max": 1.0},
    {"critic/score/mean": 0.7, "actor/pg_loss": 0.1, "actor/ppo_kl": 0.03, "critic/score/max": 1.0},
]
CONFIG = {"algorithm": {"adv_estimator": "grpo", "gamma": 1.0}, "data": {"train_batch_size": 8}}


def _log_all(trackers):
    for step, m in enumerate(STEPS, start=1):
        trackers.log(m, step)
    trackers.close()


def test_sanitize_and_flatten():
    out = sanitize_metrics({"a": 1, "b": np.float32(0.5), "c": torch.tensor(2.0), "d": "text", "e": True})
    assert out == {"a": 1.0, "b": 0.5, "c": 2.0, "e": 1.0}
    assert flatten_config(CONFIG) == {
        "algorithm.adv_estimator": "grpo", "algorithm.gamma": 1.0, "data.train_batch_size": 8,
    }


def test_make_trackers_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as ei:
        make_trackers(["console", "swanlab"], tmp_path, 3)
    msg = str(ei.value)
    assert "swanlab" in msg and "'jsonl'" in msg and "'wandb'" in msg and "'mlflow'" in msg
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"logger 'wandb' needs the 'wandb' package.*rlflow\[loggers\]"):
        make_trackers(["jsonl", "wandb"], tmp_path / "r", 3)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # checked before anything is opened


def test_jsonl_tracker(tmp_path):
    t = make_trackers("jsonl", tmp_path, 3)
    assert isinstance(t, MultiTracker) and "jsonl" in t
    t.log({"x": 1.0}, 0)
    # flushed at once: readable before close
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "x": 1.0}
    t.log({"x": float("nan"), "y": "skip me"}, 1)
    for step, m in enumerate(STEPS, start=2):
        t.log(m, step)
    t.close()
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1] == {"step": 1, "x": None}
    assert [ln["step"] for ln in lines] == [0, 1, 2, 3, 4]
    assert lines[4]["critic/score/mean"] == 0.7
    # a resumed run appends
    t2 = JsonlTracker(tmp_path)
    t2.log({"x": 2.0}, 5)
    t2.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6


def test_console_tracker_lines_and_bar():
    out = io.StringIO()
    c = ConsoleTracker(total_steps=3, progress_bar=False, file=out)
    _log_all(c)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/3 | critic/score/mean 0.1 | actor/pg_loss 0.5")
    assert "actor/ppo_kl 0.01" in lines[0] and "score/max" not in lines[0]
    # with the bar (written to the same stream): ETA and reward postfix
    out = io.StringIO()
    c = ConsoleTracker(total_steps=3, progress_bar=True, file=out, keys=["actor/pg_loss"])
    _log_all(c)
    text = out.getvalue()
    assert "3/3" in text and "reward=0.7" in text and "<" in text  # elapsed<remaining
    assert "step 2/3 | actor/pg_loss 0.3" in text and "critic/score/mean 0.4" not in text


def test_tracker_context_manager(tmp_path):
    with JsonlTracker(tmp_path) as t:
        assert isinstance(t, Tracker)
        t.log({"a": 1}, 1)
    assert t._f.closed


def test_tensorboard_tracker(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = make_trackers(["tensorboard"], tmp_path, 3, config=CONFIG)
    _log_all(t)
    files = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert len(files) == 1
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    ev = ea.Scalars("critic/score/mean")
    assert [e.step for e in ev] == [1, 2, 3]
    assert [round(e.value, 6) for e in ev] == [0.1, 0.4, 0.7]
    assert "actor/ppo_kl" in ea.Tags()["scalars"]


# ---- wandb: offline runs keep everything in the run's .wandb file (a leveldb-style log of
# protobuf Records); offline mode writes no wandb-summary.json, so read the records back.


def _wandb_records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        if kind in (1, 2):  # full / first
            pending = chunk
        else:  # middle / last
            pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def test_wandb_tracker_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "")  # no credentials: must not matter offline
    t = make_trackers(["wandb"], tmp_path, 3, project="proj", experiment="exp1", config=CONFIG)
    assert os.environ["WANDB_MODE"] == "offline"
    run_path = t["wandb"].run_path
    _log_all(t)
    assert os.path.basename(run_path).startswith("offline-run-")
    assert run_path.startswith(str(tmp_path / "wandb"))
    files = glob.glob(os.path.join(run_path, "run-*.wandb"))
    assert len(files) == 1
    records = _wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "proj" and run.display_name == "exp1"
    cfg = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert cfg["algorithm"] == CONFIG["algorithm"]
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["critic/score/mean"] for h in history] == [0.1, 0.4, 0.7]
    assert history[-1]["actor/pg_loss"] == 0.1


def test_mlflow_tracker_local(tmp_path):
    from mlflow.tracking import MlflowClient

    t = make_trackers(["mlflow"], tmp_path, 3, project="proj", experiment="exp1", config=CONFIG)
    m = t["mlflow"]
    assert m.tracking_uri == "file://" + str(tmp_path / "mlruns")
    run_id = m.run_id
    t.log({"critic/score/mean": float("inf")}, 0)  # non-finite values are skipped
    _log_all(t)
    client = MlflowClient(tracking_uri=m.tracking_uri)
    hist = client.get_metric_history(run_id, "critic/score/mean")
    assert [(h.step, round(h.value, 6)) for h in hist] == [(1, 0.1), (2, 0.4), (3, 0.7)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp1"
    assert run.data.params["algorithm.adv_estimator"] == "grpo"
    assert client.get_experiment_by_name("proj").experiment_id == m.experiment_id


def test_all_together(tmp_path):
    t = make_trackers("console,jsonl,tensorboard", tmp_path, total_steps=3, config=CONFIG)
    assert list(t.trackers) == ["console", "jsonl", "tensorboard"]
    _log_all(t)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert math.isclose(json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["actor/pg_loss"], 0.1)
