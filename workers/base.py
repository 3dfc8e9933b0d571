"""Rank setup shared by every worker: torch.distributed, seeding, threads, the model wrap."""

from __future__ import annotations

import datetime
import gc
import os
import random
import socket

import torch
import torch.distributed as dist

from rlflow.config import RLFlowConfig, packs_sequences
from rlflow.plugins import import_modules
from workers.process import runs_beside_calls
from workers.sequence import NO_SEQUENCE_PARALLEL, PADDED, SequenceLayout, sequence_parallel_groups, use_packed_attention


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# -- where the process group meets (trainer.dist_interface) -------------------------------------
DIST_KEY = "trainer.dist_interface"


def is_ip_address(value: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 addresses} of this machine."""
    import psutil  # a dependency of Ray

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_ipv4(name: str, where: str) -> str:
    """The IPv4 address of network interface `name` on this machine; an error naming the key."""
    interfaces = interface_addresses()
    if name not in interfaces:
        raise ValueError(f"{DIST_KEY}={name!r}: {where} has no network interface of that name; it has "
                         f"{', '.join(sorted(interfaces)) or 'none'} (set an interface every node has, or "
                         "null: the node's IP as Ray sees it)")
    if not interfaces[name]:
        raise ValueError(f"{DIST_KEY}={name!r}: the interface has no IPv4 address on {where}")
    return interfaces[name][0]


def interface_of(ip: str) -> str | None:
    """The name of this machine's interface that holds `ip`, if any."""
    return next((name for name, addrs in interface_addresses().items() if ip in addrs), None)


def ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional here
        pass
    if deterministic:
        # cuBLAS needs this for deterministic matmuls; harmless on CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def capture_rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, python, numpy) as weights_only-loadable data."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:  # numpy is optional here
        pass
    return state


def restore_rng_state(state) -> None:
    """Inverse of capture_rng_state (a bare tensor is taken as the torch CPU state)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state((np_state["name"], np_state["keys"].numpy().astype("uint32"), np_state["pos"],
                             np_state["has_gauss"], np_state["cached_gaussian"]))


def _quiet_libraries() -> None:
    """Load reports and progress bars from every rank drown the driver's own progress output."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # we never modify model outputs in place, which is what this FSDP2 warning is about
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def fixed_worker_threads() -> int:
    """RLFLOW_WORKER_THREADS: the user's thread count for every worker process and phase (0: unset,
    the driver shares the cores out per phase: controllers/setup.py CoreShare)."""
    return int(os.environ.get("RLFLOW_WORKER_THREADS", "0") or 0)


def peak_memory_bytes(device: torch.device, reset: bool) -> int:
    """This process's peak memory since the last reset: on CUDA what torch's allocator held
    allocated; on CPU the peak resident set (VmHWM), reset through /proc/self/clear_refs (Linux)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    with open("/proc/self/status", encoding="ascii") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    if reset:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")  # 5: reset the peak resident set size to the current one
    return peak_kb * 1024


class WorkerBase:
    """One rank of a role. Ray creates it, the group then calls `init_distributed`."""

    role = "worker"
    # the config section whose use_remove_padding / sp_size lay out this role's forwards (None: padded)
    layout_section: str | None = None
    sequence_parallel = NO_SEQUENCE_PARALLEL
    layout = PADDED  # set by init_model from sequence_layout (workers/sequence.py)
    _widen_to: tuple[int, int] | None = None  # (phase, threads) from widen_threads, until the phase ends

    def __init__(self, cfg: RLFlowConfig, rank: int, world_size: int, num_threads: int = 1):
        # first: the user's modules register the losses, engines, ... this worker builds by name
        import_modules(cfg.trainer.imports)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        torch.set_num_threads(num_threads)  # the driver's share-out (controllers/setup.py CoreShare)
        self._phase, self._phase_threads, self._widen_to = 0, num_threads, None
        from workers.wire import install as install_tensor_wire

        install_tensor_wire()  # what this worker returns crosses Ray as numpy buffers (workers/wire.py)
        seed_everything(cfg.trainer.seed + rank, cfg.trainer.deterministic)
        _quiet_libraries()

    # -- called by the group --------------------------------------------------------------------
    def set_threads(self, num_threads: int, phase: int) -> None:
        """The driver's share of the cores for its phase number `phase`, about to run
        (controllers/setup.py CoreShare). A no-op in a process whose vLLM engine bound its threads."""
        self._phase, self._phase_threads, self._widen_to = phase, num_threads, None
        torch.set_num_threads(num_threads)

    @runs_beside_calls
    def widen_threads(self, num_threads: int, phase: int) -> None:
        """The phase that ran beside phase `phase` ended: the update running in it takes
        `num_threads` from its next micro-batch (runs beside the call, in its own thread)."""
        self._widen_to = (phase, num_threads)

    def _widen_if_told(self) -> None:
        """Between micro-batches, in the computing thread (a thread count is per thread)."""
        told = self._widen_to
        if told is not None and told[0] == self._phase and torch.get_num_threads() != told[1]:
            torch.set_num_threads(told[1])

    def _end_widening(self) -> None:
        if self._widen_to is not None:
            self._widen_to = None
            torch.set_num_threads(self._phase_threads)

    def bind_network(self, spans_nodes: bool) -> dict:
        """Before init_distributed, on every rank of a group of several: the network interface the
        collectives use. An interface named by trainer.dist_interface becomes GLOO_SOCKET_IFNAME and
        NCCL_SOCKET_IFNAME; otherwise, in a group that spans nodes, gloo binds the interface that
        holds this node's IP as Ray sees it (unless GLOO_SOCKET_IFNAME is set): gloo's default, the
        address the host name resolves to, is often a loopback address (127.0.1.1 in /etc/hosts)
        that the other nodes cannot reach. NCCL picks its interface itself unless configured."""
        setting = self.cfg.trainer.dist_interface
        node_ip = ray_node_ip()
        if setting and not is_ip_address(setting):
            interface_ipv4(setting, f"the node {node_ip} of {self.role} rank {self.rank}")  # it exists here
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = setting
        elif spans_nodes and self.device.type == "cpu" and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = interface_of(node_ip)
            if interface:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        return {"node_ip": node_ip, "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
                "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}

    def node_address(self, spans_nodes: bool = False) -> tuple[str, int]:
        """Where rank 0 listens for the process group: a host and the port its store listens on.

        The store listens from here on (the OS picks the port), so no other process can take the
        port between this call and init_distributed, as one could with a port only found free.

        trainer.dist_interface: an interface name -> its IPv4 address on this node; an IP -> that
        IP (it must be this node's); null -> this node's IP as Ray sees it when the group spans
        nodes, else (one node) loopback on CPU and the host name's address on GPU, as always."""
        setting = self.cfg.trainer.dist_interface
        if self.world_size == 1:  # no process group forms (init_distributed)
            return "127.0.0.1", free_port()
        where = f"the node of {self.role} rank {self.rank} (IP {ray_node_ip()})" if setting else ""
        if setting and is_ip_address(setting):
            host = setting
        elif setting:
            host = interface_ipv4(setting, where)
        elif spans_nodes:
            host = ray_node_ip()
        else:
            host = "127.0.0.1" if self.device.type == "cpu" else socket.gethostbyname(socket.gethostname())
        try:
            free_port(host)  # fails at once where the host is not this node's (the store would retry)
        except OSError as err:
            if not setting:
                raise
            raise ValueError(f"{DIST_KEY}={setting!r}: {host} is not an address {where} can listen on "
                             f"({err}); set rank 0's node IP, an interface name, or null") from err
        self._rendezvous_store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                               timeout=self._rendezvous_timeout())
        return host, self._rendezvous_store.port

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        store = self.__dict__.pop("_rendezvous_store", None)  # rank 0's, listening since node_address
        if store is None:
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False,
                                  timeout=self._rendezvous_timeout())
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self._rendezvous_timeout(),
        )
        self.sequence_parallel = sequence_parallel_groups(self.rank, self.world_size, self.sp_size)

    def _rendezvous_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.cfg.trainer.remote_timeout_s)

    def ping(self) -> int:
        return self.rank

    def memory_peak(self) -> int:
        """Bytes: this process's peak memory since the previous call (trainer.memory_metrics)."""
        return peak_memory_bytes(self.device, reset=True)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # -- one process, several runs (controllers/worker_group.py, IdleWorkers) ----------------------
    def release(self) -> bool:
        """The run is over: drop everything it built (models, optimizers, process group) so this
        process can host a later run's rank, of any role (workers/process.py). False: it cannot
        (the driver then stops it)."""
        self.shutdown()
        self.__dict__.clear()
        torch.use_deterministic_algorithms(False)  # a deterministic run set it for the process
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the allocator's cached blocks: the device's memory, not the process's
        return True

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def sp_size(self) -> int:
        """Ranks one sequence is split over; the group's ranks [g*sp, (g+1)*sp) are dp rank g."""
        return getattr(self.cfg, self.layout_section).sp_size if self.layout_section else 1

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def sequence_layout(self, model: torch.nn.Module) -> SequenceLayout:
        """Padded, or packed (switching the model to the packed attention) under this role's
        use_remove_padding / sp_size."""
        section = getattr(self.cfg, self.layout_section) if self.layout_section else None
        if section is None or not packs_sequences(section):
            return PADDED
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"{self.layout_section}.use_remove_padding / sp_size: {type(model).__name__} does not take "
                             "transformers' attention functions, which packed micro-batches run through")
        heads = getattr(model.config, "num_attention_heads", None)
        if heads is not None and heads < section.sp_size:  # every sp rank attends with >= 1 head
            raise ValueError(f"{self.layout_section}.sp_size={section.sp_size}: the model has {heads} attention heads, "
                             "and each sequence-parallel rank needs one")
        use_packed_attention(model)
        return SequenceLayout(packs=True, sp=self.sequence_parallel)

    def wrap_for_training(self, model: torch.nn.Module, strategy: str, precision) -> torch.nn.Module:
        """FSDP2 (fully_shard per decoder layer, then the root) or DDP when dp > 1; with mixed
        precision (workers/precision.py) FSDP2 wraps at dp=1 too, so its policy does the casting
        at every dp size."""
        model.to(self.device)
        if not self.distributed and not precision.sharded:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # gradients as views into DDP's reduction buckets: no second gradient-sized copy (and
            # an offload moves the buckets with the gradients, workers/offload.py)
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
            hook = precision.ddp_comm_hook() if precision.enabled else None
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            return ddp
        from torch.distributed.fsdp import fully_shard

        from workers.precision import one_rank_group

        if not self.distributed:
            one_rank_group()
        policy = {"mp_policy": precision.fsdp_policy()}
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module, **policy)
        fully_shard(model, **policy)
        return model

    @staticmethod
    def is_sharded(model: torch.nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (on rank 0; a collective under FSDP2)."""
        is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        module = model.module if is_ddp else model
        if self.is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return state if self.rank == 0 else {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}
