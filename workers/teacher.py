"""The teacher of on-policy distillation (actor.distill, controllers/roles.py: TEACHER).

A frozen model, run like the reference: loaded in actor.model.dtype, computing with the actor's
precision, at the rollout temperature, so that the per-token reverse KL compares the two models'
log-probs of the same sampled tokens under the same numerics. Only its model folder differs (a
stronger model with the actor's tokenizer).
"""

from __future__ import annotations

from tensordict import TensorDict

from workers.actor import ReferenceWorker


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
        return self._log_prob_shard(td, self.cfg.teacher.log_prob_micro_batch_size_per_gpu, "teacher_log_prob")
