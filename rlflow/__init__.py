"""rlflow: actor/critic RL for language models on Ray, exact however a mini-batch is split.

`from rlflow import RLFlow, load_config; RLFlow(load_config(None, ["trainer.total_steps=5"])).fit()`;
supervised fine-tuning: `from rlflow import SFT, sft_config; SFT(sft_config(None, [...])).fit()`.
The names are imported lazily, so `import rlflow.algos` stays torch-only (no omegaconf, no Ray).
"""

__all__ = ["RLFlow", "SFT", "load_config", "sft_config"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "RLFlow":
        from controllers.ppo import RLFlow

        return RLFlow
    if name in ("SFT", "sft_config"):
        from controllers import sft

        return getattr(sft, name)
    if name == "load_config":
        from rlflow.config import load_config

        return load_config
    raise AttributeError(f"module 'rlflow' has no attribute {name!r}")
