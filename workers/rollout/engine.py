"""The rollout engine seam: a base class, a registry, and the one place a rollout batch is built.

An engine turns prompts into token ids (and the log-prob of each sampled token under the
distribution it was sampled from: temperature, top-k, top-p applied) and takes the actor's
weights. Everything else — the response-mask rule, padding, the batch keys — is
`rlflow.protocol.assemble_rollout`, shared by every engine. A new engine is a subclass with
`generate_ids`, `load_weights` and `from_config`, registered with `@register_engine(name)` (one
outside rlflow: in a module of `trainer.imports`, rlflow/plugins.py) and chosen with
`rollout.name=<name>` (or `rollout.name=<module>:<Class>`).
An engine that can free its memory while the trainers update (`sleep` / `wake_up`) overrides
`_release_memory`, `_restore_memory` and `frees_memory_when_sleeping`.
"""

from __future__ import annotations

import importlib

import torch
from tensordict import TensorDict

from rlflow.plugins import ENGINE_MODULES
from rlflow.protocol import assemble_rollout, left_pad

ENGINES: dict[str, type["RolloutEngine"]] = {}


def register_engine(name: str):
    def decorator(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise TypeError(f"engine {name!r}: {cls!r} is not a RolloutEngine subclass")
        if ENGINES.get(name, cls) is not cls:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = cls
        ENGINE_MODULES[name] = cls.__module__  # what config validation reads (it cannot import workers)
        cls.name = name
        return cls

    return decorator


def get_engine(name: str) -> type["RolloutEngine"]:
    """A registered engine class, or `module:Class` for an engine defined outside rlflow."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise TypeError(f"rollout.name={name!r} is not a workers.rollout.engine.RolloutEngine subclass")
        return cls
    if name not in ENGINES and name in ENGINE_MODULES:
        importlib.import_module(ENGINE_MODULES[name])
    if name not in ENGINES:
        raise ValueError(f"rollout.name={name!r}: no such engine; registered: {', '.join(sorted(ENGINE_MODULES))}")
    return ENGINES[name]


class RolloutEngine:
    """Generates n responses per prompt; `load_weights` syncs the actor into it.

    Sampling (`temperature`, `top_p`, `top_k`) applies when `do_sample`; greedy otherwise. A call
    may override the temperature and top_p (validation samples at rollout.val_temperature and
    rollout.val_top_p) and generate fewer than data.max_response_length tokens (max_new_tokens: an
    agent's turn, within what is left of the trajectory's budget).
    """

    name = "engine"
    sleeping = False  # between sleep() and wake_up()
    # True: dropping the engine frees all it holds, and its process may host another run's rollout
    # rank (controllers/worker_group.py, IdleWorkers); an engine that changes the process (threads,
    # subprocesses, global patches) keeps False and its process stops with the run
    reusable_process = False

    def __init__(self, *, max_response_length: int, pad_token_id: int, eos_token_id: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1):
        self.max_response_length = int(max_response_length)
        self.pad_token_id, self.eos_token_id = int(pad_token_id), int(eos_token_id)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)

    @classmethod
    def from_config(cls, model_path: str, cfg, *, device: torch.device, seed: int, pad_token_id: int,
                    eos_token_id: int) -> "RolloutEngine":
        """The engine of a rollout rank, from the run's config (its own options included)."""
        raise NotImplementedError

    @staticmethod
    def common_kwargs(cfg, seed: int, pad_token_id: int, eos_token_id: int) -> dict:
        rollout = cfg.rollout
        return dict(max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
                    temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, dtype=rollout.dtype,
                    seed=seed, pad_token_id=pad_token_id, eos_token_id=eos_token_id)

    def generate_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int, do_sample: bool,
                     seed: int | None, return_log_probs: bool, temperature: float, top_p: float,
                     max_new_tokens: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """B*n generated token lists in repeat_interleave order (row r answers prompt r // n), and
        with return_log_probs the log-prob of each of those tokens under the distribution it was
        drawn from (greedy: the raw logits'). Trailing tokens after an EOS are cut by the caller."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, batch: TensorDict, *, n: int, do_sample: bool, seed: int | None = None,
                 return_log_probs: bool = False, temperature: float | None = None,
                 top_p: float | None = None, max_new_tokens: int | None = None) -> TensorDict:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be [B, P]")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        width = self.max_response_length if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= width <= self.max_response_length:
            raise ValueError(f"max_new_tokens={width} must be in [1, max_response_length={self.max_response_length}]")
        self.check_awake("generate")
        empty = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"prompt {empty[0]} is empty (attention_mask all 0)")
        responses, log_probs = self.generate_ids(
            input_ids, attention_mask, n=n, do_sample=do_sample, seed=seed, return_log_probs=return_log_probs,
            temperature=self.temperature if temperature is None else float(temperature),
            top_p=self.top_p if top_p is None else float(top_p), max_new_tokens=width)
        return assemble_rollout(input_ids, attention_mask, responses, n, width, self.pad_token_id, self.eos_token_id,
                                log_probs)

    def continue_ids(self, sequences: list[list[int]], *, do_sample: bool, seed: int | None, return_log_probs: bool,
                     temperature: float, top_p: float, max_new_tokens: int, pause=None
                     ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One sample of up to max_new_tokens more tokens after each sequence (a prompt and its
        response so far): a chunk of partial rollout (workers/rollout/stream.py). The prefix is
        read again under the engine's current weights, as the peers' partial rollouts resume an
        interrupted request; an engine with a cheaper way to resume overrides this (the HF engine
        keeps each sequence's cache between chunks). `pause()` true asks the chunk to end early,
        between two tokens (an engine may then hand back fewer tokens for some rows than for
        others, none at all for a row); this one runs the chunk out."""
        input_ids, attention_mask = left_pad(sequences, self.pad_token_id)
        return self.generate_ids(input_ids, attention_mask, n=1, do_sample=do_sample, seed=seed,
                                 return_log_probs=return_log_probs, temperature=temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    # -- sleep: free the engine's memory while another phase (the trainers' update) runs ----------
    @property
    def frees_memory_when_sleeping(self) -> bool:
        """Whether `sleep` gives memory back (this engine, on this platform); False: it does nothing."""
        return False

    def sleep(self, *, keep_weights: bool = True) -> None:
        """Free what the engine can until `wake_up`; nothing but `wake_up` may be called meanwhile.

        keep_weights=False lets the engine discard its weights instead of moving them aside: the
        caller then loads weights (`load_weights`) after `wake_up` and before generating (rlflow
        syncs the actor's weights after every update anyway)."""
        if not self.sleeping:
            self._release_memory(keep_weights)
            self.sleeping = True

    def wake_up(self) -> None:
        """Take back what `sleep` freed (the weights too, unless it discarded them)."""
        if self.sleeping:
            self._restore_memory()
            self.sleeping = False

    def _release_memory(self, keep_weights: bool) -> None:
        """What `sleep` does; an engine that can free memory overrides it and the two next."""

    def _restore_memory(self) -> None:
        """What `wake_up` does."""

    def check_awake(self, what: str) -> None:
        if self.sleeping:
            raise RuntimeError(f"rollout engine {self.name!r}: {what} while asleep (call wake_up first)")

    def shutdown(self) -> None:
        pass
