"""The in-memory Python API: RLFlow(cfg, train_dataset=rows, val_dataset=rows, reward_fn=fn).

Rows in memory and a Python callable score exactly as the same rows in a parquet file and the same
function in a reward file; a closure goes to the reward processes by value; bad rows and an
unpicklable reward_fn fail before Ray starts, naming what is wrong."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import tiny_overrides
from controllers.ppo import PPOTrainer
from rlflow import RLFlow, load_config
from rlflow.data.dataset import rows_from
from rlflow.data.synthetic import make_synthetic_rows

TASK = "reverse"
# the reward file of the parquet run: the same function as the closure below, with BONUS inlined
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = float(str(ground_truth).strip() in solution_str)
    return {"score": 0.25 + hit + 0.01 * len(solution_str) + 0.001 * extra_info["index"], "acc": hit}
'''


def _rows(n, split="train"):
    rows = make_synthetic_rows(TASK, n, 0, split=split)
    for i, row in enumerate(rows):
        row["extra_info"] = {"index": i}
    return rows


def _make_reward():
    bonus = 0.25  # captured: the function is a closure, pickled by value

    def my_reward(data_source, solution_str, ground_truth, extra_info=None):
        hit = float(str(ground_truth).strip() in solution_str)
        return {"score": bonus + hit + 0.01 * len(solution_str) + 0.001 * extra_info["index"], "acc": hit}

    return my_reward


def _cfg(model_dir, tmp_path, name, **extra):
    # GRPO: no critic process per fit (the scores and the data position do not involve it)
    return load_config(None, tiny_overrides(model_dir, **{
        "trainer.default_local_dir": str(tmp_path), "trainer.experiment_name": name, "data.max_response_length": 4,
        "algorithm.adv_estimator": "grpo", **extra}))


def _scores(history):
    return [row["reward/score_mean"] for row in history if "reward/score_mean" in row]


@pytest.mark.timeout(600)
def test_in_memory_rows_and_closure_score_as_parquet_and_reward_file(ray_session, tiny_model_dir, tmp_path):
    rows, val_rows = _rows(32), _rows(8, "val")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(val_rows), tmp_path / "val.parquet")
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    val = {"trainer.test_freq": 2}
    files = RLFlow(_cfg(tiny_model_dir, tmp_path, "files", **val, **{
        "data.train_files": f"[{tmp_path / 'train.parquet'}]", "data.val_files": f"[{tmp_path / 'val.parquet'}]",
        "reward.custom_function.path": str(tmp_path / "reward.py")})).fit()
    snapshot = json.dumps(rows)
    memory = {}
    for workers in (2, 0):
        memory[workers] = RLFlow(_cfg(tiny_model_dir, tmp_path, f"memory{workers}", **val,
                                      **{"reward.num_workers": workers}),
                                 train_dataset=rows, val_dataset=val_rows, reward_fn=_make_reward()).fit()
    assert json.dumps(rows) == snapshot, "the caller's rows are not modified"
    expected = _scores(files)
    assert len(expected) == 2 and expected[0] > 0.25
    for workers, history in memory.items():
        assert _scores(history) == expected, f"num_workers={workers}"
        assert [r.get("val/score_mean") for r in history] == [r.get("val/score_mean") for r in files]
    assert any("val/score_mean" in r for r in files)


@pytest.mark.timeout(300)
def test_pandas_dataframe_rows(ray_session, tiny_model_dir, tmp_path):
    import pandas as pd
    rows = _rows(16)
    frame = pd.DataFrame(rows)
    assert rows_from(frame, name="train_dataset") == load_rows_like(rows)
    history = RLFlow(_cfg(tiny_model_dir, tmp_path, "pandas", **{"trainer.total_steps": 1}),
                     train_dataset=frame, reward_fn=lambda ds, sol, gt, extra_info=None: float(len(sol) > 0)).fit()
    assert len(history) == 1 and history[0]["reward/score_mean"] in (0.0, 1.0)
    assert not any(k.startswith("val/") for k in history[0])  # train_dataset without val_dataset: no validation


def load_rows_like(rows):
    """The rows as the parquet path reads them."""
    return pa.Table.from_pylist(rows).to_pylist()


def test_datasets_like_objects_and_plain_iterables():
    rows = _rows(4)

    class FakeDataset:  # duck-typed datasets.Dataset: column_names + to_list()
        column_names = list(rows[0])

        def to_list(self):
            return [dict(r) for r in rows]

    assert rows_from(FakeDataset()) == rows
    assert rows_from(iter(rows)) == rows
    assert rows_from(pa.Table.from_pylist(rows)) == load_rows_like(rows)


def _no_ray(monkeypatch):
    """RLFlow(...) raises in its constructor: nothing starts Ray (this would fail the test)."""
    import controllers.cluster

    def ensure_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(controllers.cluster, "ensure_ray", ensure_ray)


def test_a_missing_column_names_the_row_and_column_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch):
    _no_ray(monkeypatch)
    rows = _rows(8)
    del rows[3]["data_source"]
    cfg = _cfg(tiny_model_dir, tmp_path, "bad")
    with pytest.raises(ValueError, match=r"train_dataset \(rows given in memory\), row 3: column 'data_source' is missing"):
        RLFlow(cfg, train_dataset=rows)
    rows = _rows(8)
    rows[5]["reward_model"] = {"style": "rule"}
    with pytest.raises(ValueError, match=r"val_dataset \(rows given in memory\), row 5: column 'reward_model' must be a dict"):
        RLFlow(cfg, val_dataset=rows)
    with pytest.raises(TypeError, match="train_dataset: expected rows in memory"):
        RLFlow(cfg, train_dataset="train.parquet")
    import pandas as pd
    with pytest.raises(ValueError, match=r"train_dataset \(rows given in memory\): missing required column 'prompt'"):
        RLFlow(cfg, train_dataset=pd.DataFrame(_rows(4)).drop(columns=["prompt"]))


def test_an_unpicklable_reward_fn_fails_clearly_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch):
    _no_ray(monkeypatch)
    lock = threading.Lock()

    def locked_reward(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            return 0.0

    with pytest.raises(TypeError, match=r"reward_fn .*locked_reward.* cannot be pickled.*reward.num_workers=0"):
        RLFlow(_cfg(tiny_model_dir, tmp_path, "lock", **{"reward.num_workers": 2}), train_dataset=_rows(8),
               reward_fn=locked_reward)
    # in the driver it needs no pickling
    PPOTrainer(_cfg(tiny_model_dir, tmp_path, "lock0", **{"reward.num_workers": 0}), reward_fn=locked_reward)
    with pytest.raises(TypeError, match="reward_fn must be a callable"):
        RLFlow(_cfg(tiny_model_dir, tmp_path, "x"), reward_fn="reward.py")


def test_a_reward_fn_over_a_configured_reward_file_warns(tiny_model_dir, tmp_path, capsys):
    PPOTrainer(_cfg(tiny_model_dir, tmp_path, "both", **{"reward.custom_function.path": "my_reward.py"}),
               reward_fn=_make_reward())
    assert "reward_fn replaces reward.custom_function.path=my_reward.py" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_resume_with_in_memory_rows(ray_session, tiny_model_dir, tmp_path, capfd):
    rows = _rows(32)
    reward = _make_reward()
    extra = {"trainer.total_steps": 3, "trainer.save_freq": 1, "trainer.resume_mode": "disable"}
    full_cfg = _cfg(tiny_model_dir, tmp_path, "full", **extra)
    full = RLFlow(full_cfg, train_dataset=rows, reward_fn=reward).fit()
    # a new fit that resumes from the full run's checkpoint after 2 steps
    step_2 = tmp_path / full_cfg.trainer.project_name / "full" / "checkpoints" / "step_2"
    resumed = RLFlow(_cfg(tiny_model_dir, tmp_path, "resumed", **{**extra, "trainer.resume_mode": str(step_2)}),
                     train_dataset=rows, reward_fn=reward).fit()
    assert "(step 2)" in capfd.readouterr().err  # "rlflow: resumed from .../step_2 (step 2)"
    assert [r["step"] for r in resumed] == [1, 2, 3]  # the history of the resumed run includes steps 1-2
    # step 3 drew the same prompts from the in-memory rows (the loader's position was restored)
    assert _scores(resumed)[-1] == _scores(full)[-1]
