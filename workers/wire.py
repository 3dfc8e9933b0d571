"""How torch tensors travel through Ray: as numpy buffers, not through torch's own pickling.

Ray pickles a CPU tensor by torch's default reduction, which writes each storage with
torch.save into a bytes object and reads it back with torch.load, several times slower than numpy
arrays, which pickle protocol 5 passes as buffers that Ray moves out of band (docs/BENCHMARKS.md).
rlflow moves about ten batches per step.

`install()` registers this for exact `torch.Tensor` instances in the calling process (the driver's
worker groups and every worker call it). The receiver needs nothing registered: the rebuild
function is pickled by reference. What arrives is the same values, dtype and shape as before, in a
fresh writable tensor the receiver owns, allocated by torch (copied out of the object store, as
torch's pickling also gives a fresh, 64-byte aligned storage). Only plain tensors take this path: on CPU, dense, contiguous, not
requiring grad, with a numpy dtype (bfloat16 travels as its int16 bits), no dim names and no Python
attributes. Anything else (CUDA, views with strides, Parameters, subclasses, ...) is pickled by
torch exactly as before. One difference: tensors that shared a storage on the sender arrive as
separate copies (torch's pickling keeps the sharing within one object), and a view no longer drags
its whole base storage along.
"""

from __future__ import annotations

import numpy as np
import torch

# numpy has these dtypes; torch.Tensor.numpy() shares memory for them
_NUMPY_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.complex64, torch.complex128,
})
# no numpy dtype: travel as same-width integer bits
_BITS_OF = {torch.bfloat16: torch.int16}
_BY_NAME = {str(dtype): dtype for dtype in _BITS_OF}


class _TorchPickled:
    """The fallback: pickles the tensor it holds exactly the way torch does."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        return self.tensor.__reduce_ex__(protocol)


def _plain(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and (t.dtype in _NUMPY_DTYPES or t.dtype in _BITS_OF)
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
        and not any(getattr(t, "names", None) or ())  # named tensors, where torch still has them
        and not t.__dict__
    )


def to_wire(t: torch.Tensor):
    if not _plain(t):
        return _TorchPickled(t)
    if t.dtype in _BITS_OF:
        return t.view(_BITS_OF[t.dtype]).numpy(), str(t.dtype)
    return t.numpy()


_TORCH_OF = {torch.empty(0, dtype=dtype).numpy().dtype: dtype for dtype in _NUMPY_DTYPES}


def _owned(arr: np.ndarray) -> torch.Tensor:
    # torch's allocator, as torch's own unpickling uses: 64-byte aligned (numpy's is not always),
    # so kernels see the same alignment, and so the same rounding, as before
    out = torch.empty(arr.shape, dtype=_TORCH_OF[arr.dtype])
    if out.numel():
        out.numpy()[...] = arr
    return out


def from_wire(obj) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):  # came the torch way
        return obj
    if isinstance(obj, tuple):
        bits, dtype = obj
        return _owned(bits).view(_BY_NAME[dtype])
    return _owned(obj)


def install() -> None:
    """Register the numpy path for torch.Tensor with Ray in this process (idempotent)."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
