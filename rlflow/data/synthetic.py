"""Synthetic prompt/answer tasks, embedded so the default run needs no download.

Rows follow verl's dataset layout::

    {"prompt": "123+45=", "data_source": "synthetic/add", "ability": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "168"},
     "extra_info": {"index": 0, "split": "train"}}

Train and validation rows are disjoint by construction: every problem is assigned to one split by a
hash of its prompt (``_split_of``), whatever seeds are used, and rows of a split are drawn only
from problems that belong to it. Generation is deterministic given (task, num_rows, seed, split,
task kwargs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "TASKS",
    "SyntheticTask",
    "register_task",
    "get_task",
    "make_synthetic_rows",
    "task_alphabet",
    "DEFAULT_TASK",
]

DATA_SOURCE_PREFIX = "synthetic/"

#: One problem in 1/VAL_BUCKETS goes to the held-out splits ("val", "test"); the rest to "train".
VAL_BUCKETS = 8


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    ability: str
    #: (rng, **kwargs) -> (prompt, answer)
    generate: Callable[..., tuple[str, str]]
    defaults: dict
    #: every character prompts and answers of this task can contain
    alphabet: str
    description: str = ""
    #: (prompt, answer) -> a plausible wrong answer from a systematic mistake (a "weak
    #: demonstrator"); the SFT warm start mixes these into its targets (rlflow.tiny)
    distractor: Callable[[str, str], str] | None = None
    #: (prompt, answer) -> the response a supervised target shows (a row's "response" column, what
    #: `rlflow sft` trains on); None: the answer itself
    solution: Callable[[str, str], str] | None = None

    def kwargs(self, **overrides) -> dict:
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise TypeError(
                f"unknown option(s) {sorted(unknown)} for synthetic task {self.name!r}; "
                f"known: {sorted(self.defaults)}"
            )
        return {**self.defaults, **overrides}


TASKS: dict[str, SyntheticTask] = {}


def register_task(task: SyntheticTask) -> SyntheticTask:
    if task.name in TASKS:
        raise ValueError(f"synthetic task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> SyntheticTask:
    if name.startswith(DATA_SOURCE_PREFIX):
        name = name[len(DATA_SOURCE_PREFIX):]
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown synthetic task {name!r}; known: {sorted(TASKS)}") from None


def task_alphabet(name: str) -> str:
    return get_task(name).alphabet


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    n = rng.randint(min_digits, max_digits)
    lo = 0 if n == 1 else 10 ** (n - 1)
    return rng.randint(lo, 10**n - 1)


def _gen_add(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    a = _number(rng, min_digits, max_digits)
    b = _number(rng, min_digits, max_digits)
    return f"{a}+{b}=", str(a + b)


def _gen_reverse(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str]:
    s = _digits(rng, rng.randint(min_len, max_len))
    return f"{s}>", s[::-1]


def _add_without_carry(prompt: str, answer: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    n = max(len(a), len(b))
    a, b = a.zfill(n), b.zfill(n)
    digits = "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b))
    return digits.lstrip("0") or "0"


def _gen_sort(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str]:
    s = _digits(rng, rng.randint(min_len, max_len))
    return f"{s}:", "".join(sorted(s))


register_task(
    SyntheticTask(
        name="add",
        ability="arithmetic",
        generate=_gen_add,
        defaults={"min_digits": 1, "max_digits": 3},
        alphabet="0123456789+=",
        description="a+b= -> the decimal sum",
        distractor=_add_without_carry,
    )
)
register_task(
    SyntheticTask(
        name="reverse",
        ability="string",
        generate=_gen_reverse,
        defaults={"min_len": 3, "max_len": 6},
        alphabet="0123456789>",
        description="digits> -> the digits reversed",
        distractor=lambda prompt, answer: prompt[:-1],  # copies instead of reversing
    )
)
register_task(
    SyntheticTask(
        name="sort",
        ability="string",
        generate=_gen_sort,
        defaults={"min_len": 3, "max_len": 8},
        alphabet="0123456789:",
        description="digits: -> the digits sorted ascending",
        distractor=lambda prompt, answer: answer[::-1],  # sorts descending
    )
)

register_task(
    dataclasses.replace(
        TASKS["sort"],
        name="sort_long",
        defaults={"min_len": 1024, "max_len": 1280},
        description="sort with 1024-1280 digits: responses of 1024+ tokens, for the long-sequence "
        "recipe (configs/long_sequences.yaml: packing and sequence parallelism)",
    )
)


def _gen_reverse_long_tail(rng: random.Random, min_len: int, max_len: int, long_min_len: int, long_max_len: int,
                           long_frac: float) -> tuple[str, str]:
    if rng.random() < long_frac:
        return _gen_reverse(rng, long_min_len, long_max_len)
    return _gen_reverse(rng, min_len, max_len)


register_task(
    dataclasses.replace(
        TASKS["reverse"],
        name="reverse_long_tail",
        generate=_gen_reverse_long_tail,
        defaults={"min_len": 3, "max_len": 6, "long_min_len": 40, "long_max_len": 56, "long_frac": 0.125},
        description="reverse, with one prompt in 8 of 40-56 digits: most responses short, a few long "
        "(the long tail partial rollout is for, docs/ASYNC.md; data.max_prompt_length and "
        "data.max_response_length 64)",
    )
)

from rlflow.data import word_problems as _word_problems  # noqa: E402 (plain module, no cycle)

register_task(
    SyntheticTask(
        name="word_problems",
        ability="arithmetic",
        generate=_word_problems.generate,
        solution=_word_problems.worked_solution,
        defaults=dict(_word_problems.DEFAULTS),
        alphabet=_word_problems.ALPHABET,
        description="an English word problem (add / take away, several steps) -> the final count; "
        "for a pretrained chat model (configs/smollm2_135m_word_problems.yaml)",
    )
)

#: The calculator task's tool syntax (rlflow.agents.calculator): a model turn "@<expression>" is a
#: call, answered by the observation "=<result>" ("=?" for an expression the calculator rejects);
#: any other turn is the final answer. Characters the tiny tokenizer has as single byte tokens.
CALC_CALL_PREFIX = "@"
CALC_RESULT_PREFIX = "="
CALC_ERROR = "=?"

register_task(
    SyntheticTask(
        name="calc",
        ability="tool_use",
        generate=_gen_add,
        # measured: the tiny model SFT-ed 800 steps on these sums (no tool) answers 7% of
        # validation prompts right; with the calculator, over 90%
        defaults={"min_digits": 5, "max_digits": 5},
        # prompts and answers use "0123456789+="; "@" and "?" appear in tool calls / errors
        alphabet="0123456789+=@?",
        description="a+b= with 5-digit operands, too long to add in the head of the tiny model; a "
        "multi-turn agent task: the model may call a calculator (@a+b -> =sum) before answering "
        "(rlflow.agents.calculator.CalculatorEnv)",
        distractor=_add_without_carry,
    )
)

#: The default run's task. Reverse is learnt by a tiny model in a few hundred SFT steps, so the warm
#: start can execute both the right strategy and its distractor (copying) well; RL then has to
#: pick the rewarded one. Addition with carries is far from learnt in that budget, which leaves RL
#: nothing to sharpen.
DEFAULT_TASK = "reverse"


def _split_of(task: str, prompt: str) -> str:
    h = hashlib.blake2b(f"{task}\0{prompt}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(h, "little") % VAL_BUCKETS == 0 else "train"


def _seed_for(task: str, seed: int, split: str, kwargs: dict) -> int:
    key = f"{task}\0{seed}\0{split}\0{sorted(kwargs.items())}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def make_synthetic_rows(
    task: str, num_rows: int, seed: int, split: str = "train", **task_kwargs
) -> list[dict]:
    """``num_rows`` rows of ``task`` for ``split`` ("train", "val" or "test") in verl's layout, plus
    ``response``: the target a supervised run trains on (the task's worked solution, or the answer).

    "val" and "test" draw from the same held-out problems (use different seeds for different
    sets); "train" never contains a held-out problem. Prompts are unique within the returned
    list while the problem space allows it.
    """
    spec = get_task(task)
    kwargs = spec.kwargs(**task_kwargs)
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    bucket = "train" if split == "train" else "val"
    rng = random.Random(_seed_for(spec.name, seed, split, kwargs))
    rows: list[dict] = []
    seen: set[str] = set()
    # Enough tries to fill a split ~VAL_BUCKETS times over; past that, allow repeats.
    budget = 50 * VAL_BUCKETS * max(num_rows, 1) + 1000
    tries = 0
    while len(rows) < num_rows:
        prompt, answer = spec.generate(rng, **kwargs)
        tries += 1
        if _split_of(spec.name, prompt) != bucket:
            if tries > budget * 4:
                raise RuntimeError(f"could not draw {split} problems for task {task!r}")
            continue
        if prompt in seen and tries < budget:
            continue
        seen.add(prompt)
        rows.append(
            {
                "prompt": prompt,
                "data_source": DATA_SOURCE_PREFIX + spec.name,
                "ability": spec.ability,
                "reward_model": {"style": "rule", "ground_truth": answer},
                "response": spec.solution(prompt, answer) if spec.solution else answer,
                "extra_info": {"index": len(rows), "split": split},
            }
        )
    return rows
