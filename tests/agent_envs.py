"""Environments for tests/test_env_pool.py, loaded by file path (`.../tests/agent_envs.py:Recorder`)
in the driver and in the pool's processes. One behaviour per model turn (or per row, for reset)."""

from __future__ import annotations

import os
import re
import time

from rlflow.agents import Environment, StepResult


class Recorder(Environment):
    """Its observation holds every turn so far, so a replay that skipped or repeated one shows.

    Turns: "hang" sleeps forever, "gil" holds the GIL forever, "exit" kills the process,
    "raise" raises, "nan" / "text" return a bad reward / a bad type, "done" ends the episode,
    "pid" reports the process, "once" works once per marker_dir (it fails when replayed), and any
    other turn is recorded. The row's extra_info["reset"] picks the same for reset ("hang", "raise")."""

    def __init__(self, scale: float = 1.0, marker_dir: str | None = None):
        self.scale = scale
        self.marker_dir = marker_dir
        self.turns: list[str] = []

    def reset(self, row: dict) -> str:
        self.name = row["extra_info"]["name"]
        behaviour = row["extra_info"].get("reset")
        if behaviour == "hang":
            while True:
                time.sleep(1)
        if behaviour == "raise":
            raise KeyError("no such key")
        if behaviour == "none":
            return None
        return f"{self.name}:"

    def step(self, model_turn: str) -> StepResult:
        if model_turn == "hang":
            while True:
                time.sleep(1)
        if model_turn == "gil":  # catastrophic backtracking: one C call that never lets go of the GIL
            re.match(r"(a+)+$", "a" * 64 + "b")
        if model_turn == "exit":
            os._exit(3)
        if model_turn == "raise":
            raise ValueError(f"cannot take {model_turn!r}")
        if model_turn == "nan":
            return StepResult("x", float("nan"))
        if model_turn == "text":
            return "not a StepResult"
        if model_turn == "pid":
            return StepResult(str(os.getpid()))
        if model_turn == "once" and self.marker_dir:
            marker = os.path.join(self.marker_dir, f"{self.name}.once")
            if os.path.exists(marker):
                raise RuntimeError("'once' ran a second time")
            open(marker, "w").close()
        self.turns.append(model_turn)
        observation = f"{self.name}:{len(self.turns)}:{'|'.join(self.turns)}"
        return StepResult(observation, self.scale * len(self.turns), model_turn == "done", {"turns": len(self.turns)})


class NotAnEnvironment:
    def reset(self, row):
        return ""
