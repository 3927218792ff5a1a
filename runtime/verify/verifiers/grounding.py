"""Where a path's numbers may come from: the calculator's grounding of an equation's operands.

An operand is supported when it is
- a number the question states, in digits (`12`, `$3.50`, `1,000`) or in words (`twelve`,
  `twenty-five`, `a dozen`, `twice`, `half`);
- a result the path computed before it (a claim's value, or the left side of a chain `3 + 4 = 7 + 1`);
- a constant the question's units imply, and only those listed in `UNIT_CONSTANTS`: each is implied
  when every word of its entry occurs in the question (minutes and hours imply 60, a dozen 12, ...).

Everything else is a number from nowhere: `Sara has 12 pencils and gives away 5` supports 12 and 5,
so `12 - 6 = 6` rests on a 6 the problem never gave. Pure Python, no model.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable

# (value, the words that must all occur in the question to imply it, what it is). Kept short on
# purpose: every entry is a number a path may use without the question stating it.
UNIT_CONSTANTS: tuple[tuple[float, tuple[str, ...], str], ...] = (
    (60, ("hour", "minute"), "minutes in an hour"),
    (60, ("minute", "second"), "seconds in a minute"),
    (24, ("day", "hour"), "hours in a day"),
    (7, ("week", "day"), "days in a week"),
    (12, ("year", "month"), "months in a year"),
    (12, ("dozen",), "things in a dozen"),
    (100, ("dollar", "cent"), "cents in a dollar"),
    (100, ("percent",), "a percentage's whole"),
    (100, ("%",), "a percentage's whole"),
)

_UNITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
          "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80,
         "ninety": 90}
# Words that state a number without being one: each stands for every value listed.
_MULTIPLES = {"dozen": (12,), "dozens": (12,), "hundred": (100,), "thousand": (1000,), "twice": (2,),
              "double": (2,), "doubles": (2,), "triple": (3,), "triples": (3,), "thrice": (3,), "pair": (2,),
              "pairs": (2,), "half": (2, 0.5), "halves": (2, 0.5), "quarter": (4, 0.25), "quarters": (4, 0.25)}
_WORD_VALUES = {word: value for value, word in enumerate(_UNITS)} | _TENS
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


@functools.lru_cache(maxsize=1024)
def question_numbers(question: str) -> frozenset[float]:
    """Every number the question states (digits and number words) and the unit constants it implies."""
    text = _THOUSANDS.sub("", question.replace("$", "")).lower()
    found = {float(n) for n in _NUMBER.findall(text)}
    for word in _WORD.findall(text):
        found.update(_word_values(word))
    found.update(_word_values_spaced(text))
    found.update(value for value, words, _ in UNIT_CONSTANTS if all(w in text for w in words))
    return frozenset(found)


def _word_values(word: str) -> tuple[float, ...]:
    if word in _MULTIPLES:
        return tuple(float(v) for v in _MULTIPLES[word])
    if word in _WORD_VALUES:
        return (float(_WORD_VALUES[word]),)
    tens, _, unit = word.partition("-")
    if tens in _TENS and unit in _WORD_VALUES and 0 < _WORD_VALUES[unit] < 10:
        return (float(_TENS[tens] + _WORD_VALUES[unit]),)  # twenty-five
    return ()


def _word_values_spaced(text: str) -> set[float]:
    """`twenty five` written with a space, and `N hundred` / `N thousand` (two hundred = 200)."""
    words = _WORD.findall(text)
    found: set[float] = set()
    for first, second in zip(words, words[1:]):
        if first in _TENS and second in _WORD_VALUES and 0 < _WORD_VALUES[second] < 10:
            found.add(float(_TENS[first] + _WORD_VALUES[second]))
        if second in ("hundred", "thousand") and first in _WORD_VALUES:
            found.add(float(_WORD_VALUES[first] * (100 if second == "hundred" else 1000)))
    return found


def operands(expression: str) -> list[float]:
    """The numbers an expression in the calculator's notation computes with (signs dropped)."""
    return [float(n) for n in _NUMBER.findall(expression)]


def is_supported(value: float, known: Iterable[float]) -> bool:
    return any(math.isclose(value, k, rel_tol=1e-12, abs_tol=1e-9) for k in known)
