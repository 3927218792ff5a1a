"""A tool verifier: a calculator checks the arithmetic a path writes down.

A step's claims are the equations it states, `expression = number` (`52 + 3 = 65`, `(4 + 2) x 3 = 18`,
`$12 \\times 3 = $36`): the calculator evaluates the expression exactly and compares it with the number.
A stated final answer (`\\boxed{...}`, "the final answer is ...") is a claim too: it must equal the true
value of the last expression the path computed before it or in the same step.

The verdict is on the path so far, as a process reward model's is (is the solution correct up to
here?), in three tiers:
- 0, refuted: some claim up to and including this step is false;
- 1, unchecked: nothing to check yet (no equation, or none the calculator reads);
- 2, checked: at least one claim holds and none fails.

The step's score is (tier + confidence) / 3, where confidence is the generator's own geometric-mean
token probability of the step (the `confidence` verifier, free while sampling): the calculator decides
the tier and confidence orders paths within it. On text with no arithmetic it ranks paths exactly as
`confidence` does. Pure Python: no model, no tensors, no `eval`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

REFUTED, UNCHECKED, CHECKED = 0, 1, 2
TIERS = 3

_NUMBER = r"\d+(?:\.\d+)?"
_OPERAND = rf"(?:\(\s*)*-?{_NUMBER}(?:\s*\))*"
# An expression of at least two operands; the right side is looked ahead, not consumed, so in a chain
# (`3 + 4 = 7 + 1 = 8`) the next claim can start at its number.
_CLAIM = re.compile(rf"(?<![\w.)])({_OPERAND}(?:\s*[-+*/]\s*{_OPERAND})+)\s*=\s*(?=(-?{_NUMBER})(?![\d.]\d))")
_AFTER_RIGHT = re.compile(rf"-?{_NUMBER}\s*[-+*/]\s*[\d(]")
_TIMES = re.compile(r"(?<=[\d)])\s*(?:\\times|\\cdot|×|·|x)\s*(?=[\d(])")
_DIVIDE = re.compile(r"\s*(?:\\div|÷)\s*")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# A stated answer that is a plain number: boxed, or after "the answer is" / "final answer is".
_BOXED_NUMBER = re.compile(rf"\\(?:boxed|fbox)\s*\{{\s*(-?{_NUMBER})\s*\.?\s*\}}")
_ANSWER_NUMBER = re.compile(rf"answer is:?\s*(-?{_NUMBER})(?![\d.]\d)", re.IGNORECASE)
_ANY_ANSWER = re.compile(r"\\(?:boxed|fbox)\s*\{|answer is", re.IGNORECASE)
_MAX_CLAIM_CHARS = 200
_MAX_DIGITS = 30

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@dataclass(frozen=True)
class Claim:
    expression: str
    stated: str
    value: float | None  # the expression's true value; None when the calculator cannot evaluate it

    @property
    def holds(self) -> bool:
        return self.value is not None and agrees(self.value, self.stated)


def normalize(text: str) -> str:
    """Text with its arithmetic in the calculator's notation: `x`, `×`, `\\times` and `\\cdot` between
    numbers become `*`, `÷` and `\\div` become `/`; currency signs, LaTeX thin spaces and thousands
    separators go."""
    text = text.replace("\\,", "").replace("$", "")
    text = _THOUSANDS.sub("", text)
    text = _TIMES.sub(" * ", text)
    return _DIVIDE.sub(" / ", text)


def claims(text: str) -> list[Claim]:
    """Every `expression = number` in `text`, in order. A right side that is itself an expression
    (`= 7 + 1`) is no claim of a number: it is skipped, and its own equation (if any) is read next."""
    text = normalize(text)
    found = []
    for match in _CLAIM.finditer(text):
        expression, stated = match.group(1), match.group(2)
        if _AFTER_RIGHT.match(text, match.end()) or len(expression) > _MAX_CLAIM_CHARS:
            continue
        found.append(Claim(expression, stated, evaluate(expression)))
    return found


def evaluate(expression: str) -> float | None:
    """The value of + - * / over numbers and parentheses, or None (not such an expression, a division
    by zero, a number too long)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None
    try:
        value = _value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if len(str(node.value)) > _MAX_DIGITS:
            raise ValueError("number too long")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def agrees(value: float, stated: str) -> bool:
    """Whether the number written as `stated` is `value`, to the decimals it was written with
    (`10 / 3 = 3.33` holds, `14 / 10 = 1` does not)."""
    try:
        number = float(stated)
    except ValueError:
        return False
    decimals = len(stated.split(".", 1)[1]) if "." in stated else 0
    if decimals == 0:
        return math.isclose(value, number, rel_tol=1e-12, abs_tol=1e-9)
    return abs(value - number) <= 0.5 * 10 ** -decimals + 1e-12


def tier(steps: Sequence[str]) -> int:
    """The calculator's verdict on a path made of `steps`: REFUTED, UNCHECKED or CHECKED."""
    checked = False
    last_value: float | None = None
    for step in steps:
        for claim in claims(step):
            if claim.value is None:
                continue
            if not claim.holds:
                return REFUTED
            checked = True
            last_value = claim.value
        number = answer_number(step)
        if number is not None and last_value is not None and not agrees(last_value, number):
            return REFUTED
    return CHECKED if checked else UNCHECKED


def answer_number(step: str) -> str | None:
    """The number a step states as its answer, or None: no stated answer, or one that is not a plain
    number (`\\frac{32}{2}` is not compared). The last statement counts, as in the search's answers."""
    text = normalize(step)
    statements = list(_ANY_ANSWER.finditer(text))
    if not statements:
        return None
    last = statements[-1]
    found = (_BOXED_NUMBER if last.group(0).startswith("\\") else _ANSWER_NUMBER).match(text, last.start())
    return found.group(1) if found else None


def step_score(steps: Sequence[str], confidence: float) -> float:
    """The score of a path's newest step: its tier, ordered within by the step's `confidence` in [0, 1]."""
    return (tier(steps) + min(max(confidence, 0.0), 1.0)) / TIERS
