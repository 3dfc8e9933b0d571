"""Rule rewards by data_source, user reward files, and batch scoring with error handling.

A reward function has verl's signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict result must hold a numeric "score" (the reward); its other numeric entries are reported
as extra metrics (e.g. {"score": 0.5, "acc": 0.0}). An ``async def`` function (or one returning an
awaitable) is awaited.

``RewardManager`` scores a batch in the calling process; ``rlflow.rewards.pool.RewardPool`` (the
trainer's default, ``reward.num_workers``) in a pool of Ray processes with a per-sample timeout.
Both turn each sample into an ``Outcome`` with ``evaluate`` and the outcomes into scores with the
same ``RewardManager.assemble``, so they give the same scores, extras and errors.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow.plugins import NotAPythonFile, load_file

__all__ = [
    "as_number",
    "compute_score",
    "evaluate",
    "known_data_sources",
    "load_custom_reward_fn",
    "Outcome",
    "RewardError",
    "RewardManager",
]

logger = logging.getLogger(__name__)

_GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
_SYNTHETIC_PREFIX = "synthetic/"


def known_data_sources() -> list[str]:
    return [*_GSM8K_SOURCES, _SYNTHETIC_PREFIX + "*"]


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """The built-in reward for ``data_source``: GSM8K ("openai/gsm8k", "gsm8k", strict "####"
    answer) or the synthetic tasks ("synthetic/<task>")."""
    ds = str(data_source)
    if ds in _GSM8K_SOURCES:
        from rlflow.rewards import gsm8k

        return gsm8k.compute_score(solution_str, ground_truth)
    if ds.startswith(_SYNTHETIC_PREFIX):
        from rlflow.rewards import synthetic  # lazy: only when used

        return synthetic.compute_score(ds, solution_str, ground_truth, extra_info)
    raise ValueError(
        f"no built-in reward function for data_source {data_source!r}; known: "
        f"{', '.join(known_data_sources())}. For other data, write a python file with "
        f"compute_score(data_source, solution_str, ground_truth, extra_info=None) and point "
        f"reward.custom_function.path (and .name) at it"
    )


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score") -> Callable:
    """Load ``name`` from the python file at ``path`` (run afresh as a module on every call, by
    rlflow.plugins.load_file: left out of sys.modules, so Ray ships its functions by value)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        where = "is a directory" if os.path.isdir(path) else "not found"
        raise FileNotFoundError(f"custom reward function file {where}: {path}")
    # every error is raised here, in this function: the CLI counts the loader's errors as the user's
    try:
        module = load_file(path, "rlflow_custom_reward_", once=False)
    except NotAPythonFile as e:
        raise ImportError(str(e)) from None
    except Exception as e:
        raise ImportError(
            f"importing the custom reward file {path} failed: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, name):
        found = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
        )
        raise AttributeError(
            f"{path} defines no {name!r}; callables defined there: {found or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a usable score."""


def as_number(value: Any) -> float | None:
    """A real number (int, float, bool, a numpy scalar, a 0-dim or 1-element array) as a float;
    None for anything else."""
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):
        try:  # 0-dim / 1-element torch or numpy arrays
            v = value.item()
        except Exception:
            return None
        return float(v) if isinstance(v, numbers.Real) else None
    return None


@dataclass
class Outcome:
    """One sample's result before the batch's error policy. kind:
    "ok"      the function returned ``score`` (maybe NaN/inf: an error when assembled) and ``extras``;
    "raised"  the function raised ``exc``;
    "bad"     the result has the wrong type: always an error (a bug in the function, not a bad sample);
    "timeout" it ran past reward.timeout_s and was stopped (RewardPool);
    "died"    its process died (RewardPool).
    An error's message is ``f"{what} on sample {i} (data_source=...){detail}"``."""

    kind: str
    score: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    what: str = ""
    detail: str = ""
    exc: BaseException | None = None


_loop = None  # the asyncio event loop that run_awaitable uses (started on first use)
_loop_lock = threading.Lock()


def run_awaitable(awaitable):
    """Awaits on one event loop per process, run by a background thread: it works whether or not
    the caller's thread runs a loop itself (a notebook's), and clients that bind to a loop (aiohttp,
    httpx) keep working from one sample to the next."""
    import asyncio

    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rlflow-reward-loop", daemon=True).start()

    async def wait():
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wait(), _loop).result()


def evaluate(fn: Callable, data_source, solution_str, ground_truth, extra_info=None) -> Outcome:
    """Calls ``fn`` on one sample (awaiting an awaitable result) and checks what it returned."""
    try:
        result = fn(data_source, solution_str, ground_truth, extra_info)
        if inspect.isawaitable(result):
            result = run_awaitable(result)
    except Exception as e:
        return Outcome("raised", what="reward function failed", detail=f": {type(e).__name__}: {e}", exc=e)
    if isinstance(result, Mapping):
        score = as_number(result.get("score"))
        if score is None:
            return Outcome("bad", what="reward function returned a dict without a numeric 'score'",
                           detail=f": keys {sorted(map(str, result))}, 'score' is {type(result.get('score')).__name__}")
        extras = {}
        for k, v in result.items():
            num = None if k == "score" else as_number(v)
            if num is not None:
                extras[str(k)] = num
        return Outcome("ok", score, extras)
    score = as_number(result)
    if score is None:
        return Outcome("bad", what=f"reward function returned {type(result).__name__}",
                       detail="; expected a number or a dict with a numeric 'score'")
    return Outcome("ok", score)


class RewardManager:
    """Scores a batch of decoded responses with ``fn`` (default: ``compute_score``), one sample
    after the other in this process.

    on_error="raise": a raising function or a NaN/inf score is a RewardError naming the sample;
    on_error="zero":  such a sample scores 0.0 and is counted in ``num_errors`` (the first few are
                      logged). A result of the wrong type is always an error: it is a bug in the
                      function, not a bad sample.
    """

    def __init__(self, fn: Callable | None = None, on_error: str = "raise", max_logged_errors: int = 5):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        self.fn = fn if fn is not None else compute_score
        if not callable(self.fn):
            raise TypeError(f"reward fn must be callable, got {type(self.fn).__name__}")
        self.on_error = on_error
        self.max_logged_errors = max_logged_errors
        self._logged = 0

    def _fail(self, msg: str, cause: BaseException | None = None) -> None:
        if self.on_error == "raise":
            raise RewardError(msg) from cause
        if self._logged < self.max_logged_errors:
            self._logged += 1
            logger.warning("%s; scored 0.0 (reward on_error='zero')", msg)

    def stops(self, outcome: Outcome) -> bool:
        """Whether this outcome ends the batch: nothing after it is needed (assemble raises there)."""
        if outcome.kind == "bad":
            return True
        return self.on_error == "raise" and not (outcome.kind == "ok" and math.isfinite(outcome.score))

    def outcomes(self, items: list[tuple]) -> list[Outcome]:
        """One Outcome per (data_source, solution_str, ground_truth, extra_info), in order; may stop
        after an outcome that ``stops`` the batch."""
        out = []
        for item in items:
            out.append(evaluate(self.fn, *item))
            if self.stops(out[-1]):
                break
        return out

    def close(self) -> None:
        """Releases what scoring holds (nothing here; RewardPool's processes)."""

    def score_batch(
        self,
        responses: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence | None = None,
    ) -> tuple[list[float], dict[str, list[float]], int]:
        """Returns (scores, extras, num_errors). ``extras[key]`` has one value per sample: 0.0
        for a sample zeroed after an error, NaN where a sample's result simply has no ``key``
        (only possible when the function returns different keys for different samples)."""
        n = len(responses)
        if extra_infos is None:
            extra_infos = [None] * n
        lens = {"data_sources": len(data_sources), "ground_truths": len(ground_truths),
                "extra_infos": len(extra_infos)}
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise ValueError(f"score_batch: {n} responses but lengths {bad}")
        items = list(zip(data_sources, responses, ground_truths, extra_infos))
        return self.assemble(self.outcomes(items), data_sources)

    def assemble(self, outcomes: Sequence[Outcome], data_sources: Sequence[str]) -> tuple[list[float], dict[str, list[float]], int]:
        """Applies on_error to the outcomes in sample order (the first error is the one raised)."""
        scores: list[float] = []
        per_sample_extras: list[dict[str, float] | None] = []
        num_errors = 0
        for i, (outcome, ds) in enumerate(zip(outcomes, data_sources)):
            where = f"sample {i} (data_source={ds!r})"
            if outcome.kind == "bad":
                raise RewardError(f"{outcome.what} on {where}{outcome.detail}")
            if outcome.kind == "ok" and math.isfinite(outcome.score):
                scores.append(outcome.score)
                per_sample_extras.append(outcome.extras)
                continue
            num_errors += 1
            if outcome.kind == "ok":  # NaN or inf: zeroed, its extras kept
                self._fail(f"reward function returned {outcome.score} on {where}")
                per_sample_extras.append(outcome.extras)
            else:
                self._fail(f"{outcome.what} on {where}{outcome.detail}", outcome.exc)
                per_sample_extras.append(None)  # zeroed: 0.0 for every extra key too
            scores.append(0.0)
        keys: dict[str, None] = {}
        for e in per_sample_extras:
            for k in e or ():
                keys.setdefault(k, None)
        extras_out = {
            k: [0.0 if e is None else e.get(k, math.nan) for e in per_sample_extras] for k in keys
        }
        return scores, extras_out, num_errors
