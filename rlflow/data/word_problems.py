"""Arithmetic word problems in plain English with a whole-number answer, generated locally.

One problem: a person starts with some things, then one or more steps add or take away some,
and the question asks how many there are at the end::

    Maya has 7 stickers. She buys 5 more stickers. Then she gives 3 stickers to Leo.
    How many stickers does Maya have now?                                   -> "9"

Registered as the synthetic task ``word_problems`` (rlflow.data.synthetic), so rows, seeds and the
train/val split (by a hash of the prompt) work as for the other synthetic tasks; the prompt is a
plain string that a chat model receives as one user message (``data.apply_chat_template: true``).
The reward reads the final number of the response (rlflow.rewards.word_problems).

Options (``defaults`` of the task): ``min_steps``/``max_steps`` (operations after the starting
amount), ``max_start`` (the starting amount is drawn from 2..max_start), ``max_operand`` (each
step's amount from 1..max_operand), ``ops`` ("+", "-" or "+-"). A take-away step always leaves at
least one thing (with one thing left, the step adds instead), so every problem makes sense.
"""

from __future__ import annotations

import random
import string

__all__ = ["DEFAULTS", "ALPHABET", "generate", "solve_steps", "worked_solution"]

#: The recipe's difficulty (configs/smollm2_135m_word_problems.yaml): one or two steps, small
#: numbers. The base SmolLM2-135M-Instruct answers about a fifth of them right (greedy, 64 tokens;
#: scripts/eval_smollm2.py): room to rise, and enough right answers for a reward signal.
DEFAULTS = {"min_steps": 1, "max_steps": 2, "max_start": 12, "max_operand": 9, "ops": "+-"}

#: Every character a prompt or an answer can contain.
ALPHABET = string.ascii_letters + string.digits + " .,?'"

# (name, subject pronoun, object pronoun, possessive)
_PEOPLE = [
    ("Maya", "she", "her", "her"), ("Leo", "he", "him", "his"), ("Sara", "she", "her", "her"),
    ("Omar", "he", "him", "his"), ("Emma", "she", "her", "her"), ("Noah", "he", "him", "his"),
    ("Lily", "she", "her", "her"), ("Ben", "he", "him", "his"), ("Zoe", "she", "her", "her"),
    ("Sam", "he", "him", "his"), ("Ava", "she", "her", "her"), ("Jack", "he", "him", "his"),
    ("Nina", "she", "her", "her"), ("Ravi", "he", "him", "his"), ("Mia", "she", "her", "her"),
    ("Tom", "he", "him", "his"),
]
_THINGS = ["apples", "marbles", "stickers", "pencils", "books", "cookies", "cards", "coins",
           "shells", "balloons", "stamps", "crayons", "toy cars", "oranges", "flowers", "buttons"]


def _count(n: int, things: str) -> str:
    """"1 apple", "3 apples" (every entry of _THINGS is a plural in -s)."""
    return f"{n} {things[:-1] if n == 1 else things}"

# a step's sentence: {who} (the person or a pronoun), {obj}, {other} (another person), {count}
# ("5 apples"; "5 more apples" for the additions)
_ADD = [
    "{who} buys {count}.",
    "{who} finds {count}.",
    "{other} gives {obj} {count}.",
    "{who} gets {count} from {other}.",
    "{who} wins {count}.",
]
_SUB = [
    "{who} gives {count} to {other}.",
    "{who} loses {count}.",
    "{who} sells {count}.",
    "{who} gives away {count}.",
]
_START = [
    "{name} has {count}.",
    "{name} has a bag with {count}.",
    "{name} starts the day with {count}.",
]
_QUESTION = [
    "How many {things} does {name} have now?",
    "How many {things} does {name} have at the end?",
]
_CONNECT = ["", "Then ", "After that, ", "Next, "]


def solve_steps(start: int, steps: list[tuple[str, int]]) -> int:
    total = start
    for op, n in steps:
        total = total + n if op == "+" else total - n
    return total


def generate(rng: random.Random, min_steps: int, max_steps: int, max_start: int, max_operand: int,
             ops: str) -> tuple[str, str]:
    if not set(ops) <= {"+", "-"} or not ops:
        raise ValueError(f"ops must be made of '+' and '-', got {ops!r}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if max_start < 2 or max_operand < 1:
        raise ValueError(f"need max_start >= 2 and max_operand >= 1, got {max_start}, {max_operand}")
    name, subj, obj, _ = rng.choice(_PEOPLE)
    others = [p[0] for p in _PEOPLE if p[0] != name]
    things = rng.choice(_THINGS)
    total = rng.randint(2, max_start)
    sentences = [rng.choice(_START).format(name=name, count=_count(total, things))]
    steps: list[tuple[str, int]] = []
    for i in range(rng.randint(min_steps, max_steps)):
        # at least one thing is left after taking some away
        choices = [op for op in ops if op == "+" or total >= 2] or ["+"]
        op = rng.choice(choices)
        n = rng.randint(1, max_operand) if op == "+" else rng.randint(1, min(max_operand, total - 1))
        template = rng.choice(_ADD if op == "+" else _SUB)
        count = _count(n, things).replace(" ", " more ", 1) if op == "+" else _count(n, things)
        connect = "" if i == 0 else rng.choice(_CONNECT)
        # the first step names the person again now and then; later ones use the pronoun
        who = name if (i == 0 and rng.random() < 0.5) else subj
        text = template.format(who=who, obj=obj, count=count, other=rng.choice(others))
        text = connect + text  # pronouns are lower case, names upper case: only the first letter changes
        sentences.append(text[0].upper() + text[1:])
        steps.append((op, n))
        total = solve_steps(total, [(op, n)])
    sentences.append(rng.choice(_QUESTION).format(things=things, name=name))
    return " ".join(sentences), str(total)


def worked_solution(prompt: str, answer: str) -> str:
    """The problem worked step by step, ending in the answer (an SFT target, `rlflow sft`):
    "7 + 5 = 12. 12 - 3 = 9. The answer is 9." Read back from the prompt's own sentences: the first
    number is the start; each later sentence with a number is a step, an addition when it says
    "more" (only additions do)."""
    sentences = [s for s in prompt.replace("?", ".").split(".") if s.strip()]
    numbers = [[int(w) for w in s.split() if w.isdigit()] for s in sentences]
    total = numbers[0][0]
    lines = []
    for sentence, found in zip(sentences[1:], numbers[1:]):
        if not found:
            continue
        n = found[0]
        after = total + n if " more " in f" {sentence} " else total - n
        lines.append(f"{total} {'+' if after > total else '-'} {n} = {after}.")
        total = after
    if str(total) != answer:
        raise ValueError(f"worked_solution: the steps of {prompt!r} give {total}, not {answer}")
    return " ".join(lines + [f"The answer is {answer}."])
