"""Library environments for tests/test_agent_adapters.py, built from the libraries' public classes:
verifiers (the classic ``import verifiers as vf`` API) and gymnasium. Passed by path or module name
(rollout.agent.env_kwargs.load=<this file>:multi_turn, env_id=agent_adapter_envs:rlflow-test/Guess-v0)."""

from __future__ import annotations

import gymnasium as gym
import verifiers as vf
from datasets import Dataset

PAIRS = [(12, 3), (40, 2), (7, 7), (5, 6), (31, 9), (20, 4), (8, 1), (66, 3)]


def dataset() -> Dataset:
    return Dataset.from_list([{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in PAIRS])


def exact(completion, answer, **kwargs) -> float:
    """1 when the last assistant message is the answer (the library's parser reads it)."""
    return float((vf.Parser().parse_answer(completion) or "").strip() == answer)


def turns(completion, **kwargs) -> float:
    """0.1 per assistant message: a reward every episode gets, so its mapping shows."""
    return 0.1 * sum(1 for m in completion if getattr(m, "role", None) == "assistant")


def single_turn() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[exact, turns], weights=[1.0, 1.0]))


def echo_length(text: str) -> str:
    return f"={len(text) % 10}"


class LengthEnv(vf.MultiTurnEnv):
    """The first turn is answered with its length ("=<len % 10>"); the second ends the episode."""

    async def env_response(self, messages, state, **kwargs):
        if len(state["trajectory"]) >= 2:
            state["final_env_response"] = []
            return []
        return [vf.UserMessage(content=echo_length(messages[-1].content or ""))]


def multi_turn(max_turns: int = 4) -> vf.Environment:
    return LengthEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[exact, turns], weights=[1.0, 1.0]),
                     max_turns=max_turns)


class CalcEnv(vf.MultiTurnEnv):
    """A turn "@a+b" is a call answered "=<sum>"; any other turn is the final answer."""

    async def env_response(self, messages, state, **kwargs):
        text = messages[-1].content or ""
        if text.startswith("@"):
            try:
                a, b = text[1:].split("+")
                result = str(int(a) + int(b))
            except ValueError:
                result = "?"
            return [vf.UserMessage(content="=" + result)]
        state["final_env_response"] = []
        return []


def calc() -> vf.Environment:
    return CalcEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[exact]), max_turns=3)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tools() -> vf.Environment:
    """The library's ToolEnv with one Python tool: a model turn with a call gets the tool's message."""
    return vf.ToolEnv(dataset=dataset(), tools=[add], rubric=vf.Rubric(funcs=[exact]), max_turns=3)


class GuessEnv(gym.Env):
    """Guess a digit: each guess is answered "higher" / "lower"; a right guess ends with reward 1."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Text(max_length=64)
        self.action_space = gym.spaces.Text(max_length=64)
        self.target = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(0, 10))
        return "guess", {}

    def step(self, action):
        guess = action.strip()[:1]
        if guess == str(self.target):
            return "", 1.0, True, False, {"acc": 1.0}
        hint = "higher" if guess.isdigit() and int(guess) < self.target else "lower"
        return hint, 0.0, False, False, {}


if "rlflow-test/Guess-v0" not in gym.registry:  # this file may run twice: by path and by name
    gym.register("rlflow-test/Guess-v0", entry_point=GuessEnv, max_episode_steps=3)
