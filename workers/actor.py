"""The policy (actor) and the frozen reference policy."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.algos import agg_loss, compute_entropy_loss, get_policy_loss_fn, kl_penalty, masked_mean
from rlflow.metrics import Metric, loss_metric, token_mean_metric
from rlflow.protocol import plan_micro_batches
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
        self.policy_loss_fn = get_policy_loss_fn(actor.policy_loss)
        return sum(p.numel() for p in model.parameters())

    def compute_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.actor.log_prob_micro_batch_size_per_gpu, "old_log_probs")

    def update(self, shards: list[TensorDict]) -> list[list[dict[str, Metric]]]:
        # without old log-probs the update is on-policy only if it is the step's one optimizer step
        if len(shards) != 1 and any("old_log_probs" not in shard.keys() for shard in shards):
            raise ValueError(f"actor rank {self.rank}: {len(shards)} mini-batches without old_log_probs; "
                             "only a single on-policy mini-batch may omit them")
        return super().update(shards)

    def micro_loss(self, micro: TensorDict, loss_kwargs: dict, num_tokens: int) -> tuple[torch.Tensor, dict[str, Metric]]:
        actor = self.cfg.actor
        has_meta = "batch_num_tokens" in loss_kwargs
        mask = micro["response_mask"]
        use_entropy = actor.entropy_coeff != 0
        log_prob, entropy = response_log_probs(self.model, micro, self.cfg.rollout.temperature, with_entropy=True)
        # on-policy (the driver sent no old log-probs): the weights are the rollout's, ratio 1
        old_log_prob = micro["old_log_probs"] if "old_log_probs" in micro.keys() else log_prob.detach()
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = self.policy_loss_fn(
            old_log_prob, log_prob, micro["advantages"], mask, actor.loss_agg_mode,
            clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, **loss_kwargs,
        )
        dp = loss_kwargs["dp_size"]
        loss = pg_loss
        metrics = {
            "actor/pg_loss": loss_metric(pg_loss.item(), dp, has_meta),
            "actor/pg_clipfrac": token_mean_metric(pg_clipfrac.item(), num_tokens),
            "actor/ppo_kl": token_mean_metric(ppo_kl.item(), num_tokens),
            "actor/pg_clipfrac_lower": token_mean_metric(pg_clipfrac_lower.item(), num_tokens),
            # per-token entropy, an exact token mean whatever the split
            "actor/entropy": token_mean_metric(masked_mean(entropy.detach(), mask).item(), num_tokens),
        }
        if use_entropy:
            entropy_loss = compute_entropy_loss(entropy, mask, actor.loss_agg_mode, **loss_kwargs)
            loss = loss - actor.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = loss_metric(entropy_loss.item(), dp, has_meta)
        if actor.use_kl_loss:
            kl = kl_penalty(log_prob, micro["ref_log_prob"], actor.kl_loss_type)
            kl_loss = agg_loss(kl, mask, actor.loss_agg_mode, **loss_kwargs)
            loss = loss + actor.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = loss_metric(kl_loss.item(), dp, has_meta)
        return loss, metrics


class ReferenceWorker(LogProbMixin, WorkerBase):
    role = "reference"

    def init_model(self, model_path: str) -> int:
        model = load_causal_lm(model_path, self.cfg.actor.model.dtype)
        model.requires_grad_(False)
        self.model = model.to(self.device)
        return sum(p.numel() for p in model.parameters())

    def compute_ref_log_prob(self, td: TensorDict) -> TensorDict:
        return self._log_prob_shard(td, self.cfg.reference.log_prob_micro_batch_size_per_gpu, "ref_log_prob")
