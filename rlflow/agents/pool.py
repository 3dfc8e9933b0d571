"""Environments off the driver: a pool of Ray processes, with a timeout per reset or step call.

``EnvPool`` keeps every episode's environment (``cls(**env_kwargs)``) in one of ``num_workers``
Ray actor processes (``EnvWorker``; episode i lives in process i % num_workers). Each reset or step
of an episode is one Ray call to its process; the calls for a batch are all sent at once, so the
processes work concurrently and each runs its episodes' calls one after the other (~0.3 ms of Ray
overhead a call). ``LocalEnvPool`` is the same in the driver process, without a timeout
(rollout.agent.num_workers=0). Both check what an environment returns with the same code, so they
give the same outcomes.

The timeout: a call's ``timeout_s`` clock starts when its process begins it, as the driver sees it:
when the call is sent to an idle process, or when the result of the call before it in that
process arrives (a process runs its calls in order, and Ray sends a result back from a thread that
does not need the GIL, so even a call that holds the GIL cannot hide which call it is). A call is
thus stopped within ``timeout_s`` plus the driver's wake-up and the kill (measured: 2.04 s for
timeout_s=2). A call that runs past ``timeout_s`` is stopped by killing its process (a hung Python
call cannot be interrupted reliably from another thread); a call that kills its process
(``os._exit``, a segfault, the OOM killer) is handled the same way. A process that dies may take
the result of the call before with it, though: when it had more than one call in flight, its
calls are rerun one at a time on its replacement, which names the culprit when it dies again (at
the cost of running it twice). Both then follow ``on_error`` like a call that raises or returns
something unusable: "raise" stops the run with an ``EnvError`` naming the episode, its data_source,
the call and the cause (the first failing call in the order given, as LocalEnvPool raises; the
pool is closed, and the next reset starts new processes); "zero" ends that episode with
``EnvOutcome(reward=0.0, done=True, error=...)``.

Replay: the other episodes that lived in a killed process are not lost. Its replacement restores
each of them before its next call by creating the environment again and calling ``reset(row)`` and
``step(turn)`` with every turn the episode has had (the pool keeps the row and the turns of each
live episode), discarding those outcomes. Environments must therefore be deterministic given
(row, turns so far): a replay that fails, or that ends the episode, is an error of that episode.
Each replayed call has a ``timeout_s`` of its own.

The pool's processes reserve no Ray CPU (``num_cpus=0``), like the reward pool's: they never wait
for, nor hold up, the placement groups of the trainer's workers. They start on the first reset
(Ray must be running). Not thread-safe: one reset or step at a time. Starting, checking, replacing
and stopping the processes is ``rlflow.procpool.ProcessPool``'s; a reset or step is a ``Request`` to it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import ray
from omegaconf import OmegaConf

from rlflow.agents import StepResult, load_env_class
from rlflow.procpool import PoolWorker, ProcessPool, ProcessPoolOwner, Request, Slot, death_detail, error_line
from rlflow.rewards import as_number

__all__ = ["EnvError", "EnvOutcome", "EnvPool", "EnvWorker", "LocalEnvPool", "make_env_pool"]

logger = logging.getLogger(__name__)

# How many of a process's in-flight results the driver collects per wake-up: enough that a fast
# environment costs few wake-ups, few enough that the check stays cheap for large batches.
COLLECT_WINDOW = 64


class EnvError(RuntimeError):
    """An environment call failed, hung, killed its process, or returned something unusable."""


@dataclass
class EnvOutcome(StepResult):
    """A checked StepResult (reset's observation in `observation`), or a failed call's outcome."""

    error: str | None = None  # set when the call failed and on_error=zero made it a terminal 0-reward outcome


# -- one call, checked: shared by the driver (LocalEnvPool) and the processes (EnvWorker) -----------

@dataclass
class _Result:
    """What one reset or step call gave: an outcome, or ``cause`` (a phrase: "raised KeyError: 'x'")
    and the exception, if any."""

    outcome: EnvOutcome | None = None
    cause: str | None = None
    exc: BaseException | None = None


def _raised(err: BaseException) -> _Result:
    return _Result(cause=f"raised {type(err).__name__}: {err}", exc=err)


def _observation(value, method: str) -> str | _Result:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return _Result(cause=f"returned {type(value).__name__} as the observation; {method} must give a str (or None)")


def reset_env(cls: type, env_kwargs: dict, row: dict) -> tuple[object | None, _Result]:
    """A new environment for ``row`` and its first observation, or (None, the error)."""
    try:
        env = cls(**env_kwargs)
        first = env.reset(row)
    except Exception as err:  # noqa: BLE001 - the environment's error: that episode's
        return None, _raised(err)
    observation = _observation(first, "reset")
    if isinstance(observation, _Result):
        return None, observation
    return env, _Result(EnvOutcome(observation))


def step_env(env, turn: str) -> _Result:
    """``env.step(turn)`` as a checked EnvOutcome: a StepResult with a str (or None) observation,
    a finite numeric reward and a dict (or None) info."""
    try:
        result = env.step(turn)
    except Exception as err:  # noqa: BLE001 - the environment's error: that episode's
        return _raised(err)
    if not isinstance(result, StepResult):
        return _Result(cause=f"returned {type(result).__name__}; step must return an rlflow.agents.StepResult")
    observation = _observation(result.observation, "step")
    if isinstance(observation, _Result):
        return observation
    reward = as_number(result.reward)
    if reward is None or not math.isfinite(reward):
        return _Result(cause=f"returned reward {result.reward!r}; the reward must be a finite number")
    info = {} if result.info is None else result.info
    if not isinstance(info, dict):
        return _Result(cause=f"returned info of type {type(info).__name__}; info must be a dict")
    return _Result(EnvOutcome(observation, reward, bool(result.done), info))


# -- the driver's side: episodes, errors, on_error --------------------------------------------------

@dataclass
class _Episode:
    row: dict
    turns: list[str] = field(default_factory=list)  # the turns it has taken (for a replay)


def _call_name(turn_no: int | None) -> str:
    return "reset" if turn_no is None else f"step of turn {turn_no}"


class _Episodes:
    """The live episodes and the error policy, shared by EnvPool and LocalEnvPool."""

    def __init__(self, on_error: str, max_logged_errors: int = 5):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"rollout.agent.on_error={on_error!r} is not one of raise, zero")
        self.on_error = on_error
        self.live: dict[int, _Episode] = {}
        self.num_errors = 0  # episodes ended by an error (on_error=zero), over the pool's life
        self.max_logged_errors = max_logged_errors

    def start(self, rows: list[dict]) -> None:
        self.live = {i: _Episode(row) for i, row in enumerate(rows)}

    def check_step(self, episodes: list[int], turns: list[str]) -> None:
        if len(episodes) != len(turns):
            raise ValueError(f"step: {len(episodes)} episodes but {len(turns)} turns")
        if len(set(episodes)) != len(episodes):
            raise ValueError("step: an episode is given twice")
        for episode, turn in zip(episodes, turns):
            if episode not in self.live:
                raise ValueError(f"step: episode {episode} is not live (it ended, or reset did not start it)")
            if not isinstance(turn, str):
                raise TypeError(f"step: the turn of episode {episode} is a {type(turn).__name__}, not a str")

    def message(self, episode: int, turn_no: int | None, cause: str, replay: bool = False) -> str:
        call = _call_name(turn_no)
        if replay:
            call += " (replayed to restore the episode after its process was replaced)"
        source = self.live[episode].row.get("data_source") if episode in self.live else None
        return f"environment {call} on episode {episode} (data_source={source!r}) {cause}"

    def failed(self, message: str, exc: BaseException | None) -> EnvOutcome:
        """The outcome of a failed call under on_error=zero (the caller raises under raise)."""
        self.num_errors += 1
        if self.num_errors <= self.max_logged_errors:
            logger.warning("%s; the episode ends with reward 0 (rollout.agent.on_error='zero')", message)
        return EnvOutcome(reward=0.0, done=True, error=message)

    def took(self, episode: int, turn: str | None, outcome: EnvOutcome) -> None:
        """Records a call's outcome: the turn joins the history, or the episode ends."""
        if outcome.done or outcome.error is not None:
            self.live.pop(episode, None)
        elif turn is not None:
            self.live[episode].turns.append(turn)


class LocalEnvPool:
    """The environments in the driver process: calls one after the other, no timeout
    (rollout.agent.num_workers=0). Under on_error=raise the first failing call raises EnvError."""

    def __init__(self, env_spec: str, env_kwargs: dict, on_error: str = "raise"):
        self.cls = load_env_class(env_spec)
        self.env_kwargs = dict(env_kwargs or {})
        self.episodes = _Episodes(on_error)
        self.envs: dict[int, object] = {}

    def reset(self, rows: list[dict]) -> list[EnvOutcome]:
        self.episodes.start(rows)
        self.envs = {}
        outcomes = []
        for episode, row in enumerate(rows):
            env, result = reset_env(self.cls, self.env_kwargs, row)
            outcomes.append(self._settle(episode, None, None, result))
            if env is not None:
                self.envs[episode] = env
        return outcomes

    def step(self, episodes: list[int], turns: list[str]) -> list[EnvOutcome]:
        self.episodes.check_step(episodes, turns)
        outcomes = []
        for episode, turn in zip(episodes, turns):
            turn_no = len(self.episodes.live[episode].turns) + 1
            outcomes.append(self._settle(episode, turn, turn_no, step_env(self.envs[episode], turn)))
        return outcomes

    def _settle(self, episode: int, turn: str | None, turn_no: int | None, result: _Result) -> EnvOutcome:
        outcome = result.outcome
        if outcome is None:
            message = self.episodes.message(episode, turn_no, result.cause)
            if self.episodes.on_error == "raise":
                raise EnvError(message) from result.exc
            outcome = self.episodes.failed(message, result.exc)
        self.episodes.took(episode, turn, outcome)
        if episode not in self.episodes.live:
            self.envs.pop(episode, None)
        return outcome

    def close(self) -> None:
        self.envs = {}
        self.episodes.live = {}


# -- the processes -----------------------------------------------------------------------------------

class EnvWorker(PoolWorker):
    """One pool process: loads the environment class once, then holds its episodes' environments
    and runs their calls. An environment is dropped when its episode ends (done or failed)."""

    process_name = "environment process"
    error_type = EnvError

    def __init__(self, env_spec: str, env_kwargs: dict, sys_path: list[str], cwd: str):
        super().__init__(sys_path)
        try:  # the environment file opens what it would in the driver
            os.chdir(cwd)
        except OSError:  # another node without that folder: relative paths are then the env's problem
            pass
        self.env_kwargs = env_kwargs
        self.envs: dict[int, object] = {}
        self.cls = self.load(load_env_class, env_spec)

    def reset(self, episode: int, row: dict, clear: bool = False) -> _Result:
        """``clear``: first drop every environment (the previous episodes')."""
        if clear:
            self.envs.clear()
        try:
            env, result = reset_env(self.cls, self.env_kwargs, row)
        except BaseException as err:  # noqa: BLE001 - e.g. sys.exit() in the environment: that episode's error
            env, result = None, _raised(err)
        self.envs.pop(episode, None)
        if env is not None:
            self.envs[episode] = env
        return self._sendable(result)

    def step(self, episode: int, turn: str) -> _Result:
        env = self.envs.get(episode)
        if env is None:  # its replay failed just before (the driver has that error already)
            return _Result(cause="has no environment in its process")
        try:
            result = step_env(env, turn)
        except BaseException as err:  # noqa: BLE001 - e.g. sys.exit(): that episode's error
            result = _raised(err)
        if result.outcome is None or result.outcome.done:
            del self.envs[episode]
        return self._sendable(result)

    def _sendable(self, result: _Result) -> _Result:
        if result.exc is not None:
            result.exc = self.portable(result.exc)
        return result


# -- the pool ----------------------------------------------------------------------------------------

@dataclass
class _Call:
    """One reset (turn is None) or step call of an episode in a request; ``pos``: the position of
    the episode's outcome in the request (replayed calls share the position of the call they precede)."""

    pos: int
    episode: int
    turn: str | None
    turn_no: int | None
    replay: bool = False
    clear: bool = False  # a reset that first drops the process's environments (the previous episodes')
    ref: object = None  # the Ray call, once sent


@dataclass
class _Slot(Slot):
    """A process running the calls ``sent`` in order (the first is the one running, since ``since``
    as the driver knows it). ``queue``: the request's calls waiting to be sent; ``outbox``: the next
    of them with the replay it needs first; ``present``: the episodes whose environment the process
    holds; ``alone``: send one call at a time (after a death that did not say which call caused it)."""

    queue: deque = field(default_factory=deque)
    outbox: deque = field(default_factory=deque)
    sent: deque = field(default_factory=deque)
    present: set = field(default_factory=set)
    alone: bool = False

    def forget(self) -> None:
        self.present.clear()  # a new process holds no environment

    def first_pos(self) -> float:
        """The position of the first call it has still to finish (inf: none)."""
        calls = self.sent or self.outbox or self.queue
        return calls[0].pos if calls else math.inf


class _Request(Request):
    """One reset or step: one call per episode, plus the replays its process needs first; the
    outcomes, and (on_error=raise) the first error by position."""

    def __init__(self, pool: EnvPool, num_calls: int):
        self.episodes = pool.episodes
        self.procs = pool.procs
        self.outcomes: list[EnvOutcome | None] = [None] * num_calls
        self.stop_at = num_calls  # the first position whose call failed under on_error=raise (num_calls: none)
        self.error: EnvError | None = None
        self.failed: set[int] = set()  # positions whose call failed: later results are not used

    # -- the Request -------------------------------------------------------------------------------
    def send(self, slot: _Slot) -> None:
        """Sends the slot's queue (all of it, or the next call when ``alone``), each episode whose
        environment the process lacks restored first."""
        while slot.queue or slot.outbox:
            if slot.alone and slot.sent:
                return
            if not slot.outbox:
                slot.outbox.extend(self._with_replay(slot, slot.queue.popleft()))
            call = slot.outbox.popleft()
            if call.pos in self.failed:  # its replay failed: the rest of it is moot
                continue
            if not slot.sent:
                slot.since = time.monotonic()  # an idle process begins the call at once
            self._send_one(slot, call)

    def waits_on(self, slot: _Slot) -> bool:
        return slot.first_pos() < self.stop_at

    def call(self, slot: _Slot):
        return slot.sent[0].ref

    def answered(self, slot: _Slot) -> None:
        """Takes the results that have arrived, in the order the process ran the calls."""
        window = [call.ref for call in itertools.islice(slot.sent, COLLECT_WINDOW)]
        arrived = set(ray.wait(window, num_returns=len(window), timeout=0)[0])
        while slot.sent and slot.sent[0].ref in arrived:
            call = slot.sent[0]
            try:
                result = ray.get(call.ref)
            except ray.exceptions.RayActorError as err:  # the process died, on this call
                self._lose(slot, f"killed its process ({death_detail(err)})", died=True)
                return
            except Exception as err:  # noqa: BLE001 - e.g. an info Ray cannot send back: this call's error
                result = _Result(cause=f"gave a result that did not come back: {error_line(err)}")
                slot.present.discard(call.episode)
            slot.sent.popleft()
            slot.since = time.monotonic()  # the next call began when this one ended
            self._settle(slot, call, result)

    def overdue(self, slot: _Slot) -> None:
        self._lose(slot, f"did not return within rollout.agent.timeout_s={self.procs.timeout_s:g} s "
                         f"and was stopped (its process was killed)")

    # -- calls -------------------------------------------------------------------------------------
    def _with_replay(self, slot: _Slot, call: _Call) -> list[_Call]:
        calls = [call]
        if call.turn is not None and call.episode not in slot.present:
            turns = self.episodes.live[call.episode].turns
            calls = [_Call(call.pos, call.episode, None, None, replay=True)] + [
                _Call(call.pos, call.episode, turn, no, replay=True) for no, turn in enumerate(turns, start=1)] + calls
        slot.present.add(call.episode)
        return calls

    def _send_one(self, slot: _Slot, call: _Call) -> None:
        if call.turn is None:
            call.ref = slot.actor.reset.remote(call.episode, self.episodes.live[call.episode].row, call.clear)
        else:
            call.ref = slot.actor.step.remote(call.episode, call.turn)
        slot.sent.append(call)

    def _settle(self, slot: _Slot, call: _Call, result: _Result) -> None:
        episodes = self.episodes
        if call.pos in self.failed:
            return  # the episode failed earlier in this request (e.g. in its replay)
        if call.replay and result.outcome is not None and result.outcome.done:
            result = _Result(cause="returned done=True, which it did not the first time: environments must be "
                                   "deterministic given (row, turns so far) to be restored")
        if result.outcome is None:
            self.failed.add(call.pos)
            message = episodes.message(call.episode, call.turn_no, result.cause, call.replay)
            if episodes.on_error == "raise":
                if call.pos < self.stop_at:  # the first error by position, as LocalEnvPool raises
                    self.stop_at, self.error = call.pos, EnvError(message)
                    self.error.__cause__ = result.exc
                return
            self.outcomes[call.pos] = episodes.failed(message, result.exc)
        elif call.replay:
            return
        else:
            self.outcomes[call.pos] = result.outcome
        episodes.took(call.episode, call.turn, self.outcomes[call.pos])
        if call.episode not in episodes.live:
            slot.present.discard(call.episode)

    def _lose(self, slot: _Slot, cause: str, died: bool = False) -> None:
        """The process is gone (or killed now), and replaced. The call it was running fails with
        ``cause``; the other calls go back to the queue, to run after their episodes' replay.

        A process that died with several calls in flight may have finished the first and died on a
        later one, its result lost with it: then none is blamed, and the calls are rerun one at a
        time (``alone``), which names the culprit when it dies again."""
        exact = not died or len(slot.sent) == 1
        if exact:
            self._settle(slot, slot.sent.popleft(), _Result(cause=cause))
        slot.alone = not exact
        unsent = [call for call in slot.outbox if not call.replay]
        pending = [call for call in [*slot.sent, *unsent, *slot.queue]
                   if not call.replay and call.pos not in self.failed]
        slot.sent.clear()
        slot.outbox.clear()
        slot.queue = deque(sorted(pending, key=lambda call: call.pos))
        self.procs.replace(slot)


def resolve_spec(env_spec: str) -> str:
    """The spec with its file made absolute: the processes may start in another folder."""
    module, sep, name = str(env_spec).rpartition(":")
    if sep and module.endswith(".py"):
        return f"{os.path.abspath(module)}:{name}"
    return str(env_spec)


class EnvPool(ProcessPoolOwner):
    """The environments of a batch in ``num_workers`` Ray processes, each call bounded by
    ``timeout_s`` (see the module's docstring). ``close()`` kills the processes."""

    def __init__(self, env_spec: str, env_kwargs: dict, num_workers: int, timeout_s: float, on_error: str,
                 startup_timeout_s: float = 900.0):
        load_env_class(env_spec)  # a bad spec fails here, before any process starts
        if num_workers < 1:
            raise ValueError(f"rollout.agent.num_workers must be >= 1 for an EnvPool, got {num_workers}")
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"rollout.agent.timeout_s must be a number of seconds > 0, got {timeout_s}")
        self.env_spec = resolve_spec(env_spec)
        self.env_kwargs = dict(env_kwargs or {})
        self.episodes = _Episodes(on_error)
        self.procs = ProcessPool(EnvWorker, self._worker_args, num_workers, timeout_s, startup_timeout_s,
                                 slot_cls=_Slot, loading=f"rollout.agent.env={self.env_spec!r}",
                                 load_error=self._load_error)
        self.num_workers = num_workers

    def _worker_args(self) -> tuple:
        sys_path = [entry or os.getcwd() for entry in sys.path]  # "" is the driver's folder
        return self.env_spec, self.env_kwargs, sys_path, os.getcwd()

    def _load_error(self, error: BaseException) -> EnvError:
        return EnvError(f"rollout.agent.env={self.env_spec!r} loads in the driver but not in an environment "
                        f"process: {type(error).__name__}: {error}")

    # -- the interface -------------------------------------------------------------------------------
    def reset(self, rows: list[dict]) -> list[EnvOutcome]:
        """Starts len(rows) episodes, numbered 0..len(rows)-1; the previous ones are discarded."""
        self.procs.fill()
        for slot in self.slots:
            slot.present.clear()
        self.episodes.start(rows)
        # each process's first reset clears it (episode i lives in process i % num_workers)
        return self._run([_Call(i, i, None, None, clear=i < self.num_workers) for i in range(len(rows))])

    def step(self, episodes: list[int], turns: list[str]) -> list[EnvOutcome]:
        """``env.step(turn)`` for each live episode given, concurrently across the processes."""
        self.episodes.check_step(episodes, turns)
        live = self.episodes.live
        return self._run([_Call(pos, episode, turn, len(live[episode].turns) + 1)
                          for pos, (episode, turn) in enumerate(zip(episodes, turns))])

    def close(self) -> None:
        self.procs.close()
        self.episodes.live = {}

    def _run(self, calls: list[_Call]) -> list[EnvOutcome]:
        request = _Request(self, len(calls))
        for slot in self.slots:
            slot.alone = False
        for call in calls:
            self.slots[call.episode % self.num_workers].queue.append(call)
        try:
            self.procs.run(request)
        except BaseException:
            self.episodes.live = {}  # run killed the processes, and the episodes went with them
            raise
        if request.error is not None:
            self.close()
            raise request.error
        return request.outcomes


def make_env_pool(agent_cfg, startup_timeout_s: float = 900.0) -> EnvPool | LocalEnvPool:
    """The pool for rollout.agent: in the driver (num_workers=0) or in num_workers Ray processes."""
    env, env_kwargs = agent_cfg.env, agent_cfg.env_kwargs or {}
    if getattr(agent_cfg, "fn", None):  # an agent function: one step per episode runs it (rlflow/agents/fn.py)
        env, env_kwargs = "rlflow.agents.fn:AgentFnEnv", {"fn": resolve_spec(agent_cfg.fn)}
    if not env:
        raise ValueError("rollout.agent.env is not set: no environment to run")
    if OmegaConf.is_config(env_kwargs):  # the environment gets plain dicts and lists, as from python
        env_kwargs = OmegaConf.to_container(env_kwargs, resolve=True)
    if agent_cfg.num_workers == 0:
        return LocalEnvPool(env, env_kwargs, agent_cfg.on_error)
    return EnvPool(env, env_kwargs, agent_cfg.num_workers, agent_cfg.timeout_s, agent_cfg.on_error,
                   startup_timeout_s)
