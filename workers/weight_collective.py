"""Actor -> rollout weight sync through a collective (rollout.weight_sync=collective).

Actor rank 0 and every rollout rank form one process group of their own (rank 0: actor rank 0,
rank 1 + i: rollout rank i), beside whatever default group each process has: the actor's default
group is its FSDP2/DDP group, a rollout rank has its own role's or none, and torch.distributed
allows one default group per process (``dist.new_group`` only splits it). So the group is a backend built
directly on a TCPStore that actor rank 0 hosts: ``ProcessGroupGloo`` where the weights live on
CPU, ``ProcessGroupNCCL`` where they live on CUDA; the code above the backend is the same. Unlike
the shared-memory file it reaches rollout workers on other nodes.

A sync broadcasts the actor's full weights in buckets: flat tensors of one dtype, each up to
rollout.weight_sync_bucket_mb (a larger tensor gets a bucket of its own). The layout (names,
shapes, dtypes, offsets) is fixed by the first state dict and sent once at setup through Ray; a
later state dict with other names, shapes or dtypes is an error. Actor rank 0 fills two staging
buffers in turn, so copying the next bucket overlaps broadcasting the last. A rollout rank
receives into buckets it keeps (one copy of the weights, as the shared-memory mapping holds;
allocated per sync on an accelerator with rollout.sleep) and hands the engine views of them once
every bucket has arrived: the HF engine loads a whole state dict; vLLM's engine runs in the rollout
process (rollout/vllm.py from_config) and takes the views through its worker extension
(collective_rpc), so the broadcast lands in the process that holds vLLM's model (with
tensor_parallel_size > 1 vLLM passes them on to its TP workers itself).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.base import interface_ipv4, is_ip_address, ray_node_ip
from workers.trainable import resident

KEY = "rollout.weight_sync=collective"
_STORE_PREFIX = "rlflow-weight-sync"


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements from the start of its bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: str  # str(torch.dtype)
    numel: int
    entries: tuple[BucketEntry, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    buckets: tuple[Bucket, ...]

    @property
    def total_bytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    def check(self, state: dict[str, torch.Tensor]) -> None:
        """The state dict has the layout's names, shapes and dtypes (the buckets cannot change)."""
        entries = {e.name: (e.shape, b.dtype) for b in self.buckets for e in b.entries}
        if state.keys() != entries.keys():
            missing, extra = entries.keys() - state.keys(), state.keys() - entries.keys()
            raise ValueError(f"{KEY}: the state dict changed its names (missing {sorted(missing)[:5]}, "
                             f"new {sorted(extra)[:5]})")
        for name, tensor in state.items():
            if (tuple(tensor.shape), str(tensor.dtype)) != entries[name]:
                raise ValueError(f"{KEY}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the layout sent at setup "
                                 f"says {entries[name][0]} {entries[name][1]}")


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> BucketLayout:
    """Tensors grouped by dtype (in the state dict's order within a dtype), buckets of at most
    `bucket_bytes` each, a larger tensor alone in its own."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets = []
    for dtype, items in by_dtype.items():
        entries: list[BucketEntry] = []
        numel = 0
        for name, tensor in items:
            if entries and (numel + tensor.numel()) * dtype.itemsize > bucket_bytes:
                buckets.append(Bucket(str(dtype), numel, tuple(entries)))
                entries, numel = [], 0
            entries.append(BucketEntry(name, tuple(tensor.shape), numel, tensor.numel()))
            numel += tensor.numel()
        if entries:
            buckets.append(Bucket(str(dtype), numel, tuple(entries)))
    return BucketLayout(tuple(buckets))


def bucket_views(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in bucket.entries}


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class WeightSyncGroup:
    """This process's rank in the sync group: a gloo or NCCL backend on its own TCPStore, outside
    torch.distributed's default group. Gloo connects every rank when built (so all ranks build it
    at once); NCCL connects at its first collective, which `join` runs at setup."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: datetime.timedelta):
        self.store, self.rank, self.world_size, self.device = store, rank, world_size, device
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend_for(device) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor):
        """From rank 0 (actor rank 0) into every rank's `tensor`; returns the work to wait on."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.pg.broadcast([tensor], options)

    def handshake(self) -> int:
        """One small broadcast: every rank is connected (NCCL builds its communicator here)."""
        probe = torch.tensor([self.world_size if self.rank == 0 else -1], dtype=torch.int64, device=self.device)
        self.broadcast(probe).wait()
        if int(probe.item()) != self.world_size:
            raise RuntimeError(f"{KEY}: the handshake broadcast gave {int(probe.item())}, expected {self.world_size}")
        return self.world_size

    def destroy(self) -> None:
        pg, self.pg, self.store = self.pg, None, None
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a peer already gone; the process drops it anyway
                pass


def _timeout(cfg) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.trainer.remote_timeout_s)


def _store_host(cfg, spans_nodes: bool, where: str) -> str:
    """Where actor rank 0's store listens: as the default group's (trainer.dist_interface, else
    this node's IP as Ray sees it when the group spans nodes), loopback on one node."""
    setting = cfg.trainer.dist_interface
    if setting and is_ip_address(setting):
        return setting
    if setting:
        return interface_ipv4(setting, where)
    return ray_node_ip() if spans_nodes else "127.0.0.1"


def device_identity(device: torch.device) -> tuple[str, str | None]:
    """(device type, the GPU's UUID or None): NCCL cannot connect two ranks on one GPU."""
    if device.type == "cuda":
        return "cuda", str(torch.cuda.get_device_properties(device).uuid)
    return device.type, None


class _SyncMember:
    """What both sides share: the device check, the group's end with the process or the run."""

    _weight_sync_group: WeightSyncGroup | None = None

    def weight_sync_device(self) -> tuple[str, str | None]:
        return device_identity(self.device)

    def close_weight_sync(self) -> None:
        group = self.__dict__.pop("_weight_sync_group", None)
        if group is not None:
            group.destroy()

    def shutdown(self) -> None:
        self.close_weight_sync()
        super().shutdown()


class CollectiveWeightSender(_SyncMember):
    """The actor's side (a base of workers.actor.ActorWorker)."""

    @resident
    def open_weight_sync(self, world_size: int, spans_nodes: bool, bucket_bytes: int) -> dict | None:
        """Every actor rank calls (the full state is a collective under FSDP2). Rank 0 plans the
        buckets, starts the group's store and returns {host, port, layout}; the others None."""
        state = self._weights_to_publish()
        if self.rank != 0:
            return None
        self.close_weight_sync()
        layout = plan_buckets(state, bucket_bytes)
        host = _store_host(self.cfg, spans_nodes, f"the node of actor rank 0 (IP {ray_node_ip()})")
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=_timeout(self.cfg))
        self._weight_sync_pending = (store, world_size, layout, spans_nodes)
        return {"host": host, "port": store.port, "layout": layout}

    def join_weight_sync(self) -> int:
        """Actor rank 0, beside every rollout rank's join_weight_sync."""
        store, world_size, layout, spans_nodes = self.__dict__.pop("_weight_sync_pending")
        self.bind_network(spans_nodes)  # the interface gloo binds (trainer.dist_interface), as for the default group
        self._weight_sync_layout = layout
        # two buffers of the largest bucket, used in turn; a bucket is a typed view of one
        largest = max((bucket.nbytes for bucket in layout.buckets), default=0)
        self._weight_sync_staging = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._weight_sync_group = WeightSyncGroup(store, 0, world_size, self.device, _timeout(self.cfg))
        return self._weight_sync_group.handshake()

    @resident
    def send_weights(self) -> int:
        """Every actor rank calls (a collective under FSDP2); rank 0 broadcasts, beside every
        rollout rank's receive_weights. Returns the bytes sent (0 on the other ranks)."""
        state = self._weights_to_publish()
        if self.rank != 0:
            return 0
        group, layout = self._weight_sync_group, self._weight_sync_layout
        if group is None:
            raise RuntimeError(f"{KEY}: actor rank 0 is not in a weight-sync group (open_weight_sync first)")
        layout.check(state)
        in_flight = [None, None]
        with torch.no_grad():
            for index, bucket in enumerate(layout.buckets):
                slot = index % 2
                if in_flight[slot] is not None:
                    in_flight[slot].wait()  # the buffer is free again
                flat = self._weight_sync_staging[slot][: bucket.nbytes].view(bucket.torch_dtype)
                for name, view in bucket_views(flat, bucket).items():
                    view.copy_(state[name])
                in_flight[slot] = group.broadcast(flat)
            for work in in_flight:
                if work is not None:
                    work.wait()
        return layout.total_bytes


class CollectiveWeightReceiver(_SyncMember):
    """A rollout rank's side (a base of workers.rollout.worker.RolloutWorker)."""

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, layout: BucketLayout,
                         spans_nodes: bool) -> int:
        """Beside actor rank 0's join_weight_sync."""
        self.close_weight_sync()
        self.bind_network(spans_nodes)  # a rollout rank alone in its role's group never bound one
        self._weight_sync_layout = layout
        # kept for the process's life, except on an accelerator with rollout.sleep: there they
        # would hold a copy of the weights in the memory the sleeping engine frees for training
        keep = not (self.cfg.rollout.sleep and self.device.type != "cpu")
        self._weight_sync_buckets = self._new_buckets() if keep else None
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=_timeout(self.cfg))
        self._weight_sync_group = WeightSyncGroup(store, rank, world_size, self.device, _timeout(self.cfg))
        return self._weight_sync_group.handshake()

    def _new_buckets(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        layout = self._weight_sync_layout
        flats = [torch.empty(b.numel, dtype=b.torch_dtype, device=self.device) for b in layout.buckets]
        views = {name: view for flat, bucket in zip(flats, layout.buckets)
                 for name, view in bucket_views(flat, bucket).items()}
        return flats, views

    def receive_weights(self) -> int:
        """Every bucket from actor rank 0, then one load of the whole state into the engine (it
        copies out of the views). Returns the bytes received."""
        group = self._weight_sync_group
        if group is None:
            raise RuntimeError(f"{KEY}: rollout rank {self.rank} is not in a weight-sync group "
                               "(join_weight_sync first)")
        flats, views = self._weight_sync_buckets or self._new_buckets()
        for work in [group.broadcast(flat) for flat in flats]:
            work.wait()
        if self.device.type == "cuda":
            # wait() orders only this stream after NCCL's; the engine may read from another (vLLM's TP workers)
            torch.cuda.current_stream(self.device).synchronize()
        self.load_weights(views)
        return self._weight_sync_layout.total_bytes
