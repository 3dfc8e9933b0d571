"""Test-only fault injection: worker subclasses passed in with PPOTrainer(worker_classes=...).

    faulty_workers("<role>:<rank>:<method>:<nth>:<action>[,<more>]")

returns {role: subclass of that role's worker} whose <rank> ("*": every rank) does <action> on
the <nth> call ("*": every call; 1-based, counted per worker process) of <method> (update or
compute_log_prob):

    exit        os._exit(17): the process dies at once, as if killed (no exception, no cleanup)
    sleep=S     sleep S seconds, then carry on (a hung worker, for timeout tests)
    raise       raise InjectedFault
    nan         (update) the loss inputs (advantages / returns) of every mini-batch become NaN
    nan=I       ... of mini-batch I only

Nothing of this ships: no config key or environment variable reaches it. The Ray workers cannot
import tests/, so this module is pickled by value.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from typing import NamedTuple

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ACTIONS = ("exit", "sleep=", "raise", "nan")


class InjectedFault(RuntimeError):
    pass


class Fault(NamedTuple):
    role: str
    rank: str
    method: str
    nth: str
    action: str


def parse(spec: str) -> tuple[Fault, ...]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":", 4)
        if len(parts) != 5:
            raise ValueError(f"fault {item!r} is not role:rank:method:nth:action")
        fault = Fault(*parts)
        if not fault.action.startswith(ACTIONS):
            raise ValueError(f"fault {item!r}: unknown action {fault.action!r}")
        faults.append(fault)
    return tuple(faults)


class FaultInjection:
    """Mixin: counts this process's calls of each method and does the matching faults."""

    FAULTS: tuple[Fault, ...] = ()

    def _fault(self, method: str) -> str | None:
        calls = self.__dict__.setdefault("_fault_calls", Counter())
        calls[method] += 1
        for fault in self.FAULTS:
            if fault.method != method or fault.rank not in ("*", str(self.rank)):
                continue
            if fault.nth not in ("*", str(calls[method])):
                continue
            if fault.action == "exit":
                os._exit(17)
            if fault.action.startswith("sleep="):
                time.sleep(float(fault.action.split("=", 1)[1]))
                return None
            if fault.action == "raise":
                raise InjectedFault(f"injected fault: {self.role} rank {self.rank}, call {calls[method]} of {method}")
            return fault.action  # nan / nan=I: the caller poisons its input
        return None

    def update(self, shards):
        return super().update(poison(shards, self._fault("update")))

    def compute_log_prob(self, td):
        self._fault("compute_log_prob")
        return super().compute_log_prob(td)


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


def faulty_workers(spec: str) -> dict[str, type]:
    """{role: a FaultInjection subclass of the role's worker} for the roles the spec names."""
    from controllers.ppo import default_worker_classes

    faults = parse(spec)
    defaults = default_worker_classes()
    classes = {}
    for role in dict.fromkeys(fault.role for fault in faults):
        base = defaults[role]
        classes[role] = type(f"Faulty{base.__name__}", (FaultInjection, base),
                             {"FAULTS": tuple(f for f in faults if f.role == role), "__module__": __name__})
    return classes
