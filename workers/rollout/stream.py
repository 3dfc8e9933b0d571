"""Partial rollout (rollout.partial): groups stream through a rollout rank chunk by chunk.

A rank holds the groups the driver submitted (a prompt, n responses each). At most `max_rows`
responses are generated at a time; the engine samples `chunk_tokens` more tokens for all of them
(`RolloutEngine.continue_ids`), and between two chunks

- a finished response's slot goes to the next submitted group (the engine's batch stays full
  however long the longest response is), and a group whose n responses all ended is finished;
- a weight sync lands: the next chunk samples with the new weights, the responses in flight go on
  under them (their prefix read again under the new weights, as AReaL and verl's partial
  rollouts resume an interrupted request).

Every token records the weight version that sampled it and its log-prob under the distribution
it was drawn from, so the rollout correction weights each token by its own behaviour policy and
the driver bounds the lag of the oldest token (controllers/rollout_source.py, StreamingQueue).

`GroupStream` is the bookkeeping, called by one thread; `StreamRunner` runs it in a thread of the
rollout worker's process, beside the worker's Ray calls (a sync, a validation) that take the
engine between chunks.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

# a chunk's seed is the stream's + this x its index. The driver spaces runs' stream seeds 1_000_003
# apart (trainer.seed), so the stride must not be a multiple of it: with a stride of 1_000_003,
# trainer.seed s + 1 drew chunk c with the seed trainer.seed s drew chunk c + 1 with
CHUNK_SEED_STRIDE = 1_000_000_007


@dataclass
class _Row:
    group: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class FinishedGroup:
    """What a rank hands the driver: a group's n responses, each token's log-prob and version."""

    group: int
    responses: list[list[int]]
    log_probs: list[list[float]] | None
    versions: list[list[int]]


class GroupStream:
    def __init__(self, engine, *, n: int, max_rows: int, chunk_tokens: int, max_response_length: int,
                 eos_token_id: int, do_sample: bool, return_log_probs: bool, seed: int):
        if max_rows < n:
            raise ValueError(f"a rank generating {max_rows} responses at a time cannot hold one group of n={n}")
        self.engine, self.n, self.max_rows = engine, n, max_rows
        self.chunk_tokens, self.max_response_length = chunk_tokens, max_response_length
        self.eos_token_id, self.do_sample, self.return_log_probs = eos_token_id, do_sample, return_log_probs
        self.seed, self.num_chunks = seed, 0
        self.pending: list[tuple[int, list[int]]] = []  # (group, prompt ids) not started, in order
        self.active: list[_Row] = []
        self.start_version: dict[int, int] = {}  # group -> the version of its first tokens
        self.finished: list[FinishedGroup] = []

    def submit(self, groups: list[int], prompts: list[list[int]]) -> None:
        for group, prompt in zip(groups, prompts, strict=True):
            if not prompt:
                raise ValueError(f"group {group}: empty prompt")
            self.pending.append((group, list(prompt)))

    def has_work(self) -> bool:
        return bool(self.pending or self.active)

    def unfinished(self) -> dict[int, int | None]:
        """Every group submitted and not finished: the version of its first tokens (None: not started)."""
        status = {group: None for group, _ in self.pending}
        status.update({row.group: self.start_version[row.group] for row in self.active})
        return status

    def take_finished(self) -> list[FinishedGroup]:
        finished, self.finished = self.finished, []
        return finished

    def _admit(self, version: int) -> None:
        """Whole groups into the free slots, in submission order (a group's rows start together). A
        response that ended frees its slot at once, before the rest of its group ends."""
        while self.pending and sum(not row.done for row in self.active) + self.n <= self.max_rows:
            group, prompt = self.pending.pop(0)
            self.start_version[group] = version
            self.active.extend(_Row(group, prompt) for _ in range(self.n))

    @torch.no_grad()
    def step(self, version: int, guard=None, pause=None) -> None:
        """One chunk for every response in flight, sampled by the weights of `version`. `guard`
        (a lock) is held while the bookkeeping changes, not while the engine samples; `pause()`
        true ends the chunk early where the engine can (RolloutEngine.continue_ids)."""
        guard = guard if guard is not None else contextlib.nullcontext()
        with guard:
            self._admit(version)
            rows = [row for row in self.active if not row.done]  # an ended response waits for its group
        if not rows:
            return
        left = [self.max_response_length - len(row.tokens) for row in rows]
        new_tokens, new_log_probs = self.engine.continue_ids(
            [row.prompt + row.tokens for row in rows], do_sample=self.do_sample,
            seed=self.seed + CHUNK_SEED_STRIDE * self.num_chunks, return_log_probs=self.return_log_probs,
            temperature=self.engine.temperature, top_p=self.engine.top_p,
            max_new_tokens=min(self.chunk_tokens, max(left)), pause=pause)
        self.num_chunks += 1
        with guard:
            for index, row in enumerate(rows):
                tokens = list(new_tokens[index][: left[index]])
                if self.eos_token_id in tokens:
                    tokens = tokens[: tokens.index(self.eos_token_id) + 1]
                    row.done = True
                row.tokens += tokens
                if self.return_log_probs:
                    row.log_probs += list(new_log_probs[index][: len(tokens)])
                row.versions += [version] * len(tokens)
                row.done = row.done or len(row.tokens) >= self.max_response_length
            self._collect_finished()

    def _collect_finished(self) -> None:
        by_group: dict[int, list[_Row]] = {}
        for row in self.active:
            by_group.setdefault(row.group, []).append(row)
        for group, rows in by_group.items():
            if all(row.done for row in rows):
                self.finished.append(FinishedGroup(
                    group, [row.tokens for row in rows], [row.log_probs for row in rows] if self.return_log_probs else None,
                    [row.versions for row in rows]))
                del self.start_version[group]
        done = {group.group for group in self.finished}
        self.active = [row for row in self.active if row.group not in done]


class EngineLock:
    """The engine, shared by a stream's chunks and the worker's calls (a weight load, a
    validation). A call waiting for it goes before the stream's next chunk: with a plain lock the
    stream thread, which asks again as soon as a chunk ends, could keep it for as long as it has
    work."""

    def __init__(self):
        self.lock = threading.Lock()
        self._turn = threading.Condition()
        self._calls_waiting = 0

    @contextlib.contextmanager
    def call(self):
        with self._turn:
            self._calls_waiting += 1
        self.lock.acquire()
        with self._turn:
            self._calls_waiting -= 1
            self._turn.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def waiting(self) -> bool:
        """A call is waiting: the chunk in progress should end at its next token."""
        return self._calls_waiting > 0

    @contextlib.contextmanager
    def chunk(self):
        with self._turn:
            self._turn.wait_for(lambda: self._calls_waiting == 0)
        with self.lock:
            yield


class StreamRunner:
    """A GroupStream driven by its own thread. `engine_lock` is held for every chunk: a weight load
    or another generate call takes the engine between two chunks (EngineLock). The weight version is counted
    here: the one the stream was opened with, then one more per `weights_loaded` (the driver syncs
    once per step after opening; controllers/rollout_source.py checks the count it reports)."""

    def __init__(self, stream: GroupStream, engine_lock: EngineLock, version: int, threads: callable):
        self.stream, self.engine_lock, self.version = stream, engine_lock, version
        self.threads = threads  # the share of the cores the worker's current phase has
        self.changed = threading.Condition()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="rlflow-partial-rollout", daemon=True)
        self.thread.start()

    def submit(self, groups: list[int], prompts: list[list[int]]) -> None:
        with self.changed:
            self.stream.submit(groups, prompts)
            self.changed.notify_all()

    def weights_loaded(self) -> None:
        """Called with engine_lock held, right after the engine loaded new weights."""
        with self.changed:
            self.version += 1

    def take(self, wait_s: float) -> tuple[list[FinishedGroup], dict[int, int | None], int]:
        """The groups finished since the last take (waiting up to wait_s for one), the unfinished
        groups' start versions, and the current weight version."""
        with self.changed:
            if not self.stream.finished and self.error is None and self.stream.has_work():
                self.changed.wait_for(lambda: self.stream.finished or self.error is not None, timeout=wait_s)
            if self.error is not None:
                raise RuntimeError(f"partial rollout: generation failed: {self.error!r}") from self.error
            return self.stream.take_finished(), self.stream.unfinished(), self.version

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.thread.join(timeout=60)

    def _run(self) -> None:
        try:
            while True:
                with self.changed:
                    self.changed.wait_for(lambda: self.stopping or self.stream.has_work())
                    if self.stopping:
                        return
                with self.engine_lock.chunk():
                    threads = self.threads()
                    if threads and torch.get_num_threads() != threads:  # a thread count is per thread
                        torch.set_num_threads(threads)
                    with self.changed:
                        version = self.version
                    self.stream.step(version, guard=self.changed, pause=self.engine_lock.waiting)
                with self.changed:
                    self.changed.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the driver's next take
            with self.changed:
                self.error = err
                self.changed.notify_all()
