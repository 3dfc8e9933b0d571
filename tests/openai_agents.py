"""Agent functions for tests/test_openai_endpoint.py: plain code against the real openai client."""

from __future__ import annotations

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "looks a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]


def _prompt(row) -> str:
    prompt = row["raw_prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def three_calls(row, client):
    """Three calls in one conversation (the second streamed), a tool result and a user message
    between them; rows whose prompt starts with "1" raise (on_error=zero ends them with reward 0)."""
    messages = [{"role": "user", "content": _prompt(row)}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    messages.append(first.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": " <tool> 7 </tool>"})
    stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4, stream=True)
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": "\n ok?"})
    third = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    if _prompt(row).startswith("1"):
        raise RuntimeError("this row's agent fails")
    text = third.choices[0].message.content or ""
    return {"reward": float(len(text) % 2), "acc": 1.0 if finish == "stop" else 0.0}
