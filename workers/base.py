"""Rank setup shared by every worker: torch.distributed, seeding, threads, the model wrap."""

from __future__ import annotations

import datetime
import os
import random
import socket

import torch
import torch.distributed as dist

from rlflow.config import RLFlowConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def worker_threads(num_worker_processes: int) -> int:
    """Each worker's share of this machine's cores (the roles' phases overlap, and a process that
    takes every core contends with the others: docs/BENCHMARKS.md). RLFLOW_WORKER_THREADS, when
    set, is the user's choice instead."""
    override = int(os.environ.get("RLFLOW_WORKER_THREADS", "0") or 0)
    return override or max(1, (os.cpu_count() or 1) // max(1, num_worker_processes))


class WorkerBase:
    """One rank of a role. Ray creates it, the group then calls `init_distributed`."""

    role = "worker"

    def __init__(self, cfg: RLFlowConfig, rank: int, world_size: int, num_threads: int = 1):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        torch.set_num_threads(num_threads)  # the driver's share-out (worker_threads)
        from workers.wire import install as install_tensor_wire

        install_tensor_wire()  # what this worker returns crosses Ray as numpy buffers (workers/wire.py)
        seed_everything(cfg.trainer.seed + rank, cfg.trainer.deterministic)
        _quiet_libraries()

    # -- called by the group --------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group: this host and a free port."""
        return "127.0.0.1" if self.device.type == "cpu" else socket.gethostbyname(socket.gethostname()), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.cfg.trainer.remote_timeout_s),
        )

    def ping(self) -> int:
        return self.rank

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def wrap_for_training(self, model: torch.nn.Module, strategy: str) -> torch.nn.Module:
        """FSDP2 (fully_shard per decoder layer, then the root) or DDP when dp > 1."""
        model.to(self.device)
        if not self.distributed:
            return model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        fully_shard(model)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (on rank 0; a collective under FSDP2)."""
        is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        module = model.module if is_ddp else model
        if self.distributed and not is_ddp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return state if self.rank == 0 else {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}
