"""The update loop shared by the actor and the critic.

One call of `update` receives this rank's shards of every mini-batch of a step, in order, each
carrying the BatchMeta the driver computed for the whole mini-batch. Per mini-batch: cut into
micro-batches, backward each (gradients accumulate), clip the norm of the whole accumulated
gradient, one optimizer step. The worker never all-reduces to find batch sizes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
from tensordict import TensorDict

from rlflow.config import micro_batch_token_budget
from rlflow.metrics import Aggregation, Metric
from rlflow.protocol import MICRO_PLAN_KEY, BatchMeta, get_meta, split_micro_batches
from workers.base import WorkerBase, capture_rng_state, restore_rng_state
from workers.offload import TrainerStateOffloader, reshard_fsdp, unaliased
from workers.precision import DynamicLossScale, Precision
from workers.probes import gradient_probes
from workers.weight_share import SHM_DIR, MappedWeights, WeightLayout, create_share, layout_of, new_share_path


class NonFiniteError(RuntimeError):
    pass


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    # frozen parameters (LoRA's base weights) get no optimizer state
    params = [param for param in params if param.requires_grad]
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(params, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
    # the fused kernel: one pass over each tensor instead of a chain of elementwise ops (the
    # default of transformers' Trainer, so of TRL); it needs every tensor on a device it supports
    fused = all(param.is_floating_point() and param.device.type in ("cpu", "cuda") for param in params)
    return torch.optim.AdamW(
        params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay,
        fused=fused or None,
    )


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (HF's
    checkpointing, active in train mode only). Non-reentrant: the form FSDP2 and DDP support, and
    it gives parameters inside a layer their gradient even when the layer's input needs none (LoRA
    over frozen embeddings); transformers before 5 defaulted to the reentrant one."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(0, optim_cfg.warmup_steps)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if optim_cfg.lr_scheduler == "cosine" and total_steps > warmup:
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def micro_batch_plan(section, shard: TensorDict, group_prompts: bool = False) -> dict:
    """How a rank cuts its shard of a mini-batch into micro-batches (plan_micro_batches' kwargs):
    a fixed size (a prompt's rows together when the forward shares prompts), or the token budget
    with the count the driver asks every rank to run."""
    if section.use_dynamic_bsz:
        plan = {"max_token_len": micro_batch_token_budget(section)}
        if MICRO_PLAN_KEY in shard.keys():
            plan["num_micro_batches"] = int(shard.get_non_tensor(MICRO_PLAN_KEY))
        return plan
    return {"micro_batch_size": section.ppo_micro_batch_size_per_gpu, "group_prompts": group_prompts}


def resident(method):
    """With <role>.offload, the worker's state is on the device only while one of these calls
    runs: reloaded as it starts, offloaded as it ends (the outermost call, when they nest)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        offloader = self.offloader
        if offloader is None:
            return method(self, *args, **kwargs)
        outermost = not self._resident_calls
        if outermost:
            offloader.reload()
        self._resident_calls += 1
        try:
            result = method(self, *args, **kwargs)
            return unaliased(result, self.model, self.optimizer) if outermost else result
        finally:
            self._resident_calls -= 1
            if outermost:
                offloader.offload()

    return call


class TrainableWorker(WorkerBase):
    """Subclasses set self.model / self.optimizer / self.scheduler and implement micro_loss; the
    public calls that touch them are @resident."""

    section: str  # "actor" or "critic"
    loss_scale: DynamicLossScale | None = None  # float16 mixed precision only
    offloader: TrainerStateOffloader | None = None  # <role>.offload
    share_prompt = False  # <role>.model.share_prompt_forward, where the model supports it
    _resident_calls = 0

    def start_offloading(self) -> None:
        """With <role>.offload, from the end of init_model on: the parameters, gradients and
        optimizer state wait off the device (workers/offload.py) whenever no call runs."""
        if self.section_cfg().offload:
            self.offloader = TrainerStateOffloader(self.model, self.optimizer, holding_dir=self.cfg.trainer.offload_dir)
            self.offloader.offload()

    def section_cfg(self):
        return getattr(self.cfg, self.section)

    def wrap_trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        """The role's strategy and mixed precision (workers/precision.py) around its loaded model."""
        section = self.section_cfg()
        self.precision = Precision.of(section)
        if self.precision.scales_loss:
            self.loss_scale = DynamicLossScale()
        return self.wrap_for_training(model, section.strategy, self.precision)

    def forward_context(self):
        return self.precision.forward_context(self.device)

    def micro_loss(self, micro: TensorDict, meta: BatchMeta | None) -> tuple[torch.Tensor, dict[str, Metric]]:
        """The sum of the role's loss terms (rlflow.algos.compose_loss) on one micro-batch, each
        normalised by `meta`, the whole mini-batch's counts (None: the micro-batch's own)."""
        raise NotImplementedError

    def _loss_meta(self, meta: BatchMeta | None) -> BatchMeta | None:
        """The BatchMeta the loss terms divide by: the driver's, for this group's size."""
        if meta is not None and meta.dp_size != self.dp_size:
            raise ValueError(f"{self.role} rank {self.rank}: BatchMeta.dp_size={meta.dp_size} but this group has "
                             f"{self.dp_size} data-parallel ranks")
        return meta

    @resident
    def update(self, shards: list[TensorDict]) -> list[list[dict[str, Metric]]]:
        """Train on this rank's shard of each mini-batch; returns per mini-batch the micro records."""
        try:
            with self._one_cast_per_update():
                return self._update(shards)
        finally:
            self._end_widening()

    def _update(self, shards: list[TensorDict]) -> list[list[dict[str, Metric]]]:
        self.model.train()
        section = self.section_cfg()
        probes = self.cfg.trainer.grad_probes
        per_minibatch = []
        for minibatch_index, shard in enumerate(shards):
            shard = shard.to(self.device)
            meta = self._loss_meta(get_meta(shard))
            micros, _ = split_micro_batches(shard, **micro_batch_plan(section, shard, self.share_prompt))
            records: list[dict[str, Metric]] = []
            self.optimizer.zero_grad(set_to_none=True)
            finite_loss = True
            for index, micro in enumerate(micros):
                self._widen_if_told()
                with self._gradient_sync(last=index == len(micros) - 1):
                    with self.forward_context():
                        loss, metrics = self.micro_loss(micro, meta)
                    (loss if self.loss_scale is None else loss * self.loss_scale.scale).backward()
                finite_loss = finite_loss and bool(torch.isfinite(loss.detach()))
                if self.sequence_parallel.rank == 0:  # the sp ranks of a group compute the same micro-batch loss
                    records.append(metrics)
            if self.loss_scale is not None:
                self.loss_scale.unscale_(self.model.parameters())
            if probes.enable:  # the reduced gradient, before clipping changes it
                records.append(gradient_probes(self.model, f"{self.section}/grad_probe/mb{minibatch_index}",
                                               self.rank, probes.num_projections, probes.seed))
            # the norm of the whole accumulated gradient (all micro-batches, all ranks)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), section.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            finite_loss = self._all_ranks(finite_loss)
            # a finite loss with a non-finite gradient under float16 loss scaling: the scale overflowed
            overflow = self.loss_scale is not None and finite_loss and not math.isfinite(grad_norm)
            if not finite_loss:
                # a clamp gives a NaN input a zero gradient, so a NaN loss can come with a finite
                # norm: it is handled as a non-finite gradient, on every rank alike
                grad_norm = math.nan
            step_record = {
                f"{self.section}/grad_norm": Metric(grad_norm, Aggregation.MAX),
                f"{self.section}/lr": Metric(self.scheduler.get_last_lr()[0], Aggregation.MAX),
                f"{self.section}/num_micro_batches": Metric(float(len(micros)), Aggregation.MAX),
            }
            if self.loss_scale is not None:
                step_record[f"{self.section}/loss_scale"] = Metric(self.loss_scale.scale, Aggregation.MAX)
                self.loss_scale.update(finite=not overflow)
            if math.isfinite(grad_norm):
                self.optimizer.step()
                step_record[f"{self.section}/skipped_minibatches"] = Metric(0.0, Aggregation.MAX)
            elif overflow:
                # float16 overflowed at this loss scale (now halved): a normal skip, not an error
                self.optimizer.zero_grad(set_to_none=True)
                step_record[f"{self.section}/skipped_minibatches"] = Metric(1.0, Aggregation.MAX)
            elif self.cfg.trainer.nan_policy == "skip":
                # grad_norm is global, so every rank skips the same mini-batch
                self.optimizer.zero_grad(set_to_none=True)
                step_record[f"{self.section}/skipped_minibatches"] = Metric(1.0, Aggregation.MAX)
            else:
                bad = {k: m.value for r in records for k, m in r.items() if not math.isfinite(m.value)}
                raise NonFiniteError(
                    f"{self.role} rank {self.rank}: non-finite gradient norm ({grad_norm}); non-finite metrics: "
                    f"{bad or 'none'}. Set trainer.nan_policy=skip to skip such mini-batches instead."
                )
            records.append(step_record)
            per_minibatch.append(records)
        self.scheduler.step()
        return per_minibatch

    def _all_ranks(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank of the group (a one-element all-reduce)."""
        if not self.distributed:
            return flag
        import torch.distributed as dist

        value = torch.tensor([0.0 if flag else 1.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item() == 0.0

    def _gradient_sync(self, last: bool):
        """DDP all-reduces the whole gradient on every backward: accumulate the micro-batches
        locally and all-reduce once, on the last (the sum is the same, one reduction instead of K).
        Every rank runs the same number of micro-batches (the driver's plan), so the reductions
        line up. FSDP2 at dp > 1 keeps reducing per micro-batch: skipping it would hold unsharded
        gradients. FSDP2 on one rank (mixed precision): see _one_cast_per_update."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if last else self.model.no_sync()
        if self.is_sharded(self.model) and not self.distributed:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _one_cast_per_update(self):
        """FSDP2 on one rank wraps only to cast (workers/precision.py): by default each layer's
        compute-dtype copy is made again for every micro-batch's forward and again for its
        backward. Within an update the weights do not change until the optimizer step, so the
        copy made by the first forward serves every micro-batch; the gradient accumulates
        unsharded in reduce_dtype (what FSDP2 does without gradient sync), and the last backward
        reduces it onto the float32 shard and drops the copies before the step."""
        if self.distributed or not self.is_sharded(self.model):
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        layers = [m for m in self.model.modules() if isinstance(m, FSDPModule) and m is not self.model]
        for layer in layers:
            layer.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for layer in layers:
                layer.set_reshard_after_forward(True, recurse=False)
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)
            reshard_fsdp(self.model)  # no copy outlives the update (a failed one included)

    @resident
    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights as the model's HF folder names them (rank 0; every rank must call under
        FSDP2): rollout sync, the weights at the end of a run, tests."""
        return self.inference_weights(self.full_state_dict(self.model))

    def inference_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights an inference engine loads, from the trained model's full state dict: the
        state dict itself (the actor with LoRA merges its adapters in)."""
        return state

    # -- rollout sync through a shared-memory file (workers/weight_share.py) ------------------------
    def _weights_to_publish(self) -> dict[str, torch.Tensor]:
        # a single rank writes its live tensors straight into the file; FSDP2 gathers (collective)
        if self.distributed or self.is_sharded(self.model):
            return self.inference_weights(self.full_state_dict(self.model))
        return self.inference_weights({name: tensor.detach() for name, tensor in self.model.state_dict().items()})

    @resident
    def open_weight_share(self) -> WeightLayout | None:
        """Rank 0 creates and fills the file and returns its layout (every rank calls: a collective)."""
        state = self._weights_to_publish()
        if self.rank != 0:
            return None
        path = new_share_path()
        if path is None:
            raise OSError(f"{self.role} rank 0: no writable {SHM_DIR} for the weight share")
        layout = layout_of(state, path)
        create_share(layout)
        self._weight_share = MappedWeights(layout)
        self._weight_share.write(state)
        return layout

    def unlink_weight_share(self) -> None:
        """Once every reader has mapped the file, its name can go: nothing is left on disk."""
        if self.rank == 0 and os.path.exists(self._weight_share.layout.path):
            os.unlink(self._weight_share.layout.path)

    @resident
    def publish_weights(self) -> bool:
        """Write the current weights into the shared file (every rank calls under FSDP2)."""
        state = self._weights_to_publish()
        if self.rank == 0:
            self._weight_share.write(state)
        return True

    # -- checkpoint state -------------------------------------------------------------------------
    @resident
    def state_for_checkpoint(self) -> dict:
        """Full (unsharded) model and optimizer state on rank 0, every rank's RNG states.

        Every rank must call it (a collective under FSDP2). Optimizer state is keyed by parameter
        name (torch.distributed.checkpoint's full form) whatever the strategy, so a checkpoint
        loads under fsdp2, ddp or a single rank, with any dp size.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model_state = self.full_state_dict(self.model)
        never_stepped = not self.optimizer.state
        optim_state = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if never_stepped:
            # get_optimizer_state_dict initialises an empty state with a fake step (step=1, zero
            # moments): undo it, or saving would shift Adam's bias correction for the whole run
            self.optimizer.state.clear()
            optim_state["state"] = {}
        rng = capture_rng_state()
        if self.rank != 0:
            return {"rng": rng}
        state = {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict(), "rng": rng}
        if self.loss_scale is not None:
            state["loss_scale"] = self.loss_scale.state_dict()
        return state

    def _load_param_group_options(self, saved_groups: list[dict]) -> None:
        """The saved groups' options (lr, betas, ...) into the optimizer's groups, in order."""
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"{self.role} rank {self.rank}: the checkpoint's optimizer has {len(saved_groups)} "
                             f"parameter groups, this one {len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value

    @resident
    def load_checkpoint_state(self, state: dict, rng: dict | None = None, strict: bool = True) -> None:
        """Load a full state (every rank gets the whole of it); `rng` is this rank's RNG state.
        strict=False: state["model"] holds only some of the model's tensors (LoRA's adapters)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if state.get("adapter_config") is not None and strict:
            raise ValueError(f"{self.role} rank {self.rank}: the checkpoint holds LoRA adapters, not the whole model; "
                             "resume it with the actor.lora settings of the run that saved it")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False, strict=strict)
        set_model_state_dict(self.model, state["model"], options=options)
        if state["optimizer"].get("state"):
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        else:
            # no per-parameter state (saved before any step, or SGD without momentum, which keeps
            # none): set_optimizer_state_dict finds no tensor to place it by and refuses, and only
            # the groups' hyperparameters are left to restore
            self._load_param_group_options(state["optimizer"]["param_groups"])
            self.optimizer.state.clear()
        self.scheduler.load_state_dict(state["scheduler"])
        if self.loss_scale is not None and "loss_scale" in state:
            self.loss_scale.load_state_dict(state["loss_scale"])
        rng = rng if rng is not None else state.get("rng")
        if rng is not None:
            restore_rng_state(rng)
