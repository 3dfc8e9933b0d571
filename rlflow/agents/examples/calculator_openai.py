"""The calculator task (configs/calculator_agent.yaml) as an agent written against the OpenAI client:
configs/calculator_openai_agent.yaml.

    rollout.agent.fn=rlflow.agents.examples.calculator_openai:solve
    rollout.agent.tool_parser=rlflow.agents.examples.calculator_openai:CompactCalls

The agent offers a ``calculator`` tool (``tools=[...]``), runs the tool calls the model makes (they
come back as ``message.tool_calls``) and answers them with ``tool`` messages, and scores the final
answer. The tiny model speaks the task's compact syntax: a turn ``@48213+9975`` is a call (the
warm start taught it that), so the endpoint's tool parser here is ``CompactCalls``, which turns
such a turn into ``tool_calls=[calculator({"expression": "48213+9975"})]``; with a model that
writes Qwen's ``<tool_call>{json}</tool_call>`` the default parser (``hermes``) does the same
without changing the agent. The tool result is sent as ``"=58188"`` (``"=?"`` for an expression the
calculator rejects): the tiny model's chat template renders a tool message as its content, so the
model sees the observation text it was warm-started on.
"""

from __future__ import annotations

import json

from rlflow.agents.tools import CalculatorError, ToolCall, calculator
from rlflow.data.synthetic import CALC_CALL_PREFIX, CALC_ERROR, CALC_RESULT_PREFIX
from rlflow.rewards.synthetic import extract_answer

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an integer expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class CompactCalls:
    """The endpoint's tool parser for the compact syntax: a turn "@<expression>" is a calculator call."""

    def parse(self, text: str) -> ToolCall | None:
        stripped = (text or "").lstrip()
        if not stripped.startswith(CALC_CALL_PREFIX):
            return None
        expression = stripped[len(CALC_CALL_PREFIX):].split("\n", 1)[0]
        return ToolCall("calculator", json.dumps({"expression": expression}))


def run_tool(call) -> str:
    try:
        expression = json.loads(call.function.arguments)["expression"]
        return CALC_RESULT_PREFIX + calculator(expression)
    except (ValueError, KeyError, TypeError, CalculatorError):
        return CALC_ERROR


def solve(row: dict, client) -> dict:
    """Up to 3 model turns (a call, the answer, one retry after a rejected call); reward 1 for the
    right sum."""
    messages = [{"role": "user", "content": row["raw_prompt"]}]
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        if not message.tool_calls:
            acc = float(extract_answer(message.content or "") == str(row["ground_truth"]).strip())
            return {"reward": acc, "acc": acc}
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": call.id, "content": run_tool(call)} for call in message.tool_calls]
    return {"reward": 0.0, "acc": 0.0}  # no answer within the turns
