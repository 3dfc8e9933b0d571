"""Environments from other libraries in rlflow's agent loop (``rollout.agent.env``).

    rollout.agent.env=rlflow.agents.adapters:VerifiersEnv
    rollout.agent.env_kwargs.load=my_envs.py:load_environment     # returns a verifiers environment

    rollout.agent.env=rlflow.agents.adapters:GymnasiumEnv
    rollout.agent.env_kwargs.env_id=my_pkg:Guess-v0               # gymnasium.make's id

    rollout.agent.env=rlflow.agents.adapters:OpenEnvEnv
    rollout.agent.env_kwargs.load=my_env.py:MyEnvironment         # an OpenEnv Environment

Both are ordinary ``rlflow.agents.Environment`` subclasses, so the loop's guarantees hold unchanged:
the model's turn reaches the library as text decoded from the sampled ids, and what the library
answers is appended as text encoded once; the sampled ids are never re-tokenised. They run in the
environment pool's processes with its timeouts, error policy and replay.

**verifiers** (``pip install 'rlflow[agent-envs]'``; verifiers 0.3.x, whose ``import verifiers as vf``
is the classic API: ``vf.SingleTurnEnv``, ``vf.MultiTurnEnv`` with ``env_response`` and ``@vf.stop``
conditions, ``vf.Rubric``). Each episode runs the library's own ``env.rollout(...)`` coroutine; the
model it calls is a client that hands each request to rlflow and waits for the next ``step``. So
the library decides everything it decides in its own trainers: ``setup_state``, ``env_response``,
the stop conditions (``max_turns``, ``final_env_response``, the env's ``@vf.stop`` methods), the
cleanup handlers, then ``env.rubric.score_rollout`` (the weighted sum of the rubric's functions).
Mapping: ``reset(row)`` starts the rollout for the row's verifiers input and runs it to its first
model request; ``step(turn)`` answers that request with the turn as the assistant message and runs
on: a next request is a ``StepResult`` whose observation is the messages the environment added,
rendered as text (``message_format`` per message, then ``generation_prompt``; the defaults are the
tiny model's chat template); a finished rollout is ``done`` with ``reward`` = the rubric's reward and
``info`` = its metrics plus ``acc`` (a metric named ``acc`` if the rubric has one, else ``reward >=
env.pass_threshold``). An episode rlflow stops first (``rollout.agent.max_turns``, the response
length) is dropped unscored, with reward 0. Group reward functions need every rollout of a group
at once and are refused. ``verifiers_rows(load)`` turns the environment's dataset into rlflow rows
(its prompt messages, ``answer`` as the ground truth, the verifiers input in ``extra_info``).

verifiers 0.4.0 dropped that API (the package holds only ``verifiers.v1``, where a harness runs a
black-box agent program against an intercepting OpenAI-compatible proxy, with no per-turn
``env_response``): such agents belong to an OpenAI-compatible endpoint, not to ``step``.

**OpenEnv** (``OpenEnvEnv``, in the same extra): an ``openenv.core.env_server.Environment`` (what an
OpenEnv server serves) run in process; see the class.

**gymnasium** (1.x, in the same extra): an ``Env`` whose observations and actions are strings.
``reset(row)`` calls ``env.reset(seed=..., options=...)`` (the seed: ``extra_info["seed"]`` or a
stable hash of the row; the options: ``extra_info["gym_options"]``) and returns its observation
(appended after the prompt; ``""`` for none); ``step(turn)`` calls ``env.step(turn)`` and maps
``(observation, reward, terminated, truncated, info)`` to ``StepResult(observation, reward,
terminated or truncated, info)``, with ``info["acc"]`` the env's own ``acc`` if it reports one, else
``1.0`` when the final reward is positive.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import threading
import time
import uuid
from typing import Any, Callable

from rlflow.agents import Environment, StepResult

__all__ = ["VerifiersEnv", "GymnasiumEnv", "OpenEnvEnv", "verifiers_rows", "load_function"]

_EXTRA_HINT = "pip install 'rlflow[agent-envs]' (or pip install {package})"


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{module} is not installed ({err}); it is in rlflow's 'agent-envs' extra: "
                          + _EXTRA_HINT.format(package=package)) from err


def load_function(spec: str, key: str = "rollout.agent.env_kwargs.load") -> Callable:
    """``path/to/file.py:function`` or ``package.module:function`` -> the callable (rlflow.plugins.load_named)."""
    from rlflow.plugins import load_named

    fn = load_named(spec, key, "function", "rlflow_envlib_")
    if not callable(fn):
        module_name, _, name = str(spec).rpartition(":")
        raise AttributeError(f"{key}={spec!r}: {module_name} has no callable {name}")
    return fn


# -- verifiers -----------------------------------------------------------------------------------------

_VF_ENVS: dict[str, Any] = {}  # one library environment per (load, load_kwargs) per process
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for verifiers rollouts, in a daemon thread: the sync reset/step
    calls wait on it, so they also work where the calling thread runs a loop of its own (a notebook
    with rollout.agent.num_workers=0)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rlflow-verifiers", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _vf_env(load: str, load_kwargs: dict):
    key = json.dumps([load, load_kwargs], sort_keys=True, default=repr)
    if key not in _VF_ENVS:
        vf = _require("verifiers", "verifiers")
        if not hasattr(vf, "MultiTurnEnv"):
            raise ImportError(
                f"verifiers {getattr(vf, '__version__', '?')} has no classic API (vf.MultiTurnEnv); "
                "the adapter needs verifiers>=0.3,<0.4 (0.4 kept only verifiers.v1): "
                "pip install 'rlflow[agent-envs]'")
        env = load_function(load)(**load_kwargs)
        if not isinstance(env, vf.Environment):
            raise TypeError(f"rollout.agent.env_kwargs.load={load!r} returned a {type(env).__name__}, "
                            "not a verifiers Environment")
        if env.requires_group_rollouts:
            raise ValueError(f"{load!r}: the environment's rubric has group reward functions, which "
                             "score every rollout of a group at once; rlflow scores each episode alone")
        _VF_ENVS[key] = env
    return _VF_ENVS[key]


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind == "text":
            parts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(parts)


def _plain_message(message) -> dict:
    if isinstance(message, dict):
        return {"role": str(message["role"]), "content": _text(message.get("content"))}
    return {"role": str(message.role), "content": _text(getattr(message, "content", None))}


def verifiers_rows(load: str | Callable, split: str = "train", n: int = -1, seed: int | None = None,
                   load_kwargs: dict | None = None, data_source: str | None = None) -> list[dict]:
    """The rows of a verifiers environment's dataset (``split`` "train" or "eval") as rlflow rows:
    ``prompt`` its chat messages (role and text), ``reward_model.ground_truth`` its ``answer``,
    ``extra_info.verifiers_input`` the row as the library gives it to ``rollout`` (what
    VerifiersEnv.reset plays). ``load``: the import path VerifiersEnv takes, or the function."""
    load_kwargs = dict(load_kwargs or {})
    env = load(**load_kwargs) if callable(load) else _vf_env(load, load_kwargs)
    dataset = env.get_dataset(n=n, seed=seed) if split == "train" else env.get_eval_dataset(n=n, seed=seed)
    name = data_source or f"verifiers/{env.env_id or type(env).__name__}"
    rows = []
    for item in dataset:
        item = dict(item)
        prompt = item["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            _plain_message(m) for m in prompt]
        vf_input = {k: item[k] for k in ("prompt", "answer", "info", "task", "example_id") if k in item}
        vf_input["prompt"] = messages
        rows.append({"prompt": messages, "data_source": name,
                     "reward_model": {"ground_truth": str(item.get("answer", ""))},
                     "extra_info": {"verifiers_input": json.loads(json.dumps(vf_input, default=str))}})
    return rows


def _vf_input(row: dict) -> dict:
    """The verifiers rollout input of an rlflow row: extra_info["verifiers_input"] (verifiers_rows),
    else built from the row (prompt messages, ground truth as the answer, extra_info as info)."""
    extra = dict(row.get("extra_info") or {})
    if "verifiers_input" in extra:
        vf_input = dict(extra["verifiers_input"])
    else:
        prompt = (row.get("source_prompt") or {}).get("prompt", row.get("raw_prompt", ""))
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        vf_input = {"prompt": prompt, "answer": str(row.get("ground_truth", "")), "info": extra}
    vf_input.setdefault("example_id", 0)
    vf_input.setdefault("answer", str(row.get("ground_truth", "")))
    vf_input.setdefault("info", {})
    return vf_input


class _TurnClient:
    """Built lazily as a subclass of the library's Client (verifiers.clients.Client): each model
    request parks on a future that VerifiersEnv.step resolves with the model's turn."""

    cls = None

    @classmethod
    def make(cls):
        if cls.cls is None:
            from verifiers.clients import Client

            class TurnClient(Client):
                def __init__(self):
                    super().__init__(object())
                    self.request: tuple[list, asyncio.Future] | None = None
                    self.requested: asyncio.Event | None = None

                def setup_client(self, config):
                    return None

                async def to_native_tool(self, tool):
                    return tool

                async def to_native_prompt(self, messages):
                    return list(messages), {}

                async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
                    future = asyncio.get_running_loop().create_future()
                    self.request = (prompt, future)
                    self.requested.set()
                    return await future

                async def raise_from_native_response(self, response):
                    return None

                async def from_native_response(self, response):
                    return response

                async def close(self):
                    return None

            cls.cls = TurnClient
        return cls.cls()


def _tool_parser(spec):
    """None, "hermes" (rlflow.agents.tools.HermesToolParser) or an import path of a class built
    without arguments whose ``parse(text)`` returns None, a call or a list of calls (``.name`` and
    ``.arguments``, a JSON string)."""
    if spec is None:
        return None
    if spec == "hermes":
        from rlflow.agents.tools import HermesToolParser

        return HermesToolParser()
    return load_function(spec, "rollout.agent.env_kwargs.tool_parser")()


def _response(text: str, parser=None):
    from verifiers.types import Response, ResponseMessage, ToolCall

    calls = parser.parse(text) if parser is not None else None
    if calls is not None and not isinstance(calls, (list, tuple)):
        calls = [calls]
    tool_calls = [ToolCall(id=f"call_{i}", name=c.name, arguments=c.arguments) for i, c in enumerate(calls or [])]
    return Response(id=uuid.uuid4().hex, created=int(time.time()), model="rlflow",
                    message=ResponseMessage(content=text, finish_reason="tool_calls" if tool_calls else "stop",
                                            is_truncated=False, tool_calls=tool_calls or None))


class VerifiersEnv(Environment):
    """A verifiers environment, one episode per rlflow trajectory (see the module's docstring).

    ``load``: import path of a function returning the environment (``file.py:fn`` or
    ``package.module:fn``), built once per process and shared by its episodes; ``load_kwargs``: its
    arguments. ``message_format``: how each message the environment adds renders as observation
    text (``{role}``, ``{content}``), ``generation_prompt``: appended after them; the defaults
    render a tool or user message as its text, as the tiny model's chat template does (for a
    ChatML model: ``"<|im_start|>{role}\\n{content}<|im_end|>\\n"`` and
    ``"<|im_start|>assistant\\n"``). ``timeout_s``: the longest wait for the library between turns
    (the pool's rollout.agent.timeout_s bounds each call too). ``tool_parser``: for environments
    that read the model's tool calls (``vf.ToolEnv``): ``"hermes"`` (``<tool_call>{json}</tool_call>``)
    or an import path (see _tool_parser); the turn's text stays the message's content."""

    def __init__(self, load: str, load_kwargs: dict | None = None, message_format: str = "{content}",
                 generation_prompt: str = "", timeout_s: float = 600.0, tool_parser: str | None = None):
        self.parser = _tool_parser(tool_parser)
        self.load = load
        self.load_kwargs = dict(load_kwargs or {})
        self.message_format = message_format
        self.generation_prompt = generation_prompt
        self.timeout_s = float(timeout_s)
        self.env = _vf_env(load, self.load_kwargs)
        self.client = None
        self.task: asyncio.Future | None = None
        self.sent = 0  # messages of the current request already in the trajectory

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, _loop()).result(self.timeout_s)

    async def _start(self, vf_input: dict):
        self.client = _TurnClient.make()
        self.client.requested = asyncio.Event()

        async def rollout():
            state = await self.env.rollout(vf_input, self.client, "rlflow", {})
            if self.env.score_rollouts:
                await self.env.rubric.score_rollout(state)
            else:
                await self.env.rubric.dummy_score_rollout(state)
            await self.env.rubric.cleanup(state)
            return state

        self.task = asyncio.ensure_future(rollout())
        return await self._next()

    async def _next(self):
        """Run the rollout to its next model request or its end."""
        waiter = asyncio.ensure_future(self.client.requested.wait())
        await asyncio.wait({self.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():
            waiter.cancel()
            return None
        self.client.requested.clear()
        return self.client.request[0]

    async def _answer(self, text: str):
        _, future = self.client.request
        future.set_result(_response(text, self.parser))
        return await self._next()

    async def _cancel(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def _drop(self):
        if self.task is not None and not self.task.done():
            self._run(self._cancel())
        self.task = None

    def __del__(self):
        # an episode rlflow ended first (max_turns, length): cancel its rollout without waiting
        task = self.task
        if task is not None and not task.done() and _LOOP is not None and not _LOOP.is_closed():
            try:
                _LOOP.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # interpreter shutdown
                pass

    def _render(self, messages) -> str:
        out = [self.message_format.format(**_plain_message(m)) for m in messages]
        return "".join(out) + self.generation_prompt

    def reset(self, row: dict) -> str:
        self._drop()
        prompt = self._run(self._start(_vf_input(row)))
        if prompt is None:
            raise RuntimeError(f"verifiers environment {type(self.env).__name__} finished its rollout "
                               f"before asking the model anything ({self._error()})")
        self.sent = len(prompt)
        return ""  # the prompt's messages are the row's prompt, templated by rlflow's dataset

    def _error(self) -> str:
        if self.task is None or not self.task.done() or self.task.cancelled():
            return "no error"
        err = self.task.exception()
        if err is not None:
            return f"{type(err).__name__}: {err}"
        state = self.task.result()
        return f"error {state.get('error')!r}, stop condition {state.get('stop_condition')!r}"

    def step(self, model_turn: str) -> StepResult:
        if self.task is None or self.client is None or self.client.request is None:
            raise RuntimeError("VerifiersEnv.step before reset")
        if self.task.done():
            raise RuntimeError("VerifiersEnv.step after the episode ended")
        prompt = self._run(self._answer(model_turn or ""))
        if prompt is not None:  # the environment answered and the model is asked again
            added = prompt[self.sent + 1:]  # after the request's messages and the model's turn
            self.sent = len(prompt)
            return StepResult(observation=self._render(added), reward=0.0, done=False)
        state = self.task.result()  # raises what the rollout raised
        self.task = None
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout failed: {state['error']!r}")
        reward = float(state.get("reward") or 0.0)
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()
                   if isinstance(v, (int, float))}
        acc = metrics.get("acc", float(reward >= getattr(self.env, "pass_threshold", 0.5)))
        info = {**metrics, "acc": acc, "stop_condition": state.get("stop_condition")}
        return StepResult(observation="", reward=reward, done=True, info=info)


# -- gymnasium -----------------------------------------------------------------------------------------


def _row_seed(row: dict) -> int:
    extra = row.get("extra_info") or {}
    if "seed" in extra:
        return int(extra["seed"])
    blob = json.dumps([row.get("source_prompt"), row.get("ground_truth")], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:4], "little")


class GymnasiumEnv(Environment):
    """A gymnasium (1.x) environment with text observations and actions, one episode per trajectory.

    ``env_id``: what ``gymnasium.make`` takes (``"my_pkg:Guess-v0"`` imports my_pkg first, whose
    import registers the id); ``make_kwargs``: its keyword arguments. The env is deterministic given
    the seed, so a replayed episode (a replaced pool process) plays the same."""

    def __init__(self, env_id: str, make_kwargs: dict | None = None):
        gym = _require("gymnasium", "gymnasium")
        self.env = gym.make(env_id, **dict(make_kwargs or {}))
        self.env_id = env_id
        self.total = 0.0

    @staticmethod
    def _check(observation, where: str) -> str:
        if observation is None:
            return ""
        if not isinstance(observation, str):
            raise TypeError(f"gymnasium env {where} returned a {type(observation).__name__} observation; "
                            "GymnasiumEnv needs text observations (a str)")
        return observation

    def reset(self, row: dict) -> str:
        extra = row.get("extra_info") or {}
        observation, _ = self.env.reset(seed=_row_seed(row), options=extra.get("gym_options"))
        self.total = 0.0
        return self._check(observation, f"{self.env_id}.reset")

    def step(self, model_turn: str) -> StepResult:
        observation, reward, terminated, truncated, info = self.env.step(model_turn)
        reward = float(reward)
        self.total += reward
        done = bool(terminated or truncated)
        info = dict(info or {})
        if done:
            info["acc"] = float(info.get("acc", float(reward > 0)))
            info["return"] = self.total
            self.env.close()
        return StepResult(observation=self._check(observation, f"{self.env_id}.step"), reward=reward,
                          done=done, info={k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))})


# -- OpenEnv -------------------------------------------------------------------------------------------

_BASE_FIELDS = ("done", "reward", "metadata")


def _text_field(model_cls, given: str | None, what: str) -> str:
    """The field of a pydantic Action/Observation class that holds the text: ``given``, else its one
    str field besides the base class's."""
    fields = getattr(model_cls, "model_fields", {})
    if given is not None:
        if given not in fields:
            raise ValueError(f"OpenEnvEnv: {model_cls.__name__} has no field {given!r} ({what}_field); "
                             f"fields: {sorted(fields)}")
        return given
    text = [name for name, f in fields.items() if name not in _BASE_FIELDS and f.annotation is str]
    if len(text) != 1:
        raise ValueError(f"OpenEnvEnv: cannot tell which field of {model_cls.__name__} is the {what} text "
                         f"(str fields: {text}); set rollout.agent.env_kwargs.{what}_field")
    return text[0]


def _generic_args(env) -> tuple:
    """(ActT, ObsT, StateT) of an ``openenv Environment[ActT, ObsT, StateT]`` subclass, else ()."""
    import typing

    for klass in type(env).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) == 3 and all(isinstance(a, type) for a in args):
                return args
    return ()


class OpenEnvEnv(Environment):
    """An OpenEnv environment (``openenv.core.env_server.Environment``: the class an OpenEnv server
    serves) run in the pool's process, one instance per trajectory, no server in between.

    ``load``: import path of a function (or class) returning the environment; ``load_kwargs``: its
    arguments. The model's turn becomes ``ActionCls(**{action_field: turn})`` (the action class: the
    environment's ``Environment[ActT, ObsT, StateT]`` argument, or ``action`` given as an import
    path); an observation's text is its ``observation_field`` (default: the observation class's one
    str field besides done/reward/metadata). ``reset`` seeds the environment from the row
    (``extra_info["seed"]`` or a hash of the row) and returns its observation's text; ``step``
    returns ``StepResult(text, reward or 0, done, info)`` with ``info["acc"]`` the observation's
    ``metadata["acc"]``, else 1 when the final reward is positive."""

    def __init__(self, load: str, load_kwargs: dict | None = None, action: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None):
        _require("openenv.core.env_server.interfaces", "openenv")
        self.env = load_function(load)(**dict(load_kwargs or {}))
        args = _generic_args(self.env)
        if action is not None:
            self.action_cls = load_function(action, "rollout.agent.env_kwargs.action")
        elif args:
            self.action_cls = args[0]
        else:
            raise ValueError(f"OpenEnvEnv: {type(self.env).__name__} does not declare its action class "
                             "(Environment[ActT, ObsT, StateT]); set rollout.agent.env_kwargs.action")
        self.action_field = _text_field(self.action_cls, action_field, "action")
        self.observation_field = observation_field

    def _text(self, observation) -> str:
        field = _text_field(type(observation), self.observation_field, "observation")
        self.observation_field = field
        value = getattr(observation, field)
        return "" if value is None else str(value)

    def reset(self, row: dict) -> str:
        observation = self.env.reset(seed=_row_seed(row))
        return self._text(observation)

    def step(self, model_turn: str) -> StepResult:
        observation = self.env.step(self.action_cls(**{self.action_field: model_turn}))
        reward = float(observation.reward or 0.0)
        done = bool(observation.done)
        info = {k: v for k, v in (observation.metadata or {}).items() if isinstance(v, (int, float, str, bool))}
        if done:
            info["acc"] = float(info.get("acc", float(reward > 0)))
            self.env.close()
        return StepResult(observation="" if done else self._text(observation), reward=reward, done=done, info=info)
