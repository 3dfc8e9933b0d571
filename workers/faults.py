"""Test-only fault injection, read from the environment so that it can never come from a user config.

    RLFLOW_TEST_FAULT="<role>:<rank>:<method>:<nth>:<action>[,<more>]"

makes the worker of <role> ("actor", "critic", ...) with rank <rank> ("*": every rank) do <action>
on the <nth> call ("*": every call; 1-based, counted in this process) of <method>:

    exit        os._exit(17): the process dies at once, as if killed (no exception, no cleanup)
    sleep=S     sleep S seconds, then carry on (a hung worker, for timeout tests)
    raise       raise InjectedFault
    nan         the caller fills the loss inputs (advantages / returns) of every mini-batch with NaN
    nan=I       ... of mini-batch I only

The driver forwards the variable to the workers (controllers.ppo._worker_env).
"""

from __future__ import annotations

import os
import time
from collections import Counter

ENV = "RLFLOW_TEST_FAULT"

_calls: Counter = Counter()


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str) -> list[tuple[str, str, str, str, str]]:
    items = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":", 4)
        if len(parts) != 5:
            raise ValueError(f"{ENV}: {item!r} is not role:rank:method:nth:action")
        items.append(tuple(parts))
    return items


def check(role: str, rank: int, method: str) -> str | None:
    """Count this call; do the fault configured for it. Returns a 'nan...' action for the caller."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    _calls[method] += 1
    count = _calls[method]
    for want_role, want_rank, want_method, nth, action in _parse(spec):
        if want_role != role or want_method != method:
            continue
        if want_rank != "*" and int(want_rank) != rank:
            continue
        if nth != "*" and int(nth) != count:
            continue
        if action == "exit":
            os._exit(17)
        if action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
            return None
        if action == "raise":
            raise InjectedFault(f"injected fault: {role} rank {rank}, call {count} of {method}")
        if action == "nan" or action.startswith("nan="):
            return action
        raise ValueError(f"{ENV}: unknown action {action!r}")
    return None


def poison(shards: list, action: str | None) -> list:
    """Apply a 'nan' / 'nan=I' action to a list of update shards (TensorDicts)."""
    if not action:
        return shards
    which = None if action == "nan" else int(action.split("=", 1)[1])
    out = []
    for index, shard in enumerate(shards):
        if which is None or index == which:
            shard = shard.clone()
            for key in ("advantages", "returns"):
                if key in shard.keys():
                    shard[key] = shard[key].float().fill_(float("nan"))
        out.append(shard)
    return out
