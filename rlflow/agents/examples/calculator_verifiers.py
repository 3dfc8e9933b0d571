"""The calculator task (rlflow/agents/calculator.py) as a verifiers environment, for
configs/calculator_verifiers.yaml: the same episodes, built from the library's classes.

    rollout.agent.env=rlflow.agents.adapters:VerifiersEnv
    rollout.agent.env_kwargs.load=rlflow.agents.examples.calculator_verifiers:load_environment

A turn "@48213+9975" is a call, which ``env_response`` answers with the user message "=58188" ("=?"
for an expression the calculator rejects); any other turn is the final answer: ``env_response``
sets ``final_env_response`` and the rollout ends. The rubric's one function, ``acc``, is 1 when the
answer (the text up to the first newline, stripped) is the ground truth. VerifiersEnv renders the
calculator's message as its text, so the trajectories are token for token those of CalculatorEnv,
and the calc task's warm start applies unchanged. The episodes come from rlflow's calc rows (their
prompt as the user message, their ground truth as the answer); the dataset given to the library is
a few of them, as it requires one.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from rlflow.agents.tools import CalculatorError, calculator
from rlflow.data.synthetic import CALC_CALL_PREFIX, CALC_ERROR, CALC_RESULT_PREFIX, make_synthetic_rows
from rlflow.rewards.synthetic import extract_answer


def _text(message) -> str:
    content = message.content if hasattr(message, "content") else message.get("content")
    return content if isinstance(content, str) else ""


def acc(completion, answer, **kwargs) -> float:
    """1.0 when the last assistant turn is the answer (read like rlflow.rewards.synthetic)."""
    turns = [m for m in completion if getattr(m, "role", None) == "assistant"]
    return float(bool(turns) and extract_answer(_text(turns[-1])) == str(answer).strip())


class CalculatorVerifiersEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        text = _text(messages[-1])
        if not text.lstrip().startswith(CALC_CALL_PREFIX):
            state["final_env_response"] = []  # the answer: the rollout ends, the rubric scores it
            return []
        expression = text.lstrip()[len(CALC_CALL_PREFIX):].split("\n", 1)[0]
        try:
            result = CALC_RESULT_PREFIX + calculator(expression)
        except CalculatorError:
            result = CALC_ERROR
        return [vf.UserMessage(content=result)]


def load_environment(max_turns: int = 3) -> vf.Environment:
    rows = make_synthetic_rows("calc", 4, seed=0, split="train")
    dataset = Dataset.from_list([{"question": r["prompt"], "answer": r["reward_model"]["ground_truth"]}
                                 for r in rows])
    return CalculatorVerifiersEnv(dataset=dataset, rubric=vf.Rubric(funcs=[acc]), max_turns=max_turns)
