"""GSM8K rule reward: the final answer after "####" (strict) or the last number (flexible).

The prompt produced by scripts/preprocess_gsm8k.py asks the model to "output the final answer
after '####'", and the ground truth is the number after "####" in GSM8K's reference answer with
thousands separators removed ("1,200" -> "1200").
"""

from __future__ import annotations

import re

__all__ = ["extract_solution", "compute_score", "normalize_number"]

# "#### " then a number: optional sign, digits with optional thousands commas and decimals
_STRICT = re.compile(r"####\s*(-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?)")
# any number in the text (signed, with optional commas / decimal part)
_ANY_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def normalize_number(text: str) -> str:
    """'1,200' -> '1200', '$ 5' -> '5', '72.' -> '72', '3.50' stays '3.50'."""
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    return s


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The model's final answer as a string without commas, or None when there is none.

    strict:   the number after the last "#### " in the text;
    flexible: the last number anywhere in the text.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str or ""
    if method == "strict":
        found = _STRICT.findall(text)
    else:
        found = _ANY_NUMBER.findall(text)
    for cand in reversed(found):
        ans = normalize_number(cand)
        if ans and ans not in ("-", "."):
            return ans
    return None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) < 1e-9
    except ValueError:
        return False


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals the ground truth (as numbers: "72.0" == "72"),
    ``format_score`` if an answer was found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    if _same_number(answer, normalize_number(ground_truth)):
        return float(score)
    return float(format_score)
