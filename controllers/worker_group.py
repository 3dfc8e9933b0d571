"""Resource pools and worker groups: N Ray actors of one role, wired with torch.distributed."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tensordict import TensorDict

from workers.process import BESIDE, RemoteWorkerProcess, calls_beside
from workers.wire import install as install_tensor_wire


# how long a new placement group waits before a set of parked processes stops to make room
ROOM_WAIT_S = 0.2


class WorkerError(RuntimeError):
    """A remote call failed; the message names the role, rank and call.

    `call` (role, rank, method) and `cause` say which call failed and how: "died" (the process is
    gone), "timeout" (it did not return in time), "raised" (it raised). `lost_worker`: a process
    died or hung, among the first failure and the failures reported with it (a rank that dies
    leaves its peers' collectives failing), which a restart of the groups can repair
    (trainer.max_failures); an exception the worker raised would be raised again. `lost_roles`:
    the roles of those processes (None: not known, any may be lost).
    """

    def __init__(self, message: str, call: CallLabel | None = None, cause: str | None = None,
                 lost_worker: bool | None = None, lost_roles: frozenset[str] | None = None):
        super().__init__(message)
        self.call, self.cause = call, cause
        self.lost_worker = cause in ("died", "timeout") if lost_worker is None else lost_worker
        if lost_roles is None:
            if not self.lost_worker:
                lost_roles = frozenset()
            elif call is not None and cause in ("died", "timeout"):
                lost_roles = frozenset([call.role])
        self.lost_roles = lost_roles


class CallLabel(NamedTuple):
    """One rank's remote call, as errors name it."""

    role: str
    rank: int
    method: str

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank}: {self.method}"


@dataclass
class ResourcePool:
    """A placement group of `num_bundles` bundles; colocated roles put rank i on bundle i.

    PACK puts the bundles on as few nodes as possible, and on more when one node cannot hold them
    all: on a cluster, a role's ranks spread over the nodes that have room (docs/CLUSTER.md, "Multi-node")."""

    num_bundles: int
    cpus_per_bundle: float
    gpus_per_bundle: int = 0
    name: str = "pool"
    timeout_s: float = 120.0

    def __post_init__(self):
        # the worker groups placed in it that still run: the last one to stop removes it
        # (RayWorkerGroup.kill), also when another run took that group from the one that made the pool
        self.num_groups = 0
        self.removed = False
        self._lock = threading.Lock()
        bundle = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_bundle:
            bundle["GPU"] = self.gpus_per_bundle
        self.pg = placement_group([dict(bundle) for _ in range(self.num_bundles)], strategy="PACK")
        # processes parked by earlier runs (IdleWorkers) never stand in the way: while the group
        # waits, they stop, least recently used first
        deadline = time.monotonic() + self.timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=min(ROOM_WAIT_S, self.timeout_s))
        while not ready and IDLE_WORKERS.stop_one():
            ready, _ = ray.wait([self.pg.ready()], timeout=ROOM_WAIT_S)
        if not ready:
            ready, _ = ray.wait([self.pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            remove_placement_group(self.pg)
            raise WorkerError(
                f"resource pool {self.name!r}: {self.num_bundles} bundles of {bundle} could not be reserved "
                f"within {self.timeout_s:.0f} s; the cluster has {ray.cluster_resources()}{_per_node()}"
            )

    def remove(self) -> None:
        with self._lock:
            removed, self.removed = self.removed, True
        if not removed:
            remove_placement_group(self.pg)

    def add_group(self) -> None:
        with self._lock:
            self.num_groups += 1

    def drop_group(self) -> None:
        with self._lock:
            self.num_groups -= 1
            unused = self.num_groups == 0
        if unused:
            self.remove()

    def remove_if_unused(self) -> None:
        """A pool no started group holds (a run that failed while starting its groups)."""
        if self.num_groups == 0:
            self.remove()


def _per_node() -> str:
    """Each node's resources, when there are several: a bundle must fit on one node."""
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    if len(nodes) < 2:
        return ""
    shown = [{k: v for k, v in res.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
             for res in nodes]
    return f" over {len(nodes)} nodes ({'; '.join(map(str, shown))}), and each bundle must fit on one node"


def get_with_timeout(futures: list, what: list, timeout_s: float,
                     timeout_key: str = "trainer.remote_timeout_s") -> list:
    """ray.get for several futures; an error or a timeout names which call on which rank.

    Returns as soon as any call fails, without waiting for the others: a dead or failed rank
    usually leaves its peers blocked in a collective until the gloo/nccl timeout, and that must
    not delay the error. Results are fetched once (they can be whole state dicts).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    label_of = dict(zip(futures, what))
    results: dict = {}
    pending = list(dict.fromkeys(futures))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for future in ready:
            try:
                results[future] = ray.get(future)
            except Exception as err:  # noqa: BLE001 - re-raised with the rank named
                raise _group_failure(label_of[future], err, pending, label_of, deadline) from err
    if pending:
        late = ", ".join(str(label_of[f]) for f in pending)
        lost = [_as_call(label_of[f]) for f in pending]
        raise WorkerError(
            f"{late} did not return within {timeout_key}={timeout_s:g} s "
            f"(waited {time.monotonic() - start:.1f} s)", call=lost[0], cause="timeout",
            lost_roles=None if None in lost else frozenset(call.role for call in lost)
        )
    return [results[f] for f in futures]


def _group_failure(label: str, err: Exception, pending: list, label_of: dict, deadline: float,
                   grace_s: float = 1.0) -> WorkerError:
    """The first failure, plus whatever other ranks report within a short grace period."""
    primary = _worker_error(label, err)
    others = []
    if pending:
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(grace_s, deadline - time.monotonic())))
        for future in ready:
            try:
                ray.get(future)
            except Exception as other:  # noqa: BLE001
                others.append(_worker_error(label_of[future], other))
    if others:
        # the rank that died is named first: its peers' collectives fail because of it
        first = next((e for e in (primary, *others) if e.cause == "died"), primary)
        rest = [str(e).splitlines()[0][:300] for e in (primary, *others) if e is not first]
        lost = [e.lost_roles for e in (primary, *others) if e.lost_worker]
        return WorkerError(f"{first}\n(then: {'; '.join(rest)})", call=first.call, cause=first.cause,
                           lost_worker=bool(lost), lost_roles=None if None in lost else frozenset().union(*lost))
    return primary


def _as_call(label) -> CallLabel | None:
    return label if isinstance(label, CallLabel) else None


def _worker_error(label, err: Exception) -> WorkerError:
    if isinstance(err, ray.exceptions.RayActorError):
        detail = " ".join(str(err).split())[:400]
        return WorkerError(f"{label}: the worker process died ({type(err).__name__}): {detail}", call=_as_call(label),
                           cause="died")
    cause = getattr(err, "cause", None) or err
    return WorkerError(f"{label} raised {type(cause).__name__}: {cause}", call=_as_call(label), cause="raised")


class RayWorkerGroup:
    """`world_size` Ray actors, one per rank, in one torch.distributed group; each process hosts a
    `worker_cls` object (workers/process.py), and a later run can host another role's in it."""

    def __init__(self, worker_cls, role: str, world_size: int, cfg, pool: ResourcePool,
                 num_cpus: float, num_gpus: float = 0.0, env: dict | None = None, num_threads: int = 1,
                 sp_size: int = 1):
        install_tensor_wire()  # batches the driver sends cross Ray as numpy buffers (workers/wire.py)
        self.world_size = world_size
        self._as_role(worker_cls, role, sp_size)
        self._set_timeouts(cfg)
        self.pool = pool
        self.num_cpus, self.num_gpus, self.env = num_cpus, num_gpus, env  # a lost group's restart takes them again
        self.killed = False
        if world_size > pool.num_bundles:
            raise WorkerError(f"{role}: {world_size} ranks do not fit a pool of {pool.num_bundles} bundles")
        self.workers = []
        for rank in range(world_size):
            options = dict(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.pg, placement_group_bundle_index=rank
                ),
                max_restarts=0,
            )
            if env:
                options["runtime_env"] = {"env_vars": dict(env)}
            self.workers.append(RemoteWorkerProcess.options(**options).remote(worker_cls, cfg, rank, world_size,
                                                                              num_threads))
        self._form_group()
        pool.add_group()  # a group that failed to form is stopped with its pool (stop_workers)

    def _as_role(self, worker_cls, role: str, sp_size: int) -> None:
        self.worker_cls = worker_cls
        self.role = role
        # ranks [g*sp, (g+1)*sp) split the sequences of data-parallel rank g (workers/sequence.py)
        self.sp_size = sp_size
        self.dp_size = self.world_size // sp_size

    def _set_timeouts(self, cfg) -> None:
        self.timeout_s = cfg.trainer.remote_timeout_s
        # spawning processes and loading models legitimately takes longer than one step's call
        self.startup_timeout_s = max(cfg.trainer.startup_timeout_s, self.timeout_s)

    def _form_group(self) -> None:
        # which node each rank landed on; a group across nodes binds its collectives to an
        # interface the other nodes reach (trainer.dist_interface, workers/base.py)
        self.node_ids = self._get(self.call_all_async("node_id"), "node_id", startup=True)
        spans_nodes = len(set(self.node_ids)) > 1
        self.network = (self._get(self.call_all_async("bind_network", spans_nodes), "bind_network", startup=True)
                        if self.world_size > 1 else [])
        # the group picks rank 0's address and a free port on its host
        self.master_addr, master_port = self._get(self.call_rank_async(0, "node_address", spans_nodes), "node_address",
                                                  ranks=[0], startup=True)[0]
        self._get(self.call_all_async("init_distributed", self.master_addr, master_port), "init_distributed",
                  startup=True)

    def release_async(self) -> list:
        """The run is over: every rank drops what it built, after the calls in flight
        (release_groups awaits them)."""
        return [w.release.remote() for w in self.workers]

    def restarted(self, cfg, num_threads: int) -> "RayWorkerGroup":
        """New processes for this group's role, in its placement group's bundles with its resources
        (after a lost worker: colocated ranks land beside the kept groups' again)."""
        return RayWorkerGroup(self.worker_cls, self.role, self.world_size, cfg, self.pool, self.num_cpus,
                              self.num_gpus, env=self.env, num_threads=num_threads, sp_size=self.sp_size)

    def reinit(self, cfg, num_threads: int, worker_cls, role: str, sp_size: int = 1) -> None:
        """The same processes as the ranks of role `role` in a new run (after release), whatever
        role they were: each builds a `worker_cls` object with `cfg`, then the process group forms again."""
        self._as_role(worker_cls, role, sp_size)
        self._set_timeouts(cfg)
        self._get([w.host.remote(worker_cls, cfg, rank, self.world_size, num_threads)
                   for rank, w in enumerate(self.workers)], "reinit", startup=True)
        self._form_group()

    def _labels(self, method: str, ranks) -> list[CallLabel]:
        return [CallLabel(self.role, r, method) for r in ranks]

    def _get(self, futures: list, method: str, ranks=None, startup: bool = False) -> list:
        ranks = list(range(len(futures))) if ranks is None else ranks
        if startup:
            return get_with_timeout(futures, self._labels(method, ranks), self.startup_timeout_s,
                                    "trainer.startup_timeout_s")
        return get_with_timeout(futures, self._labels(method, ranks), self.timeout_s)

    def _remote(self, worker, method: str):
        """The process's call of `method`, named "role.method" (Ray's dashboard and timeline); in
        its own thread for a method that runs beside the call in progress (runs_beside_calls), else
        in order."""
        options = {"name": f"{self.role}.{method}"}
        if calls_beside(self.worker_cls, method):
            options["concurrency_group"] = BESIDE
        return worker.call.options(**options)

    def call_all_async(self, method: str, *args, **kwargs) -> list:
        return [self._remote(w, method).remote(method, *args, **kwargs) for w in self.workers]

    def call_rank_async(self, rank: int, method: str, *args) -> list:
        """One rank's call, as a list of one future (for gather_ranks, gather_groups)."""
        return [self._remote(self.workers[rank], method).remote(method, *args)]

    def call_all(self, method: str, *args, **kwargs) -> list:
        return self._get(self.call_all_async(method, *args, **kwargs), method)

    def call_per_rank_async(self, method: str, per_rank_args: list[tuple]) -> list:
        return [self._remote(w, method).remote(method, *args) for w, args in zip(self.workers, per_rank_args)]

    def call_per_dp_rank_async(self, method: str, per_dp_rank_args: list[tuple]) -> list:
        """One argument tuple per data-parallel rank, given to each of its sp ranks."""
        return self.call_per_rank_async(method, [args for args in per_dp_rank_args for _ in range(self.sp_size)])

    def gather(self, futures: list, method: str, startup: bool = False) -> list:
        return self._get(futures, method, startup=startup)

    def gather_ranks(self, futures: list, method: str, ranks: list[int]) -> list:
        """Like gather, for the calls of some ranks only (errors name those ranks)."""
        return self._get(futures, method, ranks=ranks)

    # -- dp dispatch: split rows over ranks, concat results in order -------------------------------
    def dispatch_dp_async(self, method: str, td: TensorDict, *args) -> list:
        chunks = td.chunk(self.dp_size, dim=0) if self.dp_size > 1 else [td]
        if len(chunks) != self.dp_size:
            raise WorkerError(f"{self.role}.{method}: {td.batch_size[0]} rows cannot be split over {self.dp_size} ranks")
        return self.call_per_dp_rank_async(method, [(chunk, *args) for chunk in chunks])

    def collect_dp(self, futures: list, method: str) -> TensorDict:
        """The dp ranks' results in order (an sp group's ranks return the same rows: its first's)."""
        return torch.cat(self._get(futures, method)[:: self.sp_size], dim=0)

    def dispatch_dp(self, method: str, td: TensorDict, *args) -> TensorDict:
        return self.collect_dp(self.dispatch_dp_async(method, td, *args), method)

    def kill(self) -> None:
        """Stops the processes; the pool goes with the last of its groups."""
        if self.killed:
            return
        self.killed = True
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.pool.drop_group()


def all_finished(futures: list) -> bool:
    """Whether every call has returned (or failed), without waiting."""
    done, _ = ray.wait(futures, num_returns=len(futures), timeout=0, fetch_local=False)
    return len(done) == len(futures)


def release_groups(groups: dict[str, "RayWorkerGroup"], wait_s: float, lost=frozenset()) -> dict[str, "RayWorkerGroup"]:
    """{role: group} of the groups whose every rank released what it held within wait_s (after
    the calls in flight); the others stop: the roles in `lost` (None: all) at once (a dead or hung
    process), then a group with a rank that died, raised, said it cannot host another run (a vLLM
    engine) or is still busy (it may wait in a collective on a lost peer)."""
    lost = set(groups) if lost is None else lost
    stop_workers([group for name, group in groups.items() if name in lost])
    calls = {name: group.release_async() for name, group in groups.items() if name not in lost}
    pending = [future for futures in calls.values() for future in futures]
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s) if pending else ([], [])
    ready = set(ready)
    released = {}
    for name, futures in calls.items():
        try:
            released[name] = all(f in ready for f in futures) and all(ray.get(futures))
        except Exception:  # noqa: BLE001 - a rank that died or raised: the group stops
            released[name] = False
    stop_workers([groups[name] for name, ok in released.items() if not ok])
    return {name: groups[name] for name, ok in released.items() if ok}


def gather_groups(calls: list[tuple[RayWorkerGroup, list, str]], startup: bool = False) -> list[list]:
    """Calls of several groups, (group, futures of its ranks 0.., method), awaited together: calls
    that meet in one collective across groups leave the others blocked when one fails, so the
    first failure on any side is raised at once. Returns each group's results."""
    futures, labels = [], []
    for group, group_futures, method in calls:
        futures += group_futures
        labels += group._labels(method, range(len(group_futures)))
    first = calls[0][0]
    if startup:
        results = get_with_timeout(futures, labels, first.startup_timeout_s, "trainer.startup_timeout_s")
    else:
        results = get_with_timeout(futures, labels, first.timeout_s)
    out, start = [], 0
    for _, group_futures, _ in calls:
        out.append(results[start : start + len(group_futures)])
        start += len(group_futures)
    return out


class IdleWorkers:
    """The worker groups of finished runs in this driver, kept for later runs: importing torch and
    transformers costs every new process seconds of CPU, more than a small run's steps. A run parks
    its groups under keys (setup.parking_keys): one per group where the placement is only CPU
    accounting (one node, no GPUs), so a later run's role takes any group of its size, whatever role
    it was (a process hosts any role's worker: workers/process.py); else one for the whole layout,
    whose roles must stay together on their bundles (colocated GPUs, nodes). Each parked entry waits
    trainer.keep_workers_s; at most MAX_PARKED_PROCESSES wait in all (the least recently parked stop
    first), and a run whose placement group cannot be reserved stops them one entry at a time until
    it can (ResourcePool). A run that completed or failed parks the groups whose every rank released
    what it held (release_groups); a lost worker's group, and a stopped (preempted) run's, stop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._parked: list[_Parked] = []  # least recently parked first

    def park(self, parking: list, groups: dict, keep_s: float, wait_s: float, lost=frozenset()) -> bool:
        """`parking`: [(key, the roles parked under it)] covering `groups` ({role: group}). An entry
        parks when all its groups released what their run held within wait_s (release_groups; the
        roles in `lost` stop at once); the others stop here. False: nothing parked (nothing stopped
        when keep_s is 0)."""
        if not parking or keep_s <= 0:
            return False
        released = release_groups(groups, wait_s, lost)
        job_id = _job_id()
        entries = [_Parked(key, job_id, tuple(groups[name] for name in names)) for key, names in parking
                   if all(name in released for name in names)]
        parked = [group for entry in entries for group in entry.groups]
        stop_workers([group for group in released.values() if group not in parked])
        if not entries:
            return False
        for entry in entries:
            entry.timer = threading.Timer(keep_s, self._expire, args=(entry,))
            entry.timer.daemon = True
        with self._lock:
            self._parked.extend(entries)
            stopping = []
            while sum(e.num_processes for e in self._parked) > MAX_PARKED_PROCESSES:
                stopping.append(self._parked.pop(0))
        for entry in entries:
            entry.timer.start()  # an entry stopping at once cancels its own (_Parked.stop)
        for old in stopping:
            old.stop()
        return True

    def claim(self, parking: list) -> dict:
        """{role: group}: for each (key, roles) of `parking`, the groups of an entry parked under
        `key` in this Ray session (the most recently parked), in the order of `roles`; the roles
        of keys with none left are missing."""
        claimed, job_id = {}, _job_id()
        with self._lock:
            for key, names in parking:
                for entry in reversed(self._parked):
                    if entry.key == key and entry.job_id == job_id:
                        self._parked.remove(entry)
                        entry.timer.cancel()
                        claimed.update(zip(names, entry.groups))
                        break
        return claimed

    def stop_one(self) -> bool:
        """Stops the least recently parked entry; False when none waits."""
        with self._lock:
            entry = self._parked.pop(0) if self._parked else None
        if entry is None:
            return False
        entry.stop()
        return True

    def stop(self) -> None:
        while self.stop_one():
            pass

    def _expire(self, entry) -> None:
        with self._lock:
            if entry not in self._parked:
                return
            self._parked.remove(entry)
        entry.stop()


@dataclass(eq=False)
class _Parked:
    key: tuple
    job_id: str | None
    groups: tuple  # in the order of the roles parked under the key
    # set by park before the entry is visible: stops it after trainer.keep_workers_s
    timer: threading.Timer | None = None

    @property
    def num_processes(self) -> int:
        return sum(group.world_size for group in self.groups)

    def stop(self) -> None:
        self.timer.cancel()
        if self.job_id == _job_id():  # in another Ray session its processes are gone already
            stop_workers(self.groups)


def stop_workers(groups, pools=()) -> None:
    """Kills the groups' processes (each pool goes with the last of its groups), then removes those of
    `pools` that no group holds (a run that failed while starting); what is gone already is skipped."""
    for group in groups:
        try:
            group.kill()
        except Exception:  # noqa: BLE001 - already dead
            pass
    for pool in pools:
        try:
            pool.remove_if_unused()
        except Exception:  # noqa: BLE001 - already removed
            pass


def _job_id() -> str | None:
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


# how long a group that released may take (its calls in flight first, from a step that failed
# elsewhere) before it stops instead: one that waits on a lost peer's collective never finishes
RELEASE_WAIT_S = 30.0
FAILED_RUN_RELEASE_WAIT_S = 3.0  # the same at the end of a failed run, whose error waits for it
MAX_PARKED_PROCESSES = 24  # each holds its imports (~0.3 GB resident on CPU)
IDLE_WORKERS = IdleWorkers()
