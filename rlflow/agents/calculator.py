"""A calculator environment for the synthetic "calc" task (rlflow.data.synthetic): long additions the
tiny model cannot do in its head, with a tool that can.

    rollout.agent.env=rlflow.agents.calculator:CalculatorEnv

An episode, in the default compact syntax (characters the tiny tokenizer has as single tokens)::

    prompt        "48213+9975="
    model turn    "@48213+9975"  EOS      a tool call: "@" + an expression
    observation   "=58188"                the calculator's result ("=?" if it rejects the expression)
    model turn    "58188"        EOS      any turn that is not a call is the final answer

Rewards: 0 for a tool call; for the final answer 1.0 if it is the ground truth, else 0.0 (the
answer is read like rlflow.rewards.synthetic: the text up to the first newline, stripped), and the
episode ends with info {"acc": 1.0/0.0, "tool_calls": n, "bad_tool_calls": m}. A malformed call
("@12+", "@x") is answered with the error observation "=?", reward 0, and the episode goes on (the
model may retry; rollout.agent.max_turns bounds the episode), or, with ``on_bad_call="end"``, ends
with reward 0 and acc 0. An episode whose last allowed turn is a call ends without an answer: the
agent loop stops it, with no final reward.

``syntax="hermes"`` reads Qwen/Hermes ``<tool_call>{"name": "calculator", "arguments":
{"expression": "1+2"}}</tool_call>`` calls instead and answers ``<tool_response>3</tool_response>``;
a turn that contains "<tool_call>" but does not parse, names another tool or lacks the expression is
a malformed call. Everything is deterministic given (row, turns).
"""

from __future__ import annotations

import json

from rlflow.agents import Environment, StepResult
from rlflow.agents.tools import CalculatorError, HermesToolParser, RegexToolParser, calculator
from rlflow.data.synthetic import CALC_CALL_PREFIX, CALC_ERROR, CALC_RESULT_PREFIX
from rlflow.rewards.synthetic import extract_answer

__all__ = ["CalculatorEnv", "COMPACT_CALL_PATTERN"]

#: a compact call: the turn starts with "@" (after optional whitespace); its first line is the expression
COMPACT_CALL_PATTERN = r"^\s*" + CALC_CALL_PREFIX + r"(?P<arguments>[^\n]*)"


def _ground_truth(row: dict) -> str:
    if "ground_truth" in row:
        return str(row["ground_truth"]).strip()
    return str(row["reward_model"]["ground_truth"]).strip()  # a raw verl-layout dataset row


class CalculatorEnv(Environment):
    def __init__(self, syntax: str = "compact", on_bad_call: str = "continue"):
        if syntax not in ("compact", "hermes"):
            raise ValueError(f"CalculatorEnv syntax must be 'compact' or 'hermes', got {syntax!r}")
        if on_bad_call not in ("continue", "end"):
            raise ValueError(f"CalculatorEnv on_bad_call must be 'continue' or 'end', got {on_bad_call!r}")
        self.syntax = syntax
        self.on_bad_call = on_bad_call
        if syntax == "compact":
            self.parser = RegexToolParser(COMPACT_CALL_PATTERN, name="calculator")
        else:
            self.parser = HermesToolParser()
        self.truth: str | None = None
        self.done = False
        self.tool_calls = 0
        self.bad_tool_calls = 0

    # -- helpers -------------------------------------------------------------------------------

    def _is_call_attempt(self, text: str) -> bool:
        if self.syntax == "compact":
            return text.lstrip().startswith(CALC_CALL_PREFIX)
        return self.parser.start in text

    def _expression(self, text: str) -> str | None:
        call = self.parser.parse(text)
        if call is None:
            return None
        if self.syntax == "compact":
            return call.arguments
        if call.name != "calculator":
            return None
        try:
            args = json.loads(call.arguments)
        except ValueError:
            args = call.arguments  # an OpenAI-style string that is not JSON: the expression itself
        if isinstance(args, dict):
            args = args.get("expression")
        return args if isinstance(args, str) else None

    def _result(self, value: str | None) -> str:
        if self.syntax == "compact":
            return CALC_ERROR if value is None else CALC_RESULT_PREFIX + value
        return f"<tool_response>{'error' if value is None else value}</tool_response>"

    def _info(self, acc: float) -> dict:
        return {"acc": acc, "tool_calls": self.tool_calls, "bad_tool_calls": self.bad_tool_calls}

    # -- Environment ---------------------------------------------------------------------------

    def reset(self, row: dict) -> str:
        self.truth = _ground_truth(row)
        self.done = False
        self.tool_calls = 0
        self.bad_tool_calls = 0
        return ""

    def step(self, model_turn: str) -> StepResult:
        if self.truth is None:
            raise RuntimeError("CalculatorEnv.step before reset")
        if self.done:
            raise RuntimeError("CalculatorEnv.step after the episode ended")
        text = model_turn or ""
        if self._is_call_attempt(text):
            self.tool_calls += 1
            expression = self._expression(text)
            value = None
            if expression is not None:
                try:
                    value = calculator(expression)
                except CalculatorError:
                    value = None
            if value is not None:
                return StepResult(observation=self._result(value), reward=0.0, done=False)
            self.bad_tool_calls += 1
            if self.on_bad_call == "end":
                self.done = True
                return StepResult(observation="", reward=0.0, done=True, info=self._info(0.0))
            return StepResult(observation=self._result(None), reward=0.0, done=False)
        acc = float(extract_answer(text) == self.truth)
        self.done = True
        return StepResult(observation="", reward=acc, done=True, info=self._info(acc))
