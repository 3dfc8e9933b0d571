"""An OpenAI-compatible endpoint served during rollout, whose trajectories stay token-exact.

An agent written against the OpenAI client (rollout.agent.fn, rlflow/agents/fn.py) talks to this
server; every call is answered by the rollout engine (the rollout worker group's ``generate``), and
the server records what the engine sampled. The training batch is assembled from those records,
never from text (controllers/endpoint_loop.py).

Routes (FastAPI on uvicorn, in a thread of the driver; bound to 127.0.0.1, or the node's address
when the Ray cluster has more than one node)::

    POST /rlflow/{rollout}/{trajectory}/v1/chat/completions   stream or not; tools / tool_calls
    POST /rlflow/{rollout}/{trajectory}/v1/completions        stream or not
    GET  /rlflow/{rollout}/{trajectory}/v1/models

**Sessions.** A trajectory is identified by its base_url: the loop gives each episode
``http://host:port/rlflow/<rollout>/<trajectory>/v1``, so an unmodified ``openai.OpenAI(base_url=...)``
carries the id on every call, with no header or extra argument. ``<rollout>`` is new for each
rollout: a late call from an episode of an earlier rollout (one whose process was killed) is
answered 404 and changes nothing.

**Token exactness.** A session holds its trajectory as token ids: the first call's prompt (its
messages rendered by the chat template, with the generation prompt), then the sampled ids of each
call (mask 1, with their log-probs) and the ids of what came between calls (mask 0). A call whose
messages repeat the session's conversation so far (every earlier message, and each assistant
message as this server returned it) and add new ones continues the trajectory: the earlier turns
map to the ids recorded, never to a re-render of their text, and only the new messages are
tokenised, as the chat template's *delta* (``ChatRenderer.delta``: the template rendered after a
fixed assistant turn, cut after that turn's content; the stop token the engine sampled is not
repeated). A template that renders earlier assistant turns differently (strips whitespace or
``<think>`` blocks) therefore changes nothing. /v1/completions does the same on text: a prompt that
starts with the session's text (the last prompt plus the text returned) continues the trajectory
and only the rest is tokenised; a prompt of token ids continues it when it starts with the ids.
A call that does not continue the session (another conversation, an edited history, a retry)
starts a new *segment*: the trajectory trained is the last segment, and the calls of the earlier
ones are counted as dropped (agent/dropped_calls).

**Sampling.** The run's sampling settings apply (rollout.temperature / top_p / do_sample, or the
val_* ones in validation), because the trainer's log-prob and correction assume them: a request's
temperature, top_p, seed and stop are ignored. ``max_tokens`` (``max_completion_tokens``) is honoured,
within what is left of data.max_response_length for the trajectory; a trajectory that is full is
answered with no tokens and finish_reason "length". ``n`` > 1 is refused (a trajectory is one sequence).

**Batching.** Requests are queued; an engine thread takes the first, collects more until it has
``concurrency`` of them (the number of agents that run at once: rollout.agent.num_workers) or none
has come for ``batch_window_s`` (20 ms; 200 ms at most in all), and answers all of them with one generate call (max_new_tokens: the
largest asked; each answer is cut to its own limit: a prefix of a sample is a sample). While the
engine works, new requests queue, so concurrent agents share engine calls.

**Records.** Each call records its prompt ids (the whole context), the sampled ids, their
log-probs and the weight version (``EndpointCall``).

**Tool calls.** With ``tools`` in a chat request, the sampled text is read by the tool parser
(rollout.agent.tool_parser: ``hermes`` for Qwen's ``<tool_call>{json}</tool_call>``, or
``file.py:name`` / ``module:name``: an object, or a class built without arguments, whose
``parse(text)`` returns an ``rlflow.agents.tools.ToolCall`` or None); a call becomes the
response's ``tool_calls`` (finish_reason "tool_calls"). Tool results come back as ``tool`` messages
and are rendered by the chat template like any new message.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime
import asyncio
import concurrent.futures
import itertools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from rlflow.agents.tools import HermesToolParser
from rlflow.plugins import load_named

__all__ = ["ChatRenderer", "EndpointCall", "EndpointError", "OpenAIEndpoint", "Session", "load_tool_parser",
           "require_server_packages"]

logger = logging.getLogger(__name__)

# the assistant turn after which ChatRenderer.delta renders new messages: plain letters, which no
# template strips or rewrites
_SENTINEL = "rlflowsentinelturn"
_BASE = [{"role": "user", "content": "rlflowsentineluser"}, {"role": "assistant", "content": _SENTINEL}]


class EndpointError(ValueError):
    """A request the endpoint cannot serve (answered 400 with this message)."""


@dataclass
class EndpointCall:
    """One call as the engine answered it."""

    prompt_ids: list[int]  # the whole context the engine saw
    ids: list[int]  # the sampled ids (up to and including a stop token)
    log_probs: list[float]
    weight_version: int | None
    finish_reason: str


@dataclass
class Session:
    """One trajectory's record: its current segment as ids, and every call."""

    prompt: list[int] = field(default_factory=list)  # the segment's first prompt
    ids: list[int] = field(default_factory=list)  # everything after it
    mask: list[int] = field(default_factory=list)  # 1: a sampled token
    log_probs: list[float] = field(default_factory=list)
    kind: str | None = None  # "chat" | "completion" for the segment's calls
    messages: list = field(default_factory=list)  # chat: the conversation, canonical (see _canonical)
    text: str | None = None  # completion: the text the next prompt must start with
    last_stop: int | None = None  # the stop token ending the last sampled turn, if it ended on one
    calls: list[EndpointCall] = field(default_factory=list)  # every call, all segments
    segment_calls: int = 0  # the current segment's calls
    dropped_calls: int = 0  # calls of earlier segments
    lock: asyncio.Lock | None = None
    closed: bool = False  # its rollout ended: nothing more is recorded

    def new_segment(self, prompt: list[int], kind: str) -> None:
        self.dropped_calls += self.segment_calls
        self.segment_calls = 0
        self.prompt, self.ids, self.mask, self.log_probs = list(prompt), [], [], []
        self.kind, self.messages, self.text, self.last_stop = kind, [], None, None

    def extend(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


def require_server_packages() -> None:
    """The endpoint's packages, checked before Ray starts."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"rollout.agent.fn needs {', '.join(missing)} (the rollout's OpenAI endpoint and the client "
                          "the agent gets): pip install 'rlflow[agents]'")


def load_tool_parser(spec: str):
    """rollout.agent.tool_parser: "hermes", or "file.py:name" / "module:name" (an object with
    parse(text), or a class built without arguments). Errors name the key."""
    if spec in (None, "", "hermes"):
        return HermesToolParser()
    if ":" not in str(spec):
        raise ValueError(f"rollout.agent.tool_parser={spec!r}: expected 'hermes', 'file.py:name' or 'module:name'")
    parser = load_named(spec, "rollout.agent.tool_parser", "name", "rlflow_tool_parser_")
    if isinstance(parser, type):
        parser = parser()
    if not callable(getattr(parser, "parse", None)):
        raise TypeError(f"rollout.agent.tool_parser={spec!r}: {spec.rpartition(':')[2]} has no parse(text) method")
    return parser


# -- messages ------------------------------------------------------------------------------------------

def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text parts, in order
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return str(content)


def _arguments(arguments) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _canonical(message: dict) -> tuple:
    """What must be equal for a message to repeat one the session has: role, text, tool calls
    (name and arguments; their ids are the client's to echo) and the tool call a result answers."""
    if not isinstance(message, dict) or "role" not in message:
        raise EndpointError(f"a message must be an object with a role, got {message!r}")
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                                 sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message["role"], _text(message.get("content")), calls


class ChatRenderer:
    """The chat template as text: a whole conversation (the first call), or the delta of new
    messages after an assistant turn (later calls)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise EndpointError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template: "
                                "/v1/chat/completions needs one (use /v1/completions, or a model whose tokenizer has one)")
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - the template's error is the request's
            raise EndpointError(f"the chat template cannot render these messages: {type(err).__name__}: {err}") from err

    def delta(self, new: list[dict], tools, stop_text: str | None) -> str:
        """The text the template puts after an assistant turn's content when ``new`` follows it,
        up to the next generation prompt. ``stop_text``: the text of the stop token the engine
        sampled to end that turn, which the ids already hold (left out of the delta)."""
        before = self.render(_BASE, tools, False)
        after = self.render(_BASE + list(new), tools, True)
        cut = before.rfind(_SENTINEL)
        if cut < 0:
            raise EndpointError("the chat template does not render an assistant turn's content: cannot find where "
                                "the new messages begin")
        cut += len(_SENTINEL)
        if after[:cut] != before[:cut]:
            raise EndpointError("the chat template renders the conversation before the new messages differently "
                                "when they follow: cannot render the new messages alone")
        text = after[cut:]
        if stop_text and text.startswith(stop_text):
            text = text[len(stop_text):]
        return text


# -- the server ----------------------------------------------------------------------------------------

@dataclass
class _Pending:
    context: list[int]
    max_new_tokens: int
    future: concurrent.futures.Future


class OpenAIEndpoint:
    """The server. ``engine(contexts, max_new_tokens) -> [(ids, log_probs)]`` answers a batch;
    ``open(count)`` starts a rollout's sessions and gives their base URLs; ``close_rollout()``
    ends them and returns them. ``start()`` / ``stop()`` run the HTTP server in a thread."""

    def __init__(self, tokenizer, engine: Callable, max_prompt_length: int, max_response_length: int,
                 tool_parser: str = "hermes", weight_version: Callable[[], int] | None = None,
                 host: str | None = None, concurrency: int = 1, batch_window_s: float = 0.02,
                 model_name: str = "rlflow"):
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.tool_parser = load_tool_parser(tool_parser)
        self.weight_version = weight_version
        self.host = host or "127.0.0.1"
        self.concurrency = max(int(concurrency), 1)
        self.batch_window_s = batch_window_s
        self.model_name = model_name
        self._renderer: ChatRenderer | None = None
        self.rollout_key: str | None = None
        self.sessions: dict[int, Session] = {}
        self.engine_calls: list[int] = []  # requests answered by each engine call
        self.engine_error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._server = self._thread = self._engine_thread = self._loop = None
        self.port: int | None = None

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer)
        return self._renderer

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        import uvicorn

        if self._thread is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=60)
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()

        def serve():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=serve, name="rlflow-openai-endpoint", daemon=True)
        self._thread.start()
        self._engine_thread = threading.Thread(target=self._engine_loop, name="rlflow-openai-engine", daemon=True)
        self._engine_thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.host}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._engine_thread.join(timeout=10)
        self._thread = self._engine_thread = self._server = self._loop = None

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- rollouts ----------------------------------------------------------------------------------
    def open(self, count: int) -> list[str]:
        """New sessions 0..count-1 for a rollout; the base URL of each (the previous rollout's
        sessions are gone)."""
        with self._lock:
            self.rollout_key = uuid.uuid4().hex[:12]
            self.sessions = {i: Session() for i in range(count)}
            self.engine_calls = []
            self.engine_error = None
        return [f"{self.base}/rlflow/{self.rollout_key}/{i}/v1" for i in range(count)]

    def close_rollout(self) -> dict[int, Session]:
        """Ends the rollout's sessions and returns them. Taken in the server's event loop, where
        sessions change (between two awaits), so each is whole; a call still waiting on the engine
        (an episode whose process was killed) then records nothing."""
        def take() -> dict[int, Session]:
            with self._lock:
                sessions, self.sessions, self.rollout_key = self.sessions, {}, None
            for session in sessions.values():
                session.closed = True
            return sessions

        async def in_loop():
            return take()

        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            return asyncio.run_coroutine_threadsafe(in_loop(), self._loop).result(timeout=60)
        return take()

    def _session(self, rollout: str, index: int) -> Session:
        with self._lock:
            session = self.sessions.get(index) if rollout == self.rollout_key else None
        if session is None or session.closed:
            raise KeyError(f"no open trajectory {rollout}/{index}: use the base_url given to the agent for this "
                           "episode (its rollout may have ended)")
        if session.lock is None:
            session.lock = asyncio.Lock()
        return session

    # -- the engine thread ---------------------------------------------------------------------------
    def submit(self, context: list[int], max_new_tokens: int) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._queue.put(_Pending(context, max_new_tokens, future))
        return future

    def _engine_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            # whatever is queued, and, while fewer than concurrency wait, more as long as they keep
            # coming: each arrival gives batch_window_s more, up to 10 windows in all
            cap = time.monotonic() + 10 * self.batch_window_s
            deadline = time.monotonic() + self.batch_window_s
            stop = False
            while True:
                left = deadline - time.monotonic()
                try:
                    if len(batch) < self.concurrency and left > 0:
                        item = self._queue.get(timeout=left)
                    else:
                        item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
                deadline = min(time.monotonic() + self.batch_window_s, cap)
            self._answer(batch)
            if stop:
                return

    def _answer(self, batch: list[_Pending]) -> None:
        try:
            out = self.engine([p.context for p in batch], max(p.max_new_tokens for p in batch))
        except BaseException as err:  # noqa: BLE001 - every waiting call fails; the loop raises it
            self.engine_error = err
            for pending in batch:
                pending.future.set_exception(err)
            return
        self.engine_calls.append(len(batch))
        for pending, (ids, log_probs) in zip(batch, out, strict=True):
            pending.future.set_result((list(ids)[: pending.max_new_tokens], list(log_probs)[: pending.max_new_tokens]))

    # -- one call ----------------------------------------------------------------------------------
    def _max_new(self, body: dict, session: Session) -> int:
        room = self.max_response_length - len(session.ids)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            if not isinstance(asked, int) or asked < 1:
                raise EndpointError(f"max_tokens must be a positive integer, got {asked!r}")
            room = min(room, asked)
        return max(room, 0)

    @staticmethod
    def _check(body: dict) -> None:
        if body.get("n") not in (None, 1):
            raise EndpointError(f"n={body.get('n')}: one call samples one completion here (a trajectory is one sequence)")

    def _check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) > self.max_prompt_length:
            raise EndpointError(f"the prompt is {len(prompt)} tokens; data.max_prompt_length={self.max_prompt_length}")

    def _continue_ids(self, session: Session, ids: list[int]) -> None:
        ids = ids[: max(self.max_response_length - len(session.ids), 0)]
        session.extend(ids, sampled=False)

    def _chat_context(self, session: Session, body: dict) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError("messages must be a non-empty list")
        tools = body.get("tools")
        canonical = [_canonical(m) for m in messages]
        known = len(session.messages)
        if session.kind == "chat" and known and len(canonical) > known and canonical[:known] == session.messages:
            stop_text = None if session.last_stop is None else self.tokenizer.decode([session.last_stop])
            delta = self.renderer.delta(messages[known:], tools, stop_text)
            self._continue_ids(session, self.tokenizer.encode(delta, add_special_tokens=False))
        else:
            prompt = self.tokenizer.encode(self.renderer.render(messages, tools, True), add_special_tokens=False)
            self._check_prompt(prompt)
            session.new_segment(prompt, "chat")
        session.messages = canonical

    def _completion_context(self, session: Session, body: dict) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            whole = session.prompt + session.ids
            if session.kind == "completion" and session.prompt and prompt[: len(whole)] == whole:
                self._continue_ids(session, prompt[len(whole):])
            else:
                self._check_prompt(prompt)
                session.new_segment(prompt, "completion")
            session.text = None
            return
        if not isinstance(prompt, str) or not prompt:
            raise EndpointError("prompt must be a non-empty string, a list of token ids, or a list of one of them")
        if session.kind == "completion" and session.text is not None and prompt.startswith(session.text):
            rest = prompt[len(session.text):]
            self._continue_ids(session, self.tokenizer.encode(rest, add_special_tokens=False) if rest else [])
        else:
            ids = self.tokenizer(prompt)["input_ids"]  # as rlflow.data encodes a plain-string prompt
            self._check_prompt(ids)
            session.new_segment(ids, "completion")
        session.text = prompt

    async def _generate(self, session: Session, max_new: int) -> EndpointCall:
        """Samples the session's next turn (nothing when it is full) and records it."""
        context = session.prompt + session.ids
        if max_new <= 0:
            ids, log_probs = [], []
        else:
            ids, log_probs = await asyncio.wrap_future(self.submit(context, max_new))
            if session.closed:
                raise KeyError("the rollout of this trajectory ended while its call waited on the engine")
        stopped = bool(ids) and ids[-1] == self.tokenizer.eos_token_id  # the engine stops on EOS only
        finish = "stop" if stopped else "length"
        version = self.weight_version() if self.weight_version is not None else None
        call = EndpointCall(context, ids, log_probs, version, finish)
        session.extend(ids, sampled=True, log_probs=log_probs)
        session.last_stop = ids[-1] if stopped else None
        session.calls.append(call)
        session.segment_calls += 1
        return call

    # -- responses ---------------------------------------------------------------------------------
    def _tool_calls(self, text: str, call_id: str) -> tuple[str | None, list[dict]]:
        parsed = self.tool_parser.parse(text)
        if parsed is None:
            return text, []
        start = getattr(self.tool_parser, "start", None)
        content = text.split(start)[0].strip() if start and start in text else ""
        return content or None, [{"id": f"call_{call_id}_0", "type": "function",
                                  "function": {"name": parsed.name, "arguments": parsed.arguments}}]

    def _logprobs(self, call: EndpointCall) -> dict:
        content = []
        for token_id, log_prob in zip(call.ids, call.log_probs):
            token = self.tokenizer.decode([token_id])
            content.append({"token": token, "logprob": log_prob, "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="rlflow rollout endpoint")

        def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                status_code=status)

        async def serve(rollout: str, index: int, request: Request, chat: bool):
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the request body is not JSON")
            if not isinstance(body, dict):
                return error(400, "the request body must be a JSON object")
            try:
                session = self._session(rollout, index)
            except KeyError as err:
                return error(404, str(err.args[0]), "not_found_error")
            async with session.lock:
                try:
                    self._check(body)
                    (self._chat_context if chat else self._completion_context)(session, body)
                    call = await self._generate(session, self._max_new(body, session))
                except EndpointError as err:
                    return error(400, str(err))
                except KeyError as err:
                    return error(404, str(err.args[0]), "not_found_error")
                except Exception as err:  # noqa: BLE001 - the engine's error: the loop raises it too
                    logger.exception("the OpenAI endpoint's engine call failed")
                    return error(500, f"the rollout engine failed: {type(err).__name__}: {err}", "server_error")
                text = self.tokenizer.decode(call.ids, skip_special_tokens=True)
                call_id = f"{rollout}{index}x{len(session.calls)}"
                if chat:
                    content, tool_calls = (self._tool_calls(text, call_id) if body.get("tools") else (text, []))
                    message = {"role": "assistant", "content": content}
                    if tool_calls:
                        message["tool_calls"] = tool_calls
                    session.messages = session.messages + [_canonical(message)]
                else:
                    session.text = (session.text + text) if session.text is not None else None
            finish = "tool_calls" if chat and tool_calls else call.finish_reason
            usage = {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.ids),
                     "total_tokens": len(call.prompt_ids) + len(call.ids)}
            created, model = int(time.time()), body.get("model") or self.model_name
            logprobs = self._logprobs(call) if body.get("logprobs") else None
            rid = ("chatcmpl-" if chat else "cmpl-") + call_id
            if not body.get("stream"):
                if chat:
                    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
                    out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                           "choices": [choice], "usage": usage}
                else:
                    lp = None if logprobs is None else {"tokens": [c["token"] for c in logprobs["content"]],
                                                        "token_logprobs": [c["logprob"] for c in logprobs["content"]],
                                                        "top_logprobs": None, "text_offset": None}
                    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
                           "usage": usage}
                return JSONResponse(out)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._chunks(rid, created, model, chat, text if not chat else message, finish,
                                                  usage if include_usage else None, logprobs),
                                     media_type="text/event-stream")

        @app.post("/rlflow/{rollout}/{index}/v1/chat/completions")
        async def chat_completions(rollout: str, index: int, request: Request):
            return await serve(rollout, index, request, True)

        @app.post("/rlflow/{rollout}/{index}/v1/completions")
        async def completions(rollout: str, index: int, request: Request):
            return await serve(rollout, index, request, False)

        @app.get("/rlflow/{rollout}/{index}/v1/models")
        async def models(rollout: str, index: int):
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "rlflow"}]}

        return app

    @staticmethod
    def _chunks(rid, created, model, chat, payload, finish, usage, logprobs):
        """The server-sent events of one streamed answer: the whole turn is sampled at once, so the
        content comes in one chunk (then the tool calls, then the finish reason)."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices, **extra):
            return f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': model, 'choices': choices, **extra})}\n\n"

        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if payload.get("content"):
                yield event([{"index": 0, "delta": {"content": payload["content"]}, "finish_reason": None,
                              "logprobs": logprobs}])
            for j, call in enumerate(payload.get("tool_calls", [])):
                yield event([{"index": 0, "delta": {"tool_calls": [{"index": j, **call}]}, "finish_reason": None}])
            yield event([{"index": 0, "delta": {}, "finish_reason": finish}])
        else:
            if payload:
                yield event([{"index": 0, "text": payload, "finish_reason": None, "logprobs": None}])
            yield event([{"index": 0, "text": "", "finish_reason": finish, "logprobs": None}])
        if usage is not None:
            yield event([], usage=usage)
        yield "data: [DONE]\n\n"
