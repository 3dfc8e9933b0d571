"""Synthetic tasks (rlflow.data.synthetic) and their reward (rlflow.rewards.synthetic)."""

import pytest

from rlflow.data.synthetic import DEFAULT_TASK, TASKS, get_task, make_synthetic_rows
from rlflow.rewards.synthetic import PARTIAL_WEIGHT, compute_score


def test_registry():
    assert DEFAULT_TASK in TASKS
    assert {"add", "reverse", "sort"} <= set(TASKS)
    assert get_task("synthetic/reverse").name == "reverse"
    with pytest.raises(KeyError):
        get_task("nope")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_verl_layout(task):
    rows = make_synthetic_rows(task, 50, seed=3, split="train")
    assert len(rows) == 50
    alphabet = set(get_task(task).alphabet)
    for i, row in enumerate(rows):
        assert set(row) == {"prompt", "data_source", "ability", "reward_model", "response", "extra_info"}
        assert isinstance(row["response"], str) and row["response"].endswith(row["reward_model"]["ground_truth"]
                                                                           + ("." if task == "word_problems" else ""))
        assert isinstance(row["prompt"], str) and row["prompt"]
        assert row["data_source"] == f"synthetic/{task}"
        assert isinstance(row["ability"], str)
        assert row["reward_model"]["style"] == "rule"
        assert isinstance(row["reward_model"]["ground_truth"], str)
        assert row["extra_info"] == {"index": i, "split": "train"}
        assert set(row["prompt"] + row["reward_model"]["ground_truth"]) <= alphabet
    assert len({r["prompt"] for r in rows}) == 50


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_deterministic_and_seeded(task):
    a = make_synthetic_rows(task, 40, seed=1)
    assert a == make_synthetic_rows(task, 40, seed=1)
    assert a != make_synthetic_rows(task, 40, seed=2)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_val_disjoint(task):
    # the same seed for both splits on purpose: disjointness must not depend on seeds
    train = {r["prompt"] for r in make_synthetic_rows(task, 3000, seed=0, split="train")}
    val = make_synthetic_rows(task, 300, seed=0, split="val")
    assert all(r["extra_info"]["split"] == "val" for r in val)
    assert not train & {r["prompt"] for r in val}
    test = make_synthetic_rows(task, 100, seed=5, split="test")
    assert not train & {r["prompt"] for r in test}


def test_answers_are_correct():
    for r in make_synthetic_rows("add", 100, seed=0):
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)
    for r in make_synthetic_rows("reverse", 100, seed=0):
        assert r["reward_model"]["ground_truth"] == r["prompt"][:-1][::-1]
    for r in make_synthetic_rows("sort", 100, seed=0):
        assert r["reward_model"]["ground_truth"] == "".join(sorted(r["prompt"][:-1]))


def test_task_kwargs():
    rows = make_synthetic_rows("reverse", 100, seed=0, min_len=5, max_len=5)
    assert all(len(r["reward_model"]["ground_truth"]) == 5 for r in rows)
    with pytest.raises(TypeError):
        make_synthetic_rows("reverse", 10, seed=0, max_digits=3)
    with pytest.raises(ValueError):
        make_synthetic_rows("reverse", 10, seed=0, split="dev")


def test_distractors_are_wrong_but_plausible():
    assert get_task("add").distractor("58+67=", "125") == "15"
    assert get_task("reverse").distractor("123>", "321") == "123"
    assert get_task("sort").distractor("312:", "123") == "321"


def test_reward_exact():
    s = compute_score("synthetic/reverse", "54321", "54321")
    assert s == {"score": 1.0, "acc": 1.0}
    # surrounding whitespace and text after a newline (a stop) are ignored
    assert compute_score("synthetic/add", " 357\nmore", "357")["acc"] == 1.0


def test_reward_partial():
    near = compute_score("synthetic/reverse", "54320", "54321")
    assert near["acc"] == 0.0
    assert 0.0 < near["score"] < PARTIAL_WEIGHT
    far = compute_score("synthetic/reverse", "99999", "54321")
    assert 0.0 < far["score"] < near["score"]  # well formed but all digits wrong
    # a carry mistake in a sum is scored from the right: last digits still count
    add = compute_score("synthetic/add", "15", "125")
    assert add["acc"] == 0.0 and add["score"] > compute_score("synthetic/add", "99", "125")["score"]
    # too long (no EOS) is not exact
    assert compute_score("synthetic/reverse", "543219999", "54321")["acc"] == 0.0


@pytest.mark.parametrize("garbage", ["", "   ", "abc", "54 321", "<|pad|>", None])
def test_reward_garbage(garbage):
    s = compute_score("synthetic/reverse", garbage, "54321")
    assert s == {"score": 0.0, "acc": 0.0}


def test_reward_always_below_exact():
    for resp in ["5432", "543210", "12345", "5", "0"]:
        assert compute_score("synthetic/reverse", resp, "54321")["score"] < 1.0
