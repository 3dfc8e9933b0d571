"""Test-only fault injection: worker subclasses passed in with PPOTrainer(worker_classes=...).

    faulty_workers("<role>:<rank>:<method>:<nth>:<action>[,<more>]")

returns {role: subclass of that role's worker} whose <rank> ("*": every rank) does <action> on
the <nth> call ("*": every call; 1-based, counted per worker, i.e. per run and rank) of <method>,
any public method of the role's worker class (rollout: generate; actor: compute_log_prob, update,
state_for_checkpoint; critic: compute_values, update, ...; reference: compute_ref_log_prob):

    exit        os._exit(17): the process dies at once, as if killed (no exception, no cleanup)
    sleep=S     sleep S seconds, then carry on (a hung worker, for timeout tests)
    raise       raise InjectedFault
    nan         (update) the loss inputs (advantages / returns) of every mini-batch become NaN
    nan=I       ... of mini-batch I only
    nan_logits  (actor, reference) every forward of the worker's model during that call returns
                NaN logits: NaN log-probs out of a no-grad forward, NaN losses and gradients in an
                update (the NaN stays in the autograd graph)
    nan_values  (critic) the same for the value model: NaN values, NaN value predictions

armable_workers({"<role>": [<method>, ...]}, arm_dir) instead lets the test's driver arm a fault on
a rank at a moment of its choosing (arm_fault: a file in arm_dir, so the driver and the workers
share one machine's disk), which fires once, at that rank's next call of the method, whichever
worker object makes it: one a recovery's restart builds, in the same or a new process, included.

Nothing of this ships: no config key or environment variable reaches it. The Ray workers cannot
import tests/, so this module is pickled by value.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import time
from collections import Counter
from typing import NamedTuple

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ACTION = re.compile(r"^(exit|raise|nan|nan_logits|nan_values|sleep=\d+(\.\d*)?|nan=\d+)$")
# the roles whose worker holds the model the action poisons (self.model)
NAN_OUTPUT_ROLES = {"nan_logits": ("actor", "reference"), "nan_values": ("critic",)}


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
        if not ACTION.match(fault.action):
            raise ValueError(f"fault {item!r}: unknown action {fault.action!r}")
        if (fault.action == "nan" or fault.action.startswith("nan=")) and fault.method != "update":
            raise ValueError(f"fault {item!r}: {fault.action} poisons the shards of an update; use it on update")
        if fault.action in NAN_OUTPUT_ROLES and fault.role not in NAN_OUTPUT_ROLES[fault.action]:
            raise ValueError(f"fault {item!r}: {fault.action} is for the {' / '.join(NAN_OUTPUT_ROLES[fault.action])} "
                             "worker's model")
        if not all(value == "*" or value.isdigit() for value in (fault.rank, fault.nth)):
            raise ValueError(f"fault {item!r}: rank and nth are numbers or '*'")
        faults.append(fault)
    return tuple(faults)


class FaultInjection:
    """Mixin: counts this process's calls of each faulted method and does the matching faults."""

    FAULTS: tuple[Fault, ...] = ()
    ARM_DIR: str | None = None  # armable_workers: where arm_fault's faults wait

    def _fault(self, method: str) -> str | None:
        calls = self.__dict__.setdefault("_fault_calls", Counter())
        calls[method] += 1
        armed = None if self.ARM_DIR is None else _take_armed(self.ARM_DIR, self.role, self.rank, method)
        if armed is not None:
            action, record = armed
            if record:
                with open(record, "w") as f:
                    f.write(repr(time.time()))
            self._do(Fault(self.role, str(self.rank), method, "*", action), calls[method])
        for fault in self.FAULTS:
            if fault.method != method or fault.rank not in ("*", str(self.rank)):
                continue
            if fault.nth not in ("*", str(calls[method])):
                continue
            return self._do(fault, calls[method])
        return None

    def _do(self, fault: Fault, call: int) -> str | None:
        if fault.action == "exit":
            os._exit(17)
        if fault.action.startswith("sleep="):
            time.sleep(float(fault.action.split("=", 1)[1]))
            return None
        if fault.action == "raise":
            raise InjectedFault(f"injected fault: {self.role} rank {self.rank}, call {call} of {fault.method}")
        return fault.action  # nan / nan=I / nan_logits / nan_values: the wrapper poisons


def _armed_file(arm_dir: str, role: str, rank: int, method: str) -> str:
    return os.path.join(arm_dir, f"{role}-{rank}-{method}.json")


def arm_fault(arm_dir: str, role: str, rank: int, method: str, action: str, record: str | None = None) -> None:
    """The next call of `method` on `role` rank `rank`, by any worker object of an
    armable_workers(..., arm_dir) class, does `action` (exit / sleep=S / raise), once (the call
    takes the file); `record`: a file the worker writes time.time() to just before (when the fault
    happened, for timings)."""
    if not ACTION.match(action) or action.startswith("nan"):
        raise ValueError(f"arm_fault: {action!r} is not exit, sleep=S or raise")
    with open(_armed_file(arm_dir, role, rank, method), "w") as f:
        json.dump([action, record], f)


def _take_armed(arm_dir: str, role: str, rank: int, method: str) -> tuple[str, str | None] | None:
    path = _armed_file(arm_dir, role, rank, method)
    try:
        with open(path) as f:
            action, record = json.load(f)
    except FileNotFoundError:
        return None
    os.remove(path)
    return action, record


def _faulty_method(name: str, base_method):
    """`base_method` with the faults of `name` done first (the class's FAULTS, this process's count)."""

    @functools.wraps(base_method)
    def method(self, *args, **kwargs):
        action = self._fault(name)
        if action in NAN_OUTPUT_ROLES:
            with nan_outputs(self.model):
                return base_method(self, *args, **kwargs)
        if action:  # nan / nan=I: the first argument is the update's list of shards
            args = (poison(args[0], action),) + args[1:]
        return base_method(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def nan_outputs(model):
    """While open, every forward of `model` returns NaN logits (a causal LM's logits, or a value
    model's scores). Multiplying keeps the autograd graph: a backward through them gives NaN
    gradients, as a real overflow would."""

    def hook(module, inputs, output):
        output.logits = output.logits * float("nan")
        return output

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


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


def armable_workers(methods: dict[str, list[str]], arm_dir: str) -> dict[str, type]:
    """{role: a subclass of the role's worker} whose listed methods take a fault the driver arms
    (arm_fault, in arm_dir) at a moment it chooses: at a given step, once."""
    from controllers.roles import default_worker_classes

    defaults = default_worker_classes()
    classes = {}
    for role, names in methods.items():
        base = defaults[role]
        body = {"FAULTS": (), "ARM_DIR": arm_dir, "__module__": __name__}
        for name in names:
            body[name] = _faulty_method(name, getattr(base, name))
        classes[role] = type(f"Armable{base.__name__}", (FaultInjection, base), body)
    return classes


def faulty_workers(spec: str) -> dict[str, type]:
    """{role: a FaultInjection subclass of the role's worker} for the roles the spec names; each
    faulted method is wrapped (the others are the base class's)."""
    from controllers.roles import default_worker_classes

    faults = parse(spec)
    defaults = default_worker_classes()
    classes = {}
    for role in dict.fromkeys(fault.role for fault in faults):
        if role not in defaults:
            raise ValueError(f"fault on role {role!r}: the roles are {', '.join(defaults)}")
        base = defaults[role]
        mine = tuple(f for f in faults if f.role == role)
        body = {"FAULTS": mine, "__module__": __name__}
        for name in dict.fromkeys(f.method for f in mine):
            base_method = getattr(base, name, None)
            if name.startswith("_") or not callable(base_method):
                raise ValueError(f"fault on {role}.{name}: {base.__name__} has no such public method")
            body[name] = _faulty_method(name, base_method)
        classes[role] = type(f"Faulty{base.__name__}", (FaultInjection, base), body)
    return classes
