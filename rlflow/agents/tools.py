"""Tool calls in model turns, and a safe calculator tool.

A parser turns the text of one model turn into a ``ToolCall`` or ``None`` (no call: the turn is an
answer, or a call too malformed to recognise)::

    RegexToolParser(r"^\\s*@(?P<arguments>.*)$", name="calculator").parse("@12+30")
        -> ToolCall(name="calculator", arguments="12+30")
    HermesToolParser().parse('<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')
        -> ToolCall(name="calc", arguments='{"x": 1}')

``calculator`` evaluates integer expressions with ``+``, ``-``, ``*``, unary minus and
parentheses by a small recursive-descent parser (never ``eval``), with limits on the input
length, the nesting depth and the size of the numbers, so a model cannot make it run long.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["ToolCall", "RegexToolParser", "HermesToolParser", "calculator", "CalculatorError"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: the arguments as text: what the regex captured, or JSON for HermesToolParser
    arguments: str


class RegexToolParser:
    """A call is a match of ``pattern`` (``re.search``, so anchor it with ^/$ as needed) whose
    named group ``group`` (default "arguments") holds the arguments; ``name`` is the tool's name.

    The whole turn is searched; flags (e.g. ``re.DOTALL``) may be given. No match -> None.
    """

    def __init__(self, pattern: str | re.Pattern, name: str, *, group: str = "arguments", flags: int = 0):
        self.regex = re.compile(pattern, flags) if isinstance(pattern, str) else pattern
        if group not in self.regex.groupindex:
            raise ValueError(f"tool-call pattern {self.regex.pattern!r} has no named group (?P<{group}>...)")
        self.name = str(name)
        self.group = group

    def parse(self, text: str) -> ToolCall | None:
        m = self.regex.search(text or "")
        if m is None:
            return None
        args = m.group(self.group)
        return ToolCall(self.name, "" if args is None else args)

    __call__ = parse


class HermesToolParser:
    """Qwen2.5 / Hermes style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Text around the block is ignored; the first block counts. Returns ``ToolCall(name,
    json.dumps(arguments))`` (arguments default to ``{}``; an OpenAI-style arguments *string* is
    kept as it is), or None when there is no block, its JSON does not parse, it is not an object,
    or its "name" is not a non-empty string. An unclosed ``<tool_call>`` at the end of the turn
    (a model that stopped on EOS before the closing tag) is read to the end of the text.
    """

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>"):
        self.start, self.end = start, end
        self.regex = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|\Z)", re.DOTALL)

    def parse(self, text: str) -> ToolCall | None:
        m = self.regex.search(text or "")
        if m is None:
            return None
        try:
            obj = json.loads(m.group(1).strip())
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return ToolCall(name.strip(), args)
        return ToolCall(name.strip(), json.dumps(args, ensure_ascii=False))

    __call__ = parse


# ----------------------------------------------------------------------------------------------
# calculator


class CalculatorError(ValueError):
    """The expression is not one the calculator accepts (syntax, size or depth)."""


#: limits that keep one call cheap whatever the model writes
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 100
MAX_DEPTH = 20

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*()]))")


def _tokens(expression: str) -> list[str]:
    out, pos = [], 0
    text = expression.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CalculatorError(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def calculator(expression: str) -> str:
    """The value of an integer expression (``+``, ``-``, ``*``, unary ``-``, parentheses,
    whitespace) as a decimal string. Raises CalculatorError for anything else (empty, other
    characters, a dangling operator, too long, too deep, a result over MAX_RESULT_DIGITS digits).
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    toks = _tokens(expression)
    if not toks:
        raise CalculatorError("empty expression")
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(value: int) -> int:
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise CalculatorError(f"a value has more than {MAX_RESULT_DIGITS} digits")
        return value

    def expr(depth):  # term (("+" | "-") term)*
        value = term(depth)
        while peek() in ("+", "-"):
            op = take()
            rhs = term(depth)
            value = check(value + rhs if op == "+" else value - rhs)
        return value

    def term(depth):  # factor ("*" factor)*
        value = factor(depth)
        while peek() == "*":
            take()
            value = check(value * factor(depth))
        return value

    def factor(depth):  # number | "-" factor | "(" expr ")"
        if depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested deeper than {MAX_DEPTH}")
        tok = peek()
        if tok is None:
            raise CalculatorError("expression ends where a number was expected")
        if tok == "-":
            take()
            return -factor(depth + 1)
        if tok == "(":
            take()
            value = expr(depth + 1)
            if peek() != ")":
                raise CalculatorError("missing ')'")
            take()
            return value
        if tok.isdigit():
            take()
            if len(tok) > MAX_RESULT_DIGITS:
                raise CalculatorError(f"a number has more than {MAX_RESULT_DIGITS} digits")
            return int(tok)
        raise CalculatorError(f"unexpected {tok!r}")

    value = expr(0)
    if pos != len(toks):
        raise CalculatorError(f"unexpected {toks[pos]!r}")
    return str(value)
