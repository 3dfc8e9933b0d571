"""Rule rewards by data_source, user reward files, and batch scoring with error handling.

A reward function has verl's signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict result must hold a numeric "score" (the reward); its other numeric entries are reported
as extra metrics (e.g. {"score": 0.5, "acc": 0.0}).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "compute_score",
    "known_data_sources",
    "load_custom_reward_fn",
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
        f"custom_reward_function.path (and .name) at it"
    )


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score") -> Callable:
    """Load ``name`` from the python file at ``path`` (imported as a fresh module)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        where = "is a directory" if os.path.isdir(path) else "not found"
        raise FileNotFoundError(f"custom reward function file {where}: {path}")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    mod_name = f"rlflow_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules only while it runs (dataclasses in the file need that); afterwards it is
    # left out so that cloudpickle (Ray) ships its functions by value to processes that
    # cannot import the file by that module name.
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ImportError(
            f"importing the custom reward file {path} failed: {type(e).__name__}: {e}"
        ) from e
    finally:
        sys.modules.pop(mod_name, None)
    if not hasattr(module, name):
        found = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
            and getattr(v, "__module__", None) == mod_name
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


def _as_number(value: Any) -> float | None:
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):
        try:  # 0-dim / 1-element torch or numpy arrays
            v = value.item()
        except Exception:
            return None
        return float(v) if isinstance(v, numbers.Real) else None
    return None


class RewardManager:
    """Scores a batch of decoded responses with ``fn`` (default: ``compute_score``).

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
        scores: list[float] = []
        per_sample_extras: list[dict[str, float]] = []
        num_errors = 0
        for i in range(n):
            ds = data_sources[i]
            try:
                result = self.fn(ds, responses[i], ground_truths[i], extra_infos[i])
            except Exception as e:
                num_errors += 1
                self._fail(
                    f"reward function failed on sample {i} (data_source={ds!r}): "
                    f"{type(e).__name__}: {e}",
                    e,
                )
                scores.append(0.0)
                per_sample_extras.append(None)  # zeroed: 0.0 for every extra key too
                continue
            extras: dict[str, float] = {}
            if isinstance(result, Mapping):
                score = _as_number(result.get("score"))
                if score is None:
                    raise RewardError(
                        f"reward function returned a dict without a numeric 'score' on sample "
                        f"{i} (data_source={ds!r}): keys {sorted(map(str, result))}, 'score' is "
                        f"{type(result.get('score')).__name__}"
                    )
                for k, v in result.items():
                    if k == "score":
                        continue
                    num = _as_number(v)
                    if num is not None:
                        extras[str(k)] = num
            else:
                score = _as_number(result)
                if score is None:
                    raise RewardError(
                        f"reward function returned {type(result).__name__} on sample {i} "
                        f"(data_source={ds!r}); expected a number or a dict with a numeric "
                        f"'score'"
                    )
            if not math.isfinite(score):
                num_errors += 1
                self._fail(f"reward function returned {score} on sample {i} (data_source={ds!r})")
                score = 0.0
            scores.append(score)
            per_sample_extras.append(extras)
        keys: dict[str, None] = {}
        for e in per_sample_extras:
            for k in e or ():
                keys.setdefault(k, None)
        extras_out = {
            k: [0.0 if e is None else e.get(k, math.nan) for e in per_sample_extras] for k in keys
        }
        return scores, extras_out, num_errors
