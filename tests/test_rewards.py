import math
import textwrap

import pytest

from rlflow.rewards import (
    RewardError,
    RewardManager,
    compute_score,
    load_custom_reward_fn,
)
from rlflow.rewards import gsm8k

# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("Total is 1,200 dollars.\n#### 1,200", "1200", "1200"),
        ("#### -5 is the answer, 8 not", "-5", "8"),
        ("The answer is 42.", None, "42"),
        ("#### 3.50", "3.50", "3.50"),
        ("#### $18", "18", "18"),
        ("step 1: 10\n#### 12\nand then #### 13", "13", "13"),
        ("no numbers at all", None, None),
        ("", None, None),
        ("#### 72.", "72", "72"),
    ],
)
def test_extract_solution(text, strict, flexible):
    assert gsm8k.extract_solution(text, method="strict") == strict
    assert gsm8k.extract_solution(text, method="flexible") == flexible


def test_extract_solution_bad_method():
    with pytest.raises(ValueError, match="strict"):
        gsm8k.extract_solution("#### 1", method="fuzzy")


def test_gsm8k_compute_score():
    assert gsm8k.compute_score("so #### 72", "72") == 1.0
    assert gsm8k.compute_score("so #### 72.0", "72") == 1.0
    assert gsm8k.compute_score("so #### 1,000", "1000") == 1.0
    assert gsm8k.compute_score("so #### 71", "72") == 0.0
    assert gsm8k.compute_score("so #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k.compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("nothing", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0


# ---------------------------------------------------------------- dispatch


def test_dispatch_by_data_source():
    assert compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert compute_score("gsm8k", "#### 4", "5") == 0.0
    with pytest.raises(ValueError) as ei:
        compute_score("my/data", "x", "y")
    msg = str(ei.value)
    assert "'my/data'" in msg and "openai/gsm8k" in msg and "synthetic/" in msg


def test_dispatch_synthetic():
    out = compute_score("synthetic/add", "12", "12")
    score = out["score"] if isinstance(out, dict) else out
    assert score == 1.0


# ---------------------------------------------------------------- custom reward files


def test_load_custom_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(textwrap.dedent("""
        from dataclasses import dataclass

        @dataclass
        class W:
            w: float = 0.5

        LIMIT = 3

        def helper(s):
            return len(s)

        def score_len(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": W().w * (solution_str == ground_truth), "len": helper(solution_str)}
    """))
    fn = load_custom_reward_fn(str(f), "score_len")
    assert fn("d", "ab", "ab") == {"score": 0.5, "len": 2}
    with pytest.raises(AttributeError) as ei:
        load_custom_reward_fn(str(f), "compute_score")
    msg = str(ei.value)
    assert "'compute_score'" in msg and str(f) in msg and "score_len" in msg and "helper" in msg
    assert "dataclass" not in msg  # only what the file itself defines
    with pytest.raises(TypeError, match=r"'LIMIT' .* is a int, not a function"):
        load_custom_reward_fn(str(f), "LIMIT")
    with pytest.raises(FileNotFoundError, match="missing_reward.py"):
        load_custom_reward_fn(str(tmp_path / "missing_reward.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ImportError, match=r"broken\.py failed: RuntimeError: boom at import"):
        load_custom_reward_fn(str(broken))


# ---------------------------------------------------------------- RewardManager


def _fn(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("bad key")
    if solution_str == "nan":
        return float("nan")
    if solution_str == "inf":
        return {"score": math.inf}
    if solution_str == "str":
        return "1.0"
    if solution_str == "dict-no-score":
        return {"acc": 1.0}
    if solution_str == "dict":
        return {"score": 0.25, "acc": 1.0, "pred": "7", "ok": True}
    return float(solution_str == ground_truth)


def test_score_batch_numbers_and_dicts():
    rm = RewardManager(_fn)
    scores, extras, errs = rm.score_batch(["a", "dict", "b"], ["x"] * 3, ["a", "z", "z"], [None] * 3)
    assert scores == [1.0, 0.25, 0.0] and errs == 0
    assert set(extras) == {"acc", "ok"}  # numeric extras only ("pred" is a string)
    assert extras["acc"][1] == 1.0 and math.isnan(extras["acc"][0]) and math.isnan(extras["acc"][2])
    # default fn = built-in dispatch
    scores, _, _ = RewardManager().score_batch(["#### 3", "#### 4"], ["gsm8k"] * 2, ["3", "3"])
    assert scores == [1.0, 0.0]


def test_score_batch_bad_types_always_raise():
    for on_error in ("raise", "zero"):
        rm = RewardManager(_fn, on_error=on_error)
        with pytest.raises(RewardError, match=r"returned str on sample 1 \(data_source='src1'\)"):
            rm.score_batch(["a", "str"], ["src0", "src1"], ["a", "a"], [None, None])
        with pytest.raises(RewardError, match=r"without a numeric 'score' on sample 0 .*'acc'"):
            rm.score_batch(["dict-no-score"], ["s"], ["a"], [None])


def test_score_batch_raising_fn():
    rm = RewardManager(_fn, on_error="raise")
    with pytest.raises(RewardError, match=r"sample 2 \(data_source='ds2'\): KeyError") as ei:
        rm.score_batch(["a", "a", "raise"], ["ds0", "ds1", "ds2"], ["a"] * 3, [None] * 3)
    assert isinstance(ei.value.__cause__, KeyError)
    rm = RewardManager(_fn, on_error="zero")
    scores, _, errs = rm.score_batch(["a", "raise", "raise"], ["d"] * 3, ["a"] * 3, [None] * 3)
    assert scores == [1.0, 0.0, 0.0] and errs == 2
    # a zeroed sample reports 0.0 for the extra metrics of the others
    scores, extras, errs = rm.score_batch(["dict", "raise"], ["d"] * 2, ["a"] * 2, [None] * 2)
    assert scores == [0.25, 0.0] and extras["acc"] == [1.0, 0.0] and errs == 1


def test_score_batch_non_finite():
    rm = RewardManager(_fn)
    with pytest.raises(RewardError, match="nan on sample 1"):
        rm.score_batch(["a", "nan"], ["d", "d"], ["a", "a"], [None, None])
    with pytest.raises(RewardError, match="inf on sample 0"):
        rm.score_batch(["inf"], ["d"], ["a"], [None])
    rm = RewardManager(_fn, on_error="zero")
    scores, _, errs = rm.score_batch(["nan", "inf", "a"], ["d"] * 3, ["a"] * 3, [None] * 3)
    assert scores == [0.0, 0.0, 1.0] and errs == 2


def test_score_batch_misc_errors():
    with pytest.raises(ValueError, match="on_error"):
        RewardManager(_fn, on_error="ignore")
    with pytest.raises(ValueError, match="2 responses"):
        RewardManager(_fn).score_batch(["a", "b"], ["d"], ["a", "b"], [None, None])
