"""Reward for the synthetic tasks (rlflow.data.synthetic); the English word problems are scored
by rlflow.rewards.word_problems (their final number), the others as follows.

``solution_str`` is the response as the model emitted it, decoded with special tokens skipped
(so the EOS is already gone). The answer is the text up to the first newline (a stop), stripped of
surrounding whitespace.

score = 1.0 for an exact match; otherwise partial credit, at most PARTIAL_WEIGHT (< 1), so an
exact answer always beats any wrong one:
    PARTIAL_WEIGHT * (FORMAT_SHARE * well_formed + (1 - FORMAT_SHARE) * per_char)
where ``well_formed`` means the answer is non-empty and uses only the task's answer characters,
and ``per_char`` is the fraction of positions (aligned from the right for sums, from the left
otherwise) where answer and ground truth agree, over the longer of the two. Garbage scores 0.
"""

from __future__ import annotations

__all__ = ["compute_score", "extract_answer", "PARTIAL_WEIGHT", "FORMAT_SHARE"]

PARTIAL_WEIGHT = 0.5
FORMAT_SHARE = 0.2

_ANSWER_CHARS = set("0123456789")


def extract_answer(solution_str: str) -> str:
    text = solution_str or ""
    text = text.split("\n", 1)[0]
    return text.strip()


def _per_char(answer: str, truth: str, right_align: bool) -> float:
    n = max(len(answer), len(truth))
    if n == 0:
        return 1.0
    if right_align:
        answer, truth = answer[::-1], truth[::-1]
    same = sum(1 for a, t in zip(answer, truth) if a == t)
    return same / n


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    task = str(data_source or "")
    if task.startswith("synthetic/"):
        task = task[len("synthetic/"):]
    if task == "word_problems":  # prose answers: the final number counts (rlflow.rewards.word_problems)
        from rlflow.rewards import word_problems

        return word_problems.compute_score(data_source, solution_str, ground_truth, extra_info)
    answer = extract_answer(solution_str)
    truth = str(ground_truth).strip()
    exact = answer == truth
    if exact:
        score = 1.0
    else:
        well_formed = bool(answer) and set(answer) <= _ANSWER_CHARS
        per_char = _per_char(answer, truth, right_align=(task == "add")) if well_formed else 0.0
        score = PARTIAL_WEIGHT * (FORMAT_SHARE * float(well_formed) + (1 - FORMAT_SHARE) * per_char)
    return {"score": float(score), "acc": float(exact)}
