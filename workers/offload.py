"""Move a trainer's parameters, gradients and optimizer state off the device, and back, bit for bit.

While another phase runs (the rollout, the other role's update), a trainer's state only takes
memory. `TrainerStateOffloader` frees it and later restores it exactly. It works on *storages*,
the memory blocks under the tensors: each one is copied out, then shrunk to zero bytes
(`resize_(0)`); `reload` grows it back and copies the bytes in. The tensor objects never change,
so the model, the optimizer, DDP and FSDP2 keep every reference they hold and nothing needs
re-wiring; and since a storage is the whole block, the same code serves a plain module, DDP and
FSDP2, whose sharded parameters are views into padded per-parameter buffers.

Where the bytes wait: a device storage (CUDA) in pinned host memory, which copies fastest (on
reload those buffers return to PyTorch's pinned-memory cache, which the next offload reuses;
`torch.accelerator.empty_host_cache()` releases them). A CPU storage in a temporary file under
`holding_dir`, so that the process's resident memory drops while the file (page cache, then disk)
holds the bytes. The file is unlinked as it is created (`tempfile.TemporaryFile`): it never has a
name on disk, and its space returns when it is closed (on reload, on a failed offload, or when
the process dies, however it dies).

Not moved: what the wrappers keep for themselves. DDP's reducer has its own gradient buckets, as
large as the gradients, unless DDP is built with `gradient_as_bucket_view=True` (then the
gradients are views into the buckets, and offloaded with them); FSDP2's unsharded parameters are
freed through FSDP2 (`reshard`) rather than moved.

While offloaded the state must not be touched: the tensors have no memory behind them.
"""

from __future__ import annotations

import ctypes
import tempfile
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TrainerStateOffloader", "trainer_state_bytes", "trainer_storages", "unaliased"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP2-sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    for param in model.parameters():  # FSDP2: the sharded parameters, never its unsharded buffers
        yield param
        if param.grad is not None:  # a gradient set to None has no memory: nothing to move
            yield param.grad
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def trainer_storages(model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages under the parameters, gradients and optimizer state.

    Tensors that share memory (tied weights, views) share a storage and appear once; an empty
    storage (FSDP2 frees unsharded parameters between forwards) is left out."""
    storages: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for tensor in _state_tensors(model, optimizer):
            storage = _local(tensor).untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def trainer_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """How many bytes of this rank's memory an offload would move out."""
    return sum(storage.nbytes() for storage in trainer_storages(model, optimizer))


def unaliased(value, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """`value` (nested dicts / lists / tuples) with every tensor that shares memory with the
    trainer's state replaced by a copy: what a call returns must outlive the offload that follows
    it (a state dict of a single rank, or an optimizer's step counters, are the live tensors)."""
    from torch.utils._pytree import tree_map

    live = {storage.data_ptr() for storage in trainer_storages(model, optimizer)}

    def copy_if_live(leaf):
        if isinstance(leaf, torch.Tensor) and _local(leaf).untyped_storage().data_ptr() in live:
            return leaf.detach().clone()
        return leaf

    return tree_map(copy_if_live, value)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`'s bytes (whatever the dtype of its tensors)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buffer(data: torch.Tensor):
    """A Python buffer over a CPU uint8 tensor's memory, for file I/O. Not `.numpy()`: that marks
    the storage as not resizable, for good."""
    return (ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())


def _own_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Storages that cannot be resized get an ordinary copy of their values, once: a CPU model
    loaded from safetensors keeps its parameters in the file's memory map, and tensors that came
    through Ray (a loaded checkpoint's optimizer state) sit in its read-only buffers. The same
    Parameter objects (`.data` swapped) and the same optimizer state slots keep every reference
    the optimizer, DDP and FSDP2 hold."""

    def fixed(tensor: torch.Tensor) -> bool:
        return not _local(tensor).untyped_storage().resizable()

    with torch.no_grad():
        for param in model.parameters():
            if not isinstance(param, DTensor) and fixed(param):
                param.data = param.data.clone()
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and fixed(value):
                    state[key] = value.clone()


def reshard_fsdp(model: torch.nn.Module) -> None:
    """FSDP2 keeps the root's parameters unsharded after a forward: free those all-gathered copies
    through FSDP2's own API (the sharded parameters are what gets offloaded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _return_freed_memory(storages: list[torch.UntypedStorage]) -> None:
    """Freed memory stays with the process unless handed back. On a device, PyTorch's caching
    allocator keeps it: empty_cache lets another process (the rollout engine) use it. On CPU,
    glibc keeps freed heap blocks (most tensors are below its mmap threshold): malloc_trim hands
    them to the OS, or the resident memory would not drop at all."""
    if any(storage.device.type != "cpu" for storage in storages):
        torch.accelerator.empty_cache()
    if any(storage.device.type == "cpu" for storage in storages):
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        if trim is not None:
            trim(0)


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    for device in {storage.device for storage in storages if storage.device.type != "cpu"}:
        torch.accelerator.synchronize(device)


class TrainerStateOffloader:
    """Frees this rank's parameters, gradients and optimizer state (`offload`) and restores them
    bit for bit (`reload`). Every rank of a group offloads its own part (no collective).

    `holding_dir`: where CPU storages wait, in one nameless temporary file (default: the system's
    temporary directory). Call `offload` between phases, when no forward or backward is running;
    nothing may touch the model or the optimizer until `reload`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 holding_dir: str | None = None):
        self.model, self.optimizer = model, optimizer
        self.holding_dir = holding_dir or tempfile.gettempdir()
        # while offloaded: (storage, its size, its pinned host copy, or None: in the file, in order)
        self._held: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        self._file = None

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @property
    def held_bytes(self) -> int:
        """Bytes held off the device now (0 when not offloaded)."""
        return sum(nbytes for _, nbytes, _ in self._held)

    def offload(self) -> int:
        """Copy every storage out, then free it; returns the bytes moved. All or nothing: when a
        copy fails (the directory is not writable, the disk is full) nothing has been freed and
        the file is gone."""
        if self.offloaded:
            raise RuntimeError("trainer state offload: already offloaded (reload first)")
        reshard_fsdp(self.model)
        _own_memory(self.model, self.optimizer)
        storages = trainer_storages(self.model, self.optimizer)
        fixed = [storage for storage in storages if not storage.resizable()]
        if fixed:
            raise ValueError(f"trainer state offload: {len(fixed)} storage(s) cannot be resized (memory the "
                             "process does not own, e.g. a memory-mapped file)")
        held = []
        try:
            for storage in storages:
                data = _bytes_of(storage)
                if storage.device.type == "cpu":
                    self._write(data)
                    host = None
                else:
                    host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                    host.copy_(data, non_blocking=True)
                held.append((storage, data.numel(), host))
            if self._file is not None:
                self._file.flush()
            _synchronize(storages)  # the host copies are complete before their source is freed
        except BaseException:
            self._close_file()
            raise
        for storage, _, _ in held:
            storage.resize_(0)
        self._held = held
        _return_freed_memory(storages)
        return self.held_bytes

    def reload(self) -> None:
        """Give every storage its memory back and copy its bytes in; closing the file deletes it.
        If this fails (out of memory), the state stays offloaded and `reload` can be retried."""
        if not self.offloaded:
            return
        try:
            if self._file is not None:
                self._file.seek(0)
            for storage, nbytes, host in self._held:
                storage.resize_(nbytes)
                if host is None:
                    self._read_into(_bytes_of(storage))
                else:
                    _bytes_of(storage).copy_(host, non_blocking=True)
            _synchronize([storage for storage, _, _ in self._held])
        except BaseException:
            for storage, _, _ in self._held:
                storage.resize_(0)
            raise
        self._held = []
        self._close_file()

    # -- the holding file -------------------------------------------------------------------------
    def _write(self, data: torch.Tensor) -> None:
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="rlflow-offload-", dir=self.holding_dir)
            self._file.write(_buffer(data))
        except OSError as err:
            raise OSError(f"trainer state offload: cannot hold the state in a file under holding_dir "
                          f"{self.holding_dir!r} ({err}); nothing was offloaded") from err

    def _read_into(self, data: torch.Tensor) -> None:
        count = self._file.readinto(_buffer(data))
        if count != data.numel():
            raise OSError(f"trainer state reload: the holding file under {self.holding_dir!r} ended early "
                          f"({count} of {data.numel()} bytes)")

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
