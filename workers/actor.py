"""The policy (actor) and the frozen reference policy."""

from __future__ import annotations

from collections import ChainMap

import torch
from tensordict import TensorDict

from rlflow.algos import ROLLOUT_IS_WEIGHTS, ROLLOUT_LOG_PROBS, actor_loss_terms, compose_loss, masked_mean_metric
from rlflow.algos.rollout_correction import compute_rollout_correction
from rlflow.algos.rollout_correction import options_from_config as rollout_correction_options
from rlflow.metrics import Metric
from rlflow.protocol import BatchMeta, plan_micro_batches
from workers.base import WorkerBase
from workers.forward import response_log_probs
from workers.trainable import TrainableWorker, build_optimizer, build_scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if not any(arch.endswith("ForCausalLM") for arch in (config.architectures or [])):
        raise ValueError(
            f"model path {path} holds a {config.architectures or config.model_type} model, not a causal LM "
            "(actor.model.path must point at a *ForCausalLM checkpoint)"
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])


class LogProbMixin:
    """compute_log_prob over a shard, micro-batched, no grad."""

    def _log_prob_shard(self, td: TensorDict, micro_batch_size: int, out_key: str) -> TensorDict:
        self.model.eval()
        td = td.to(self.device)
        temperature = self.cfg.rollout.temperature
        outputs = []
        with torch.no_grad():
            for idx in plan_micro_batches(td, micro_batch_size=micro_batch_size):
                log_probs, _ = response_log_probs(self.model, td[idx], temperature)
                outputs.append(log_probs)
        result = torch.cat(outputs) if outputs else td["responses"].new_zeros(td["responses"].shape, dtype=torch.float32)
        return TensorDict({out_key: result.cpu()}, batch_size=td.batch_size)


class ActorWorker(LogProbMixin, TrainableWorker):
    role = "actor"
    section = "actor"

    def init_model(self, model_path: str, total_steps: int) -> int:
        actor = self.cfg.actor
        model = load_causal_lm(model_path, actor.model.dtype)
        if actor.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.model = self.wrap_for_training(model, actor.strategy)
        self.optimizer = build_optimizer(self.model.parameters(), actor.optim)
        self.scheduler = build_scheduler(self.optimizer, actor.optim, total_steps)
        self.loss_terms = actor_loss_terms(actor)
        self.rollout_correction = rollout_correction_options(self.cfg.algorithm.rollout_correction)
        return sum(p.numel() for p in model.parameters())

    def compute_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.actor.log_prob_micro_batch_size_per_gpu, "old_log_probs")

    def update(self, shards: list[TensorDict]) -> list[list[dict[str, Metric]]]:
        # without old log-probs the update is on-policy only if it is the step's one optimizer step
        if len(shards) != 1 and any("old_log_probs" not in shard.keys() for shard in shards):
            raise ValueError(f"actor rank {self.rank}: {len(shards)} mini-batches without old_log_probs; "
                             "only a single on-policy mini-batch may omit them")
        return super().update(shards)

    def micro_loss(self, micro: TensorDict, meta: BatchMeta | None) -> tuple[torch.Tensor, dict[str, Metric]]:
        log_prob, entropy = response_log_probs(self.model, micro, self.cfg.rollout.temperature, with_entropy=True)
        forward = {"log_probs": log_prob, "entropy": entropy}
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

    def init_model(self, model_path: str) -> int:
        model = load_causal_lm(model_path, self.cfg.actor.model.dtype)
        model.requires_grad_(False)
        self.model = model.to(self.device)
        return sum(p.numel() for p in model.parameters())

    def compute_ref_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.reference.log_prob_micro_batch_size_per_gpu, "ref_log_prob")
