"""An OpenEnv environment for tests/test_agent_adapters.py, from the library's own classes (the
server-side Environment an OpenEnv server serves), run in process by OpenEnvEnv."""

from __future__ import annotations

import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["abc", "ray", "token", "reward"]


class TextAction(Action):
    message: str


class TextObservation(Observation):
    text: str = ""


class ReverseEnvironment(Environment[TextAction, TextObservation, State]):
    """"reverse <word>": the reversed word ends with reward 1; a wrong one is answered "no", the
    second wrong one ends with reward 0."""

    def __init__(self, tries: int = 2):
        super().__init__()
        self.tries = tries
        self._state = State()
        self.word = ""

    def reset(self, seed=None, episode_id=None, **kwargs) -> TextObservation:
        self.word = random.Random(seed).choice(WORDS)
        self._state = State(episode_id=episode_id, step_count=0)
        return TextObservation(text=f"reverse {self.word}")

    def step(self, action: TextAction, timeout_s=None, **kwargs) -> TextObservation:
        self._state.step_count += 1
        if action.message.strip() == self.word[::-1]:
            return TextObservation(text="", done=True, reward=1.0, metadata={"tries": self._state.step_count})
        done = self._state.step_count >= self.tries
        return TextObservation(text="no", done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
