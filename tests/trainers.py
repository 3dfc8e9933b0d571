"""Test-only trainer subclasses (the driver process; nothing here ships)."""

from __future__ import annotations

from controllers.ppo import PPOTrainer


class CapturingTrainer(PPOTrainer):
    """Keeps the full weights of every trained role after the last step: self.final_weights,
    {"actor": state dict, "critic": ...} (rank 0's, gathered while the workers are alive)."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.final_weights: dict | None = None

    def train_step(self, step: int) -> dict:
        metrics = super().train_step(step)
        if step + 1 == self.cfg.trainer.total_steps:
            self.final_weights = self.gather_weights()
        return metrics


class StepWeightsTrainer(CapturingTrainer):
    """Also keeps the actor's weights after every step: self.actor_versions[k] is the actor after
    k updates (index 0: before the first), as the rollout receives them at each sync."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.actor_versions: list[dict] = []

    def train_step(self, step: int) -> dict:
        if not self.actor_versions:
            self.actor_versions.append(self.gather_weights()["actor"])
        metrics = super().train_step(step)
        self.actor_versions.append(self.final_weights["actor"] if self.final_weights else self.gather_weights()["actor"])
        return metrics


class CriticMetaTrainer(CapturingTrainer):
    """With the critic worker inspecting_workers.MetaRecordingCritic: self.seen_meta[step] is the
    BatchMeta of every shard the critic's update received at that step."""

    def __init__(self, config, **kwargs):
        from inspecting_workers import MetaRecordingCritic

        super().__init__(config, worker_classes={"critic": MetaRecordingCritic}, **kwargs)
        self.seen_meta: list[list] = []

    def train_step(self, step: int) -> dict:
        metrics = super().train_step(step)
        self.seen_meta.append(self.groups["critic"].call_all("seen_meta")[0])
        return metrics
