"""``calculator``: multi-step word problems where the model may call a calculator tool.

Tool-call text format (the bundled chat template has no structured tool calls): an assistant
message calls the calculator with ``<calc>EXPRESSION</calc>`` anywhere in its text, up to
:data:`MAX_CALLS_PER_MESSAGE` times. The environment answers each call, in order, with a
``{"role": "tool", "content": "EXPRESSION = RESULT"}`` (or ``"error: ..."``) message. A reply
with no call is the final answer, scored by its last number against the task's integer truth.

Extension point for templates with structured tool calls: :func:`read_tool_calls` reads an
assistant message's OpenAI-style ``tool_calls`` list when present (``function.name`` must be
``calculator``, ``function.arguments`` a dict or JSON object with ``expression``) and echoes each
call's ``id`` as ``tool_call_id`` on the tool reply; otherwise it parses the text tags.

Expressions are evaluated safely (:func:`evaluate`): parsed with :mod:`ast`, only number
literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses; exact rational arithmetic
with bounded operands, exponents and results. Nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Context, Decimal
from fractions import Fraction
from typing import Any, ClassVar

from tasks.environments.base import Environment, Message, Turn
from tasks.environments.parsing import last_assistant_content
from tasks.environments.rewards import last_number
from tasks.environments.seeding import generate_tasks

TOOL_NAME = "calculator"
MAX_CALLS_PER_MESSAGE = 4
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**15  # bound on |numerator| and denominator of every literal and intermediate value
RESULT_DIGITS = 12  # significant digits shown for a non-integer result

SYSTEM_PROMPT = (
    "You can use a calculator. To use it, write <calc>EXPRESSION</calc>, for example <calc>12 * 34 + 5</calc>, "
    "and the calculator replies with the result. Expressions may use numbers, + - * / // % ** and parentheses. "
    "When you know the answer, reply without a calculator call and end with the final answer as a single number."
)

_CALC_TAG = re.compile(r"<calc>(.*?)</calc>", re.IGNORECASE | re.DOTALL)
_BINARY: Mapping[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses; ``reason`` is a stable name for why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("out_of_range", f"a value exceeds the calculator's range (at most {MAX_MAGNITUDE:.0e})")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("exponent_not_integer", "exponents must be whole numbers")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError("exponent_too_large", f"exponents must be at most {MAX_EXPONENT} in size")
    return base ** int(exponent)


def _evaluate_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError("constant_not_allowed", f"only numbers are allowed, got {node.value!r}")
        if not math.isfinite(node.value):
            raise CalculatorError("out_of_range", f"{node.value!r} is outside the calculator's range")
        return _bounded(Fraction(repr(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate_node(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and (isinstance(node.op, ast.Pow) or type(node.op) in _BINARY):
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        try:
            result = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division_by_zero", "division by zero") from None
        return _bounded(result)
    if isinstance(node, ast.Name):
        raise CalculatorError("name_not_allowed", f"names are not allowed: {node.id!r}")
    if isinstance(node, ast.Call):
        raise CalculatorError("call_not_allowed", "function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise CalculatorError("attribute_not_allowed", "attribute access is not allowed")
    raise CalculatorError("syntax_not_allowed", f"{type(node).__name__} is not allowed in an expression")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression``, or a :class:`CalculatorError`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError("too_long", f"expressions must be at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("syntax_error", f"cannot parse {expression.strip()!r}") from None
    return _evaluate_node(tree.body)


def format_number(value: Fraction) -> str:
    """An integer as is; anything else as a decimal rounded to :data:`RESULT_DIGITS` significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    quotient = Context(prec=RESULT_DIGITS).divide(Decimal(value.numerator), Decimal(value.denominator))
    return format(quotient.normalize(), "f")


@dataclass(frozen=True)
class ToolCall:
    """One calculator call: the tool name, the expression, and the call id a structured call carries."""

    name: str
    expression: str
    call_id: str | None = None


def _structured_call(raw: Any) -> ToolCall:
    function = raw.get("function", {}) if isinstance(raw, Mapping) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    expression = arguments.get("expression", "") if isinstance(arguments, Mapping) else ""
    call_id = raw.get("id") if isinstance(raw, Mapping) else None
    return ToolCall(str(function.get("name", "")), str(expression), None if call_id is None else str(call_id))


def read_tool_calls(message: Mapping[str, Any]) -> list[ToolCall]:
    """The calls of an assistant message: its structured ``tool_calls`` when present, else ``<calc>`` tags."""
    if message.get("tool_calls"):
        return [_structured_call(raw) for raw in message["tool_calls"]]
    return [ToolCall(TOOL_NAME, expression) for expression in _CALC_TAG.findall(message["content"])]


def answer_call(call: ToolCall, ordinal: int) -> dict[str, str]:
    """The tool message answering ``call`` (the ``ordinal``-th call of its assistant message)."""
    if call.name != TOOL_NAME:
        content = f"error: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}"
    elif ordinal >= MAX_CALLS_PER_MESSAGE:
        content = f"error: at most {MAX_CALLS_PER_MESSAGE} calculator calls per message"
    else:
        try:
            content = f"{call.expression.strip()} = {format_number(evaluate(call.expression))}"
        except CalculatorError as error:
            content = f"error: {error}"
    reply = {"role": "tool", "content": content}
    if call.call_id is not None:
        reply["tool_call_id"] = call.call_id
    return reply


def _crates(rng: random.Random) -> tuple[str, int]:
    crates, per_crate = rng.randint(12, 60), rng.randint(12, 48)
    broken = rng.randint(1, crates * per_crate - 1)
    question = f"A warehouse has {crates} crates with {per_crate} bottles in each. {broken} bottles break."
    return f"{question} How many bottles are left?", crates * per_crate - broken


def _wages(rng: random.Random) -> tuple[str, int]:
    weekly, weeks = rng.randint(40, 400), rng.randint(3, 26)
    spent = rng.randint(1, weekly * weeks - 1)
    question = f"Sam earns {weekly} dollars a week for {weeks} weeks and spends {spent} dollars."
    return f"{question} How many dollars does Sam have left?", weekly * weeks - spent


def _train(rng: random.Random) -> tuple[str, int]:
    per_car, cars = rng.randint(20, 90), rng.randint(4, 16)
    leave, board = rng.randint(1, per_car * cars), rng.randint(1, 200)
    question = (
        f"A train has {cars} cars with {per_car} passengers in each. At a station {leave} passengers get off "
        f"and {board} get on. How many passengers are on the train now?"
    )
    return question, per_car * cars - leave + board


def _stickers(rng: random.Random) -> tuple[str, int]:
    children, each, extra = rng.randint(3, 24), rng.randint(11, 99), rng.randint(2, 30)
    question = (
        f"{children * each} stickers are shared equally among {children} children, and then each child gets "
        f"{extra} more. How many stickers does each child have?"
    )
    return question, each + extra


PROBLEMS: Mapping[str, Callable[[random.Random], tuple[str, int]]] = {
    "crates": _crates,
    "wages": _wages,
    "train": _train,
    "stickers": _stickers,
}


def _build_task(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(sorted(PROBLEMS))
    question, answer = PROBLEMS[kind](rng)
    return {"kind": kind, "question": question, "answer": answer}


def _tool_messages(messages: Sequence[Message]) -> int:
    return sum(1 for message in messages if message["role"] == "tool")


class Calculator(Environment):
    """Tool calls are answered until a reply without one, which is scored exactly."""

    name: ClassVar[str] = "calculator"

    def make_tasks(self, num_tasks: int, seed: int) -> list[dict[str, Any]]:
        return generate_tasks(self.name, num_tasks, seed, _build_task)

    def initial_messages(self, task: Mapping[str, Any]) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    def step(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        reply = last_assistant_content(messages, env=self.name)
        calls = read_tool_calls(messages[-1])
        if calls:
            return Turn.reply(*(answer_call(call, ordinal) for ordinal, call in enumerate(calls)))
        score = last_number(reply, str(task["answer"]))
        return Turn.finish(score.reward, parsed=score.parsed, truth=task["answer"], tool_calls=_tool_messages(messages))

    def finish_unfinished(self, task: Mapping[str, Any], messages: Sequence[Message]) -> Turn:
        return Turn.finish(0.0, truncated=True, truth=task["answer"], tool_calls=_tool_messages(messages))
