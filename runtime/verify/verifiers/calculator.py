"""A tool verifier: a calculator checks the arithmetic a path writes down.

A step's claims are the equations it states, `expression = number` (`52 + 3 = 65`, `(4 + 2) x 3 = 18`,
`$12 \\times 3 = $36`): the calculator evaluates the expression exactly and compares it with the number.
A stated final answer (`\\boxed{...}`, "the final answer is ...") is a claim too: it must equal the true
value of the last expression the path computed before it or in the same step.

Each claim must also be grounded (`runtime.verify.verifiers.grounding`): every operand a number the
question states, a result the path computed before it, or a constant the question's units imply. A
true equation over a number from nowhere (`Sara has 12 pencils and gives away 5` ... `12 - 6 = 6`) is
unsupported, and so is the path from there on. The stated answer must be the last supported result:
one that contradicts the last result is refuted, and one that is the result of an unsupported claim
leaves the path unsupported (it already is).

The verdict is on the path so far, as a process reward model's is (is the solution correct up to
here?), in four tiers; the worst claim up to and including this step decides:
- 0, refuted: some claim is false, or the stated answer contradicts the last result;
- 1, unsupported: the claims hold, but one computes with a number the problem does not support;
- 2, unchecked: nothing to check yet (no equation, or none the calculator reads);
- 3, checked: at least one claim holds, every one is grounded, and none fails.
A number from nowhere is evidence of a wrong setup, so it ranks below a path with nothing to check.

The step's score is (tier + confidence) / 4, where confidence is the generator's own geometric-mean
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

from runtime.verify.verifiers.grounding import is_supported, operands, question_numbers

REFUTED, UNSUPPORTED, UNCHECKED, CHECKED = 0, 1, 2, 3
TIERS = 4

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
    # The values of the left sides a chain stated before it (`3 + 4 = 7 + 1 = 8`: 7 for `7 + 1`).
    chained: tuple[float, ...] = ()

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
    chained: list[float] = []
    for match in _CLAIM.finditer(text):
        expression, stated = match.group(1), match.group(2)
        if len(expression) > _MAX_CLAIM_CHARS:
            chained = []
            continue
        if _AFTER_RIGHT.match(text, match.end()):
            value = evaluate(expression)
            chained = chained + [value] if value is not None else []
            continue
        found.append(Claim(expression, stated, evaluate(expression), tuple(chained)))
        chained = []
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


def tier(steps: Sequence[str], question: str) -> int:
    """The calculator's verdict on a path made of `steps` for `question`: REFUTED, UNSUPPORTED,
    UNCHECKED or CHECKED."""
    known = set(question_numbers(question))
    checked, grounded = False, True
    last_value: float | None = None
    for step in steps:
        for claim in claims(step):
            if claim.value is None:
                continue
            if not claim.holds:
                return REFUTED
            known.update(claim.chained)
            grounded = grounded and all(is_supported(operand, known) for operand in operands(claim.expression))
            checked = True
            known.add(claim.value)
            last_value = claim.value
        number = answer_number(step)
        if number is not None and last_value is not None and not agrees(last_value, number):
            return REFUTED
    if not grounded:
        return UNSUPPORTED
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


def step_score(steps: Sequence[str], confidence: float, question: str) -> float:
    """The score of a path's newest step: its tier, ordered within by the step's `confidence` in [0, 1]."""
    return (tier(steps, question) + min(max(confidence, 0.0), 1.0)) / TIERS


def tier_of_score(score: float) -> int:
    """The tier a step score was given in. A confidence is never 0 (it is a probability's exp-mean) but
    may round to 1, so a score on a boundary, (t + 1) / TIERS, is tier t at full confidence."""
    return max(0, math.ceil(score * TIERS) - 1)
