"""Environments for the agent-loop tests (passed by file path: rollout.agent.env=<this file>:Class)."""

from __future__ import annotations

import zlib

from rlflow.agents import Environment, StepResult


def turns_of(row: dict) -> int:
    """1..3 model turns, fixed per prompt: rows of a batch end after different turn counts."""
    return zlib.crc32(str(row["raw_prompt"]).encode()) % 3 + 1


def observation_after(turn_text: str, turn: int) -> str:
    return f"{turn}>{len(turn_text) % 10}{turn_text[:2]}"


class CountingEnv(Environment):
    """Ends after turns_of(row) turns; observations depend on the model's turn; each step rewards
    the turn by its length, the last one also by correctness of its first character (acc)."""

    def reset(self, row):
        self.turns, self.limit, self.truth = 0, turns_of(row), str(row["ground_truth"])
        return ""

    def step(self, model_turn):
        self.turns += 1
        reward = 0.1 * (len(model_turn) % 4)
        if self.turns >= self.limit:
            acc = float(model_turn[:1] == self.truth[:1])
            return StepResult("", reward + acc, True, {"acc": acc})
        return StepResult(observation_after(model_turn, self.turns), reward, False)


class GreetingEnv(CountingEnv):
    """CountingEnv whose reset returns a first observation (appended after the prompt, not trained on)."""

    def reset(self, row):
        super().reset(row)
        return "0>"
