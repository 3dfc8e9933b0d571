"""The value model: the actor's architecture with a scalar head (AutoModelForTokenClassification)."""

from __future__ import annotations

from collections import ChainMap

import torch
from tensordict import TensorDict

from rlflow.algos import compose_loss, critic_loss_terms, masked_mean_metric
from rlflow.metrics import Metric
from rlflow.protocol import BatchMeta, plan_micro_batches
from workers.forward import response_values, share_prompt_setting
from workers.precision import DTYPES
from workers.trainable import TrainableWorker, build_optimizer, build_scheduler, enable_gradient_checkpointing, resident


def load_value_model(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1
    # a value head must be deterministic: no dropout on the head
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=DTYPES[dtype])


class CriticWorker(TrainableWorker):
    role = "critic"
    section = "critic"
    layout_section = "critic"

    def init_model(self, model_path: str, total_steps: int) -> int:
        critic = self.cfg.critic
        model = load_value_model(model_path, critic.model.dtype)
        if critic.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.layout = self.sequence_layout(model)
        self.share_prompt = not self.layout.packs and share_prompt_setting(
            model, critic.model.share_prompt_forward, "critic.model.share_prompt_forward")
        self.model = self.wrap_trainable(model)
        self.optimizer = build_optimizer(self.model.parameters(), critic.optim)
        self.scheduler = build_scheduler(self.optimizer, critic.optim, total_steps)
        self.loss_terms = critic_loss_terms(critic)
        num_params = sum(p.numel() for p in model.parameters())
        self.start_offloading()
        return num_params

    @resident
    def compute_values(self, td: TensorDict) -> TensorDict:
        self.model.eval()
        td = td.to(self.device)
        values = td["responses"].new_zeros(td["responses"].shape, dtype=torch.float32)
        with torch.no_grad(), self.forward_context():
            for idx in plan_micro_batches(td, micro_batch_size=self.cfg.critic.forward_micro_batch_size_per_gpu,
                                          group_prompts=self.share_prompt):
                values[idx] = response_values(self.model, td[idx], self.share_prompt, self.layout) * td[idx]["response_mask"]
        return TensorDict({"values": values.cpu()}, batch_size=td.batch_size)

    def micro_loss(self, micro: TensorDict, meta: BatchMeta | None) -> tuple[torch.Tensor, dict[str, Metric]]:
        vpreds = response_values(self.model, micro, self.share_prompt, self.layout)
        loss, metrics = compose_loss(self.loss_terms, ChainMap({"vpreds": vpreds}, micro), meta, prefix="critic/")
        metrics["critic/vpred_mean"] = masked_mean_metric(vpreds, micro["response_mask"])
        return loss, metrics
