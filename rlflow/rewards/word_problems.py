"""Reward for the English word problems (rlflow.data.word_problems): the response's final number.

A chat model answers in prose ("Leo has 11 + 3 = 14 cookies."), so the answer is read as:
1. the last number that follows an explicit final-answer marker: "answer is 14", "Answer: 14",
   "answer: **14**", "#### 14", "\\boxed{14}";
2. otherwise the last number anywhere in the text, digits ("14", "1,200", "14.0") or words
   ("fourteen", "twenty-one"). An intermediate result ("11 + 9 = 20, so he has 14") is not taken
   for the answer: the last number is.
score = acc = 1.0 when that number equals the ground truth (as numbers: "14.0" == "14"), else 0.0
(no number at all: 0.0).
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_answer", "words_to_number"]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_MARKED = re.compile(
    r"(?:answer\s*(?:is|:|=)|####|\\boxed\{)\s*\**\s*\$?\s*(" + _NUMBER + r")",
    re.IGNORECASE,
)

_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_WORD_VALUE = {w: i for i, w in enumerate(_UNITS)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
_WORD_NUMBER = (r"\b(?:(?:" + "|".join(_TENS) + r")(?:[- ](?:" + "|".join(_UNITS[1:10]) + r"))?|"
                + "|".join(sorted(_UNITS, key=len, reverse=True)) + r")\b")
_ANY = re.compile(r"(" + _NUMBER + r")|(" + _WORD_NUMBER + r")", re.IGNORECASE)


def words_to_number(text: str) -> int | None:
    """"fourteen" -> 14, "twenty-one" / "twenty one" -> 21; None for anything else."""
    parts = re.split(r"[- ]", text.strip().lower())
    if not parts or any(p not in _WORD_VALUE for p in parts):
        return None
    if len(parts) == 1:
        return _WORD_VALUE[parts[0]]
    if len(parts) == 2 and parts[0] in _TENS and 1 <= _WORD_VALUE[parts[1]] <= 9:
        return _WORD_VALUE[parts[0]] + _WORD_VALUE[parts[1]]
    return None


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(solution_str: str) -> float | None:
    """The response's final answer as a number, or None when it holds no number."""
    text = solution_str or ""
    marked = [_to_float(m) for m in _MARKED.findall(text)]
    marked = [m for m in marked if m is not None]
    if marked:
        return marked[-1]
    for digits, words in reversed(_ANY.findall(text)):
        value = _to_float(digits) if digits else words_to_number(words)
        if value is not None:
            return float(value)
    return None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    answer = extract_answer(solution_str)
    truth = _to_float(str(ground_truth).strip())
    correct = answer is not None and truth is not None and abs(answer - truth) < 1e-9
    return {"score": float(correct), "acc": float(correct)}
