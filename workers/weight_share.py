"""Actor -> rollout weight sync through one shared-memory file, for workers on the same node.

Through Ray's object store a sync serialises the state dict (one buffer per tensor), copies it into
the store, fetches it in every rollout worker and copies it out again: several times the work of
the copies themselves (docs/BENCHMARKS.md). Here the actor's rank 0 writes its
weights into a file in /dev/shm that the rollout workers have mapped too, and each rollout worker
loads from views of that mapping: two memory copies and two small Ray calls.

The file is unlinked as soon as every worker has mapped it, so nothing is left behind however the
processes end; the memory goes back when the last mapping closes. Its space is reserved up front
(posix_fallocate), so a full /dev/shm is an error at setup, not a SIGBUS at the first write.
"""

from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64  # every tensor starts on a 64-byte boundary: any dtype may view it
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class WeightEntry:
    name: str
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file
    nbytes: int


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor of a state dict lies in the shared file."""

    path: str
    entries: tuple[WeightEntry, ...]
    total_bytes: int


def new_share_path() -> str | None:
    """A fresh file name in /dev/shm, or None where there is no writable /dev/shm."""
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return None
    return os.path.join(SHM_DIR, f"rlflow-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def layout_of(state: dict[str, torch.Tensor], path: str) -> WeightLayout:
    entries, offset = [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(WeightEntry(name, str(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return WeightLayout(path, tuple(entries), max(offset, _ALIGN))


def create_share(layout: WeightLayout) -> None:
    """Create the file with all its space reserved (raises OSError, e.g. ENOSPC, if it cannot)."""
    fd = os.open(layout.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
    except OSError:
        os.close(fd)
        os.unlink(layout.path)
        raise
    os.close(fd)


class MappedWeights:
    """A process's mapping of the shared file, with a tensor view per state-dict entry.

    A worker keeps its mapping for its whole life: the views export the mmap's buffer, and the
    mapping goes with the process."""

    def __init__(self, layout: WeightLayout):
        self.layout = layout
        with open(layout.path, "r+b") as f:
            self._mmap = mmap.mmap(f.fileno(), layout.total_bytes)
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.views: dict[str, torch.Tensor] = {}
        for e in layout.entries:
            if e.dtype not in _DTYPES:
                raise TypeError(f"weight share: {e.name} has dtype {e.dtype}, which cannot be shared")
            self.views[e.name] = raw[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)

    def write(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a state dict of the layout's names, shapes and dtypes into the file."""
        if state.keys() != self.views.keys():
            missing, extra = self.views.keys() - state.keys(), state.keys() - self.views.keys()
            raise ValueError(f"weight share: the state dict changed its names (missing {sorted(missing)[:5]}, "
                             f"new {sorted(extra)[:5]})")
        with torch.no_grad():
            for name, tensor in state.items():
                view = self.views[name]
                if tensor.shape != view.shape or tensor.dtype != view.dtype:
                    raise ValueError(f"weight share: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                     f"the shared layout says {tuple(view.shape)} {view.dtype}")
                view.copy_(tensor)
