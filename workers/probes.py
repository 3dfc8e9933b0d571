"""Gradient probes: what the gradient of one optimizer step was, as metrics that reduce exactly.

Parameters after Adam say little about a gradient error (Adam is nearly blind to a uniform scale,
and an error in one tensor is diluted in the global grad norm), so the exactness tests compare
the gradient itself. Per optimizer step, after the data-parallel reduction and before clipping,
each trainable worker reports:

- `<prefix>/norm/<parameter name>`: the norm of that tensor's gradient (aggregation L2: every
  rank reports the norm of the part it owns, so FSDP2 shards combine into the whole tensor's norm);
- `<prefix>/proj<k>`: <g, r_k> for fixed random vectors r_k over the whole gradient (SUM over
  the owned parts). r_k depends only on (seed, parameter name, k), so every layout projects on
  the same vectors.

Ownership: an FSDP2 gradient is a DTensor sharded on one mesh dimension (each rank owns its
shard); a DDP or single-rank gradient is the same full tensor on every rank, owned by rank 0.
Off unless trainer.grad_probes.enable: nothing here runs otherwise.
"""

from __future__ import annotations

import zlib

import torch

from rlflow.metrics import Aggregation, Metric

_DDP_PREFIX = "module."


def probe_vector(seed: int, name: str, k: int, shape: torch.Size) -> torch.Tensor:
    """The k-th fixed random direction for the parameter `name` (standard normal, float64)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{k}".encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _owned_piece(grad: torch.Tensor, rank: int) -> tuple[torch.Tensor | None, slice | None]:
    """(this rank's part of the gradient, how to cut the same part from a full-shape tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(grad, DTensor):
        return (grad, None) if rank == 0 else (None, None)
    (placement,) = grad.placements  # FSDP2 shards on a one-dimensional mesh
    local_rank = grad.device_mesh.get_local_rank()
    if isinstance(placement, Replicate):
        return (grad.to_local(), None) if local_rank == 0 else (None, None)
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"gradient probes: unsupported placement {placement}")

    def cut(full: torch.Tensor) -> torch.Tensor:
        # FSDP2 shards like torch.chunk (trailing ranks may hold an empty piece)
        chunks = full.chunk(grad.device_mesh.size(), dim=placement.dim)
        if local_rank < len(chunks):
            return chunks[local_rank]
        return full.narrow(placement.dim, 0, 0)

    return grad.to_local(), cut


def gradient_probes(model: torch.nn.Module, prefix: str, rank: int, num_projections: int,
                    seed: int) -> dict[str, Metric]:
    """The probe metrics of the gradient now held in `model`'s parameters (see the module doc)."""
    metrics: dict[str, Metric] = {}
    projections = [0.0] * num_projections
    for name, param in model.named_parameters():
        name = name.removeprefix(_DDP_PREFIX)
        grad = param.grad
        piece, cut = (None, None) if grad is None else _owned_piece(grad, rank)
        if piece is None:
            metrics[f"{prefix}/norm/{name}"] = Metric(0.0, Aggregation.L2)
            continue
        piece = piece.detach().to("cpu", torch.float64)
        metrics[f"{prefix}/norm/{name}"] = Metric(float(piece.norm()), Aggregation.L2)
        for k in range(num_projections):
            direction = probe_vector(seed, name, k, param.shape)
            if cut is not None:
                direction = cut(direction)
            if direction.shape != piece.shape:
                raise RuntimeError(f"gradient probes: {name} holds a piece of shape {tuple(piece.shape)}, "
                                   f"expected {tuple(direction.shape)}")
            projections[k] += float((piece * direction).sum())
    for k, value in enumerate(projections):
        metrics[f"{prefix}/proj{k}"] = Metric(value, Aggregation.SUM)
    return metrics
