"""The teacher of on-policy distillation (actor.distill, controllers/roles.py: TEACHER).

A frozen model, run like the reference: loaded in actor.model.dtype, computing with the actor's
precision, at the rollout temperature, so that the per-token reverse KL compares the two models'
log-probs of the same sampled tokens under the same numerics. Only its model folder differs (a
stronger model with the actor's tokenizer).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlflow.algos.losses import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS
from rlflow.protocol import plan_micro_batches
from workers.actor import ReferenceWorker
from workers.forward import response_forward


class TeacherWorker(ReferenceWorker):
    role = "teacher"
    layout_section = "teacher"  # teacher.use_remove_padding / sp_size

    def init_model(self, model_path: str) -> int:
        num_params = super().init_model(model_path)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if vocab != self.model.config.vocab_size:  # pragma: no cover - a malformed folder
            raise ValueError(f"teacher.model.path={model_path}: its output layer has {vocab} rows, its config "
                             f"says vocab_size={self.model.config.vocab_size}")
        self.vocab_size = vocab
        return num_params

    def compute_teacher_log_prob(self, td: TensorDict) -> TensorDict:
        token_ids = td["responses"]
        if int(token_ids.max()) >= self.vocab_size:
            raise ValueError(f"teacher rank {self.rank}: a response token id ({int(token_ids.max())}) is beyond the "
                             f"teacher's vocabulary ({self.vocab_size}): teacher.model.path must share the actor's tokenizer")
        top_k = self.cfg.actor.distill.top_k
        if top_k == 0:
            return self._log_prob_shard(td, self.cfg.teacher.log_prob_micro_batch_size_per_gpu, "teacher_log_prob")
        return self._topk_shard(td, top_k)

    def _topk_shard(self, td: TensorDict, top_k: int) -> TensorDict:
        """teacher_log_prob, and the teacher's top_k tokens at each position with their log-probs
        (actor.distill.top_k: the forward KL's targets), [B, R, top_k]."""
        if top_k > self.vocab_size:
            raise ValueError(f"actor.distill.top_k={top_k} is more than the teacher's vocabulary ({self.vocab_size})")
        self.model.eval()
        td = td.to(self.device)
        rows, width = td["responses"].shape
        out = TensorDict({"teacher_log_prob": torch.zeros(rows, width),
                          TEACHER_TOPK_LOG_PROBS: torch.zeros(rows, width, top_k),
                          TEACHER_TOPK_IDS: torch.zeros(rows, width, top_k, dtype=torch.long)}, batch_size=[rows])
        with torch.no_grad(), self.forward_context():
            for idx in plan_micro_batches(td, micro_batch_size=self.cfg.teacher.log_prob_micro_batch_size_per_gpu,
                                          group_prompts=self.share_prompt):
                forward = response_forward(self.model, td[idx], self.cfg.rollout.temperature, share_prompt=self.share_prompt,
                                           layout=self.layout, top_k=top_k)
                out["teacher_log_prob"][idx] = forward.log_probs.cpu()
                out[TEACHER_TOPK_LOG_PROBS][idx] = forward.topk_log_probs.cpu()
                out[TEACHER_TOPK_IDS][idx] = forward.topk_ids.cpu()
        return out
