"""Mixed precision for the trainers (actor/critic.mixed_precision): float32 master weights and
optimizer state, forwards and backwards in bfloat16 or float16.

- FSDP2 (any dp size, a one-rank group at dp=1): torch's MixedPrecisionPolicy. Each layer's
  parameters are cast to the compute dtype when gathered, the gradients are reduced in
  reduce_dtype and land on the float32 shards the optimizer steps.
- DDP and a bare module: autocast around the forward (matmuls in the compute dtype, the ops
  autocast keeps in float32 stay there); gradients land on the float32 parameters. A reduce_dtype
  below float32 compresses DDP's all-reduce (torch's compress hooks).

So the compute numerics depend on the strategy, never on the dp size or the micro-batch layout.
float16 needs loss scaling (its gradients underflow): DynamicLossScale below.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype | None  # None: the model's own dtype (mixed precision off)
    reduce: torch.dtype
    strategy: str  # fsdp2 | ddp

    @classmethod
    def of(cls, section) -> "Precision":
        """From a resolved actor/critic section: mixed precision when param_dtype is not the model's."""
        mp = section.mixed_precision
        compute = None if mp.param_dtype == section.model.dtype else DTYPES[mp.param_dtype]
        return cls(compute, DTYPES[mp.reduce_dtype], section.strategy)

    @property
    def enabled(self) -> bool:
        return self.compute is not None

    @property
    def sharded(self) -> bool:
        """FSDP2's policy does the casting (the model is wrapped even at dp=1)."""
        return self.enabled and self.strategy == "fsdp2"

    def forward_context(self, device: torch.device):
        """What a forward of a model this precision wrapped runs under: autocast where no FSDP2
        policy casts the parameters."""
        if not self.enabled or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.enabled:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    def ddp_comm_hook(self):
        """A compress hook for a reduce dtype below float32 (None: DDP's float32 all-reduce)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return {torch.float32: None, torch.bfloat16: default_hooks.bf16_compress_hook,
                torch.float16: default_hooks.fp16_compress_hook}[self.reduce]

    @property
    def scales_loss(self) -> bool:
        return self.compute is torch.float16


class DynamicLossScale:
    """float16 loss scaling (torch.amp.GradScaler's rule): the loss is multiplied by `scale` before
    the backward and the gradient divided by it after; a mini-batch whose gradient overflows is
    skipped and the scale halved; after `growth_interval` clean steps it doubles. Scales are powers
    of two, so scaling and unscaling are exact: the layout invariance is untouched."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def unscale_(self, parameters) -> None:
        grads = [p.grad for p in parameters if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale /= 2.0
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"a loss scale must be a positive number, got {self.scale}")


def cast_parameters_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers: rotary frequencies stay float32) to `dtype`: what FSDP2's policy
    computes with, for a frozen model that needs no master copy (the reference)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def one_rank_group() -> None:
    """FSDP2 needs a process group even for one rank; an in-memory store needs no port."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
