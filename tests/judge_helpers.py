"""Test helpers for the judge reward (tests/test_judge.py): a parser a config names by
file.py:function, and a judge whose verdict the response can script (the pool's processes import
this module by name: the driver's sys.path goes with them)."""

from __future__ import annotations

import time

from rlflow.rewards.judge import JudgeReward


def verdict_length(verdict: str) -> float:
    """A parser that always scores: the verdict's length in characters (the tiny judge's verdicts
    are random text, which the default parser rightly refuses)."""
    return float(len(verdict))


def no_score(verdict: str):
    return None


class ScriptedJudge(JudgeReward):
    """The real judge, except for responses that script the verdict: "CANNED:<verdict>" returns
    <verdict> as the judge's, "HANG" never returns (a judge call that hangs)."""

    def verdict(self, text: str) -> str:
        if "HANG" in text:
            while True:
                time.sleep(1)
        if "CANNED:" in text:
            return text.split("CANNED:", 1)[1].split("\n", 1)[0]
        return super().verdict(text)
