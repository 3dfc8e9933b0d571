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
