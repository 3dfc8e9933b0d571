"""An agent as plain user code: ``rollout.agent.fn=file.py:function`` (or ``package.module:function``).

    def solve(row: dict, client: openai.OpenAI) -> float | dict:
        reply = client.chat.completions.create(model="rlflow", messages=[...])
        ...
        return {"reward": 1.0, "acc": 1.0}       # or just the reward

The function gets the task row ({"data_source", "ground_truth", "extra_info", "raw_prompt",
"source_prompt"}) and an ``openai.OpenAI`` client whose base_url is this episode's address on the
rollout's OpenAI-compatible endpoint (controllers/openai_endpoint.py): every call it makes is
sampled by the policy and recorded, token for token, as this episode's trajectory. It returns the
episode's reward (a finite number), or a dict with "reward" and optionally "acc" (and other
values, kept as the episode's info).

It runs in the environment pool's processes (rlflow/agents/pool.py), one episode at a time per
process, as the ``step`` of an ``AgentFnEnv`` episode: rollout.agent.timeout_s bounds the whole
function, rollout.agent.on_error handles a function that raises, hangs, kills its process or returns
something unusable, and rollout.agent.num_workers is how many episodes run at once (so how many
calls the endpoint can batch into one engine call).
"""

from __future__ import annotations

from rlflow.agents import Environment, StepResult
from rlflow.plugins import load_named

__all__ = ["AgentFnEnv", "BASE_URL_KEY", "load_agent_fn"]

#: the row key that carries an episode's base_url to its AgentFnEnv (taken out before the function sees the row)
BASE_URL_KEY = "_rlflow_openai_base_url"


def load_agent_fn(spec: str):
    """`path/to/file.py:function` or `package.module:function` -> the function. Errors name the
    key rollout.agent.fn."""
    fn = load_named(spec, "rollout.agent.fn", "function", "rlflow_agent_fn_")
    if not callable(fn) or isinstance(fn, type):
        raise TypeError(f"rollout.agent.fn={spec!r}: {str(spec).rpartition(':')[2]} is not a function")
    return fn


_HTTP = None  # one connection pool per process, shared by its episodes' clients


def _client(base_url: str):
    import httpx
    import openai

    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.Client(timeout=httpx.Timeout(None, connect=10.0), trust_env=False)
    # no retries: a retried call would be sampled again (the endpoint keeps the last conversation)
    return openai.OpenAI(base_url=base_url, api_key="rlflow", max_retries=0, http_client=_HTTP)


class AgentFnEnv(Environment):
    """An episode of an agent function: reset keeps the row, the one step runs the function."""

    def __init__(self, fn: str):
        self.fn = load_agent_fn(fn)
        self.row: dict | None = None

    def reset(self, row: dict) -> str:
        self.row = dict(row)
        return ""

    def step(self, model_turn: str) -> StepResult:
        row = dict(self.row)
        base_url = row.pop(BASE_URL_KEY)
        result = self.fn(row, _client(base_url))
        info = {}
        if isinstance(result, dict):
            if "reward" not in result:
                raise ValueError(f"the agent function returned a dict without 'reward' (keys: {sorted(result)})")
            info = {k: v for k, v in result.items() if k != "reward"}
            result = result["reward"]
        # the pool checks the reward is a finite number (rlflow/agents/pool.py, step_env)
        return StepResult(observation="", reward=result, done=True, info=info)
