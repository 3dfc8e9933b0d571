"""The policy (actor) and the frozen reference policy."""

from __future__ import annotations

from collections import ChainMap

import torch
from tensordict import TensorDict

from rlflow.algos import ROLLOUT_IS_WEIGHTS, ROLLOUT_LOG_PROBS, actor_loss_terms, compose_loss, masked_mean_metric
from rlflow.algos.losses import TEACHER_TOPK_IDS, TOPK_LOG_PROBS
from rlflow.algos.rollout_correction import compute_rollout_correction
from rlflow.algos.rollout_correction import options_from_config as rollout_correction_options
from rlflow.metrics import Metric
from rlflow.protocol import BatchMeta, plan_micro_batches
from workers import lora
from workers.base import WorkerBase
from workers.forward import response_forward, response_log_probs, share_prompt_setting
from workers.precision import DTYPES, Precision, cast_parameters_
from workers.trainable import TrainableWorker, build_optimizer, build_scheduler, enable_gradient_checkpointing, resident
from workers.weight_collective import CollectiveWeightSender


def load_causal_lm(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if not any(arch.endswith("ForCausalLM") for arch in (config.architectures or [])):
        raise ValueError(
            f"model path {path} holds a {config.architectures or config.model_type} model, not a causal LM "
            "(actor.model.path must point at a *ForCausalLM checkpoint)"
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])


class LogProbMixin:
    """compute_log_prob over a shard, micro-batched, no grad."""

    share_prompt = False  # actor.model.share_prompt_forward, where the model supports it

    def _log_prob_shard(self, td: TensorDict, micro_batch_size: int, out_key: str) -> TensorDict:
        self.model.eval()
        td = td.to(self.device)
        temperature = self.cfg.rollout.temperature
        result = td["responses"].new_zeros(td["responses"].shape, dtype=torch.float32)
        with torch.no_grad(), self.forward_context():
            for idx in plan_micro_batches(td, micro_batch_size=micro_batch_size, group_prompts=self.share_prompt):
                result[idx], _ = response_log_probs(self.model, td[idx], temperature, share_prompt=self.share_prompt,
                                                    layout=self.layout)
        return TensorDict({out_key: result.cpu()}, batch_size=td.batch_size)


class ActorWorker(CollectiveWeightSender, LogProbMixin, TrainableWorker):  # rollout.weight_sync=collective
    role = "actor"
    section = "actor"
    layout_section = "actor"

    def init_model(self, model_path: str, total_steps: int) -> int:
        actor = self.cfg.actor
        model = load_causal_lm(model_path, actor.model.dtype)
        if actor.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if self.uses_lora:
            model = lora.add_adapters(model, actor.lora, seed=self.cfg.trainer.seed)
            self.adapter_config = lora.adapter_config(model)
        self.layout = self.sequence_layout(model)
        self.share_prompt = not self.layout.packs and share_prompt_setting(
            model, actor.model.share_prompt_forward, "actor.model.share_prompt_forward")
        self.model = self.wrap_trainable(model)
        self.optimizer = build_optimizer(self.model.parameters(), actor.optim)  # the trainable ones
        self.scheduler = build_scheduler(self.optimizer, actor.optim, total_steps)
        self.loss_terms = actor_loss_terms(actor)
        self.rollout_correction = rollout_correction_options(self.cfg.algorithm.rollout_correction)
        num_params = sum(p.numel() for p in model.parameters())
        self.start_offloading()
        return num_params

    @resident
    def compute_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.actor.log_prob_micro_batch_size_per_gpu, "old_log_probs")

    # -- LoRA (workers/lora.py): the rollout gets merged weights, a checkpoint the adapters ----------
    @property
    def uses_lora(self) -> bool:
        return self.cfg.actor.lora.rank > 0

    def inference_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.uses_lora:
            return state
        return lora.merged_weights(state, lora.scaling(self.cfg.actor.lora.alpha, self.cfg.actor.lora.rank))

    def state_for_checkpoint(self) -> dict:
        state = super().state_for_checkpoint()
        if self.uses_lora and "model" in state:
            # the base weights are the model folder's, unchanged: the adapters are what was trained
            state["model"] = lora.saved_adapter_names(state["model"])
            state["adapter_config"] = self.adapter_config
        return state

    def load_checkpoint_state(self, state: dict, rng: dict | None = None, strict: bool = True) -> None:
        if not self.uses_lora:
            return super().load_checkpoint_state(state, rng, strict)
        saved_config = state.get("adapter_config")
        if saved_config is None:
            raise ValueError(f"actor rank {self.rank}: the checkpoint holds the whole model, not LoRA adapters; it was "
                             f"saved without actor.lora (this run has actor.lora.rank={self.cfg.actor.lora.rank})")
        self._check_adapter_config(saved_config)
        adapters = lora.live_adapter_names(state["model"])
        trainable = {self._state_name(name) for name, param in self.model.named_parameters() if param.requires_grad}
        if set(adapters) != trainable:
            missing, extra = sorted(trainable - set(adapters)), sorted(set(adapters) - trainable)
            raise ValueError(f"actor rank {self.rank}: the checkpoint's adapters are not this model's (missing "
                             f"{missing[:3]}, unexpected {extra[:3]}): resume with the actor.lora.target_modules "
                             "of the run that saved it")
        super().load_checkpoint_state({**state, "model": adapters}, rng, strict=False)

    def _check_adapter_config(self, saved: dict) -> None:
        lora_cfg = self.cfg.actor.lora
        for key, saved_key, value in (("rank", "r", int(lora_cfg.rank)), ("alpha", "lora_alpha", float(lora_cfg.alpha))):
            if saved.get(saved_key) != value:
                raise ValueError(f"actor rank {self.rank}: the checkpoint's adapters have "
                                 f"{saved_key}={saved.get(saved_key)}, this run has actor.lora.{key}={value}: resume with the actor.lora settings of the "
                                 "run that saved it")

    def _state_name(self, parameter_name: str) -> str:
        """A parameter's name in the full state dict (DDP's wrapper adds a prefix to named_parameters)."""
        is_ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        return parameter_name.removeprefix("module.") if is_ddp else parameter_name

    def update(self, shards: list[TensorDict]) -> list[list[dict[str, Metric]]]:
        # without old log-probs the update is on-policy only if it is the step's one optimizer step
        # (a loss that reads none, e.g. SFT's nll, takes any number of mini-batches)
        reads_old = any("old_log_probs" in term.spec.inputs for term in self.loss_terms)
        if reads_old and len(shards) != 1 and any("old_log_probs" not in shard.keys() for shard in shards):
            raise ValueError(f"actor rank {self.rank}: {len(shards)} mini-batches without old_log_probs; "
                             "only a single on-policy mini-batch may omit them")
        return super().update(shards)

    def micro_loss(self, micro: TensorDict, meta: BatchMeta | None) -> tuple[torch.Tensor, dict[str, Metric]]:
        candidates = micro[TEACHER_TOPK_IDS] if TEACHER_TOPK_IDS in micro.keys() else None
        out = response_forward(self.model, micro, self.cfg.rollout.temperature, with_entropy=True,
                               share_prompt=self.share_prompt, layout=self.layout, candidate_ids=candidates)
        log_prob, entropy = out.log_probs, out.entropy
        forward = {"log_probs": log_prob, "entropy": entropy}
        if candidates is not None:  # actor.distill.top_k: its log-probs of the teacher's top k
            forward[TOPK_LOG_PROBS] = out.candidate_log_probs
        if "old_log_probs" not in micro.keys():
            # on-policy (the driver sent no old log-probs): the weights are the rollout's, ratio 1
            forward["old_log_probs"] = log_prob.detach()
        correction_metrics = self._rollout_correction(micro, forward)
        loss, metrics = compose_loss(self.loss_terms, ChainMap(forward, micro), meta, prefix="actor/")
        # per-token entropy, reported whether or not it is in the loss; an exact token mean whatever the split
        metrics["actor/entropy"] = masked_mean_metric(entropy, micro["response_mask"])
        metrics.update(correction_metrics)
        return loss, metrics

    def _rollout_correction(self, micro: TensorDict, forward: dict) -> dict[str, Metric]:
        """The mismatch of the rollout's log-probs against the proximal ones (forward's or the
        driver's old_log_probs) and, with algorithm.rollout_correction.mode set, the IS weights
        every policy loss multiplies (forward[rollout_is_weights])."""
        options = self.rollout_correction
        if ROLLOUT_LOG_PROBS not in micro.keys():
            if options.enabled:
                raise ValueError(f"actor rank {self.rank}: algorithm.rollout_correction.mode={options.mode} needs "
                                 f"{ROLLOUT_LOG_PROBS}, which this batch lacks")
            return {}
        old = forward["old_log_probs"] if "old_log_probs" in forward else micro["old_log_probs"]
        weights, metrics = compute_rollout_correction(old, micro[ROLLOUT_LOG_PROBS], micro["response_mask"], options)
        if weights is not None:
            forward[ROLLOUT_IS_WEIGHTS] = weights
        return metrics


class ReferenceWorker(LogProbMixin, WorkerBase):
    role = "reference"
    layout_section = "reference"

    def init_model(self, model_path: str) -> int:
        model = load_causal_lm(model_path, self.cfg.actor.model.dtype)
        model.requires_grad_(False)
        self.layout = self.sequence_layout(model)
        self.share_prompt = not self.layout.packs and share_prompt_setting(
            model, self.cfg.actor.model.share_prompt_forward, "actor.model.share_prompt_forward")
        num_params = sum(p.numel() for p in model.parameters())
        # the actor's compute numerics, so that the KL of identical weights is 0
        self.precision = Precision.of(self.cfg.actor)
        if self.precision.sharded:  # what FSDP2's policy computes with; no master copy to keep
            cast_parameters_(model, self.precision.compute)
        self.model = model.to(self.device)
        return num_params

    def forward_context(self):
        return self.precision.forward_context(self.device)

    def compute_ref_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.reference.log_prob_micro_batch_size_per_gpu, "ref_log_prob")
