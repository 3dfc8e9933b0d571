"""Multi-turn, tool-using rollouts: the environment interface.

An environment plays one episode per trajectory. The driver's agent loop
(controllers/agent_loop.py) generates a model turn for every live trajectory, hands each turn's
text to its environment, and appends the observation it returns as token ids; the model's tokens
are never decoded and re-encoded, so what the model produced is what is trained on.

    env = MyEnv(**rollout.agent.env_kwargs)          # one instance per trajectory
    first = env.reset(row)                           # text appended after the prompt ("" for none)
    result = env.step(model_turn)                    # StepResult(observation, reward, done, info)

`row` is the dataset row: {"data_source", "ground_truth", "extra_info", "raw_prompt",
"source_prompt"}. `reward` is the reward for the turn just taken (placed on its last token);
`done` ends the episode (the observation is then not appended). `info` may carry "acc" (the
final step's accuracy, for reward/acc_mean and validation). An episode also ends after
rollout.agent.max_turns model turns or when the trajectory reaches data.max_response_length
tokens.

Environments are brought by import path (`rollout.agent.env=my_envs.py:Calculator` or
`package.module:Calculator`), like reward functions. They run in rollout.agent.num_workers Ray
processes (rlflow/agents/pool.py): a call that runs past rollout.agent.timeout_s or kills its
process is handled by rollout.agent.on_error like a failing reward function. The other episodes of
a replaced process are restored by replaying their turns, so an environment must be deterministic
given (row, turns so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlflow.plugins import load_named

__all__ = ["Environment", "StepResult", "load_env_class"]


@dataclass
class StepResult:
    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """Subclass and implement reset and step (plain methods; `async def` is not supported)."""

    def reset(self, row: dict) -> str:
        raise NotImplementedError

    def step(self, model_turn: str) -> StepResult:
        raise NotImplementedError


def load_env_class(spec: str) -> type:
    """`path/to/file.py:Class` or `package.module:Class` -> the class (a subclass of Environment).
    Errors name the key rollout.agent.env."""
    cls = load_named(spec, "rollout.agent.env", "Class", "rlflow_env_")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"rollout.agent.env={spec!r}: {str(spec).rpartition(':')[2]} is not a subclass of rlflow.agents.Environment")
    return cls
