"""Final answers: extracting them from a finished path, deciding whether two are the same, and ranking
the candidates of a search (best score, majority vote, score-weighted vote).

Equivalence of mathematical answers is decided by `math-verify` (`\\frac{1}{2}` equals `0.5`, `2`
equals `2.0`); when it cannot parse an answer, or the answer came from a caller's own pattern, two
answers are the same only when their stripped texts are equal.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.wire.tool_calls import parse_tool_calls

SELECTIONS = ("best", "majority", "weighted_majority")

# Longer "answers" are almost always a failed extraction (a paragraph); parsing them with sympy is
# slow and, off the main thread, not protected by math-verify's signal-based timeout.
MAX_VERIFIABLE_ANSWER_CHARS = 512
MATH_VERIFY_TIMEOUT_S = 5

_FINAL_ANSWER_SPAN = re.compile(r"final answer is:?\s*\$+([^$]+)\$", re.IGNORECASE)
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"the answer is:?", re.IGNORECASE)
_CANONICAL_INTEGER = re.compile(r"-?[1-9][0-9]*|0")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


# ---------------------------------------------------------------------------------------------
# Extraction


def compile_answer_pattern(pattern: str) -> re.Pattern[str]:
    """The caller's `answer_pattern`, compiled; a ValueError names the problem for a 400 answer."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"answer_pattern is not a valid regular expression: {exc}") from None


def extract_answer(text: str, pattern: str | re.Pattern[str] | None = None) -> str | None:
    """The final answer of a path's text, or None when there is none.

    With `pattern`: its LAST match in the text (models restate and correct themselves, the final
    statement counts), the first capture group when the pattern has groups, else the whole match.
    Without: the reference order, each rule tried only when the previous found nothing:
    1. the span of `final answer is $...$` (a `\\boxed{}` inside it is unwrapped);
    2. the content of the last brace-balanced `\\boxed{...}` (or `\\fbox{...}`);
    3. the rest of the line after the last "the answer is", minus surrounding `$` and a final period;
    4. the last number (thousands separators removed).
    """
    if pattern is not None:
        return _extract_by_pattern(text, pattern)
    spans = _FINAL_ANSWER_SPAN.findall(text)
    if spans:
        span = spans[-1].strip()
        return _clean(_last_boxed(span) or span)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    stated = _after_answer_is(text)
    if stated:
        return stated
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", "")
    return None


def structured_answer(text: str, form: str) -> str | None:
    """The answer of a path whose output a grammar shaped, in a form where equal answers are equal texts:
    `json`: the value in canonical JSON (keys sorted, no spaces), so texts that differ only in key order
    or spacing vote together; `tools:<format>`: the calls (name and arguments, canonical), or the text
    when the model answered without one; `text` (a regex, a choice, a grammar): the stripped text."""
    if form == "json":
        try:
            return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except ValueError:
            return None  # cut short by max_tokens: not an answer
    if form.startswith("tools:"):
        content, calls = parse_tool_calls(text, form.removeprefix("tools:"))
        if calls:
            return "[" + ",".join(call.canonical() for call in calls) + "]"
        return (content or "").strip() or None
    return text.strip() or None


def _extract_by_pattern(text: str, pattern: str | re.Pattern[str]) -> str | None:
    compiled = compile_answer_pattern(pattern) if isinstance(pattern, str) else pattern
    last = None
    for match in compiled.finditer(text):
        last = match
    if last is None:
        return None
    found = last.group(1) if compiled.groups else last.group(0)
    return None if found is None else found.strip()


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces balance; an unclosed box (a truncated path)
    is skipped in favour of an earlier complete one."""
    for opening in reversed(list(_BOX_OPENING.finditer(text))):
        depth = 1
        for i in range(opening.end(), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[opening.end():i]
    return None


def _after_answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end():].strip()
    line = rest.split("\n", 1)[0]
    return _clean(line) or None


def _clean(answer: str) -> str:
    answer = answer.strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer


# ---------------------------------------------------------------------------------------------
# Equivalence


def answers_equivalent(a: str, b: str, *, compare_as_text: bool = False) -> bool:
    """Whether two extracted answers are the same answer.

    `compare_as_text` (answers from a caller's pattern): equal stripped strings. Otherwise math-verify
    in both directions (its `verify` treats its first argument as the gold answer); when either side
    does not parse, equal stripped strings.
    """
    a, b = a.strip(), b.strip()
    if a == b:
        return True
    if compare_as_text or (_CANONICAL_INTEGER.fullmatch(a) and _CANONICAL_INTEGER.fullmatch(b)):
        return False  # two integers written without sign quirks or leading zeros differ as they read
    parsed_a, parsed_b = list(_parse(a)), list(_parse(b))  # verify() wants lists, the cache tuples
    if not parsed_a or not parsed_b:
        return False
    from math_verify import verify

    timeout = _timeout_seconds()
    try:
        return bool(verify(parsed_a, parsed_b, timeout_seconds=timeout)
                    or verify(parsed_b, parsed_a, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - an answer math-verify chokes on compares as text (unequal)
        return False


@functools.lru_cache(maxsize=4096)
def _parse(answer: str) -> tuple:
    if not answer or len(answer) > MAX_VERIFIABLE_ANSWER_CHARS:
        return ()
    from math_verify import parse

    # Extracted answers are LaTeX without delimiters; math-verify looks for LaTeX inside `$...$`.
    latex = "$" + answer.replace("$", "") + "$"
    try:
        return tuple(parse(latex, parsing_timeout=_timeout_seconds()))
    except Exception:  # noqa: BLE001 - unparseable means "compare as text"
        return ()


def warm_up() -> None:
    """Load math-verify and its LaTeX parser by comparing two answers once, so the first search's
    answer selection does not pay for it (about 0.6 s on a 2-core CPU: the import, then the parser's
    first use)."""
    answers_equivalent("51", "17 \\times 3")


def _timeout_seconds() -> int | None:
    # math-verify's timeout is signal.alarm, which only the main thread may set; elsewhere the
    # answer length cap above is the guard.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


# ---------------------------------------------------------------------------------------------
# Selection


@dataclass(frozen=True)
class Candidate:
    """One finished path as the selection sees it."""

    answer: str | None  # the extracted final answer; None when extraction found nothing
    score: float  # the path's aggregated verifier score


def group_answers(candidates: Sequence[Candidate], *, compare_as_text: bool = False) -> list[list[int]]:
    """Candidate indices grouped by equivalent answers, groups in order of their first member.

    Each candidate joins the first group whose first member's answer is equivalent to its own (the
    relation is not guaranteed transitive, so membership is decided against one representative).
    A candidate without an answer is a group of its own.

    Equivalence depends on the stripped texts alone, so a text seen before joins the group its first
    holder joined (every earlier group was already found unequal to it): each distinct answer is
    compared with the group leaders once, not once per candidate holding it.
    """
    groups: list[list[int]] = []
    group_of: dict[str, list[int]] = {}  # stripped answer text -> the group it joined
    for i, candidate in enumerate(candidates):
        if candidate.answer is None:
            groups.append([i])
            continue
        text = candidate.answer.strip()
        if text in group_of:
            group_of[text].append(i)
            continue
        for group in groups:
            first = candidates[group[0]].answer
            if first is not None and answers_equivalent(first, text, compare_as_text=compare_as_text):
                group.append(i)
                break
        else:
            groups.append([i])
            group = groups[-1]
        group_of[text] = group
    return groups


def select(candidates: Sequence[Candidate], mode: str, *, compare_as_text: bool = False) -> list[int]:
    """Every candidate index, best first, under the selection rule `mode`.

    - `best`: by score, highest first.
    - `majority`: whole answer groups in order of size, ties by the group's best score, then by the
      lowest index of that best member; within a group by score.
    - `weighted_majority`: as `majority`, but groups ordered by their summed score first.
    Equal scores always fall back to the lower index, so the ranking is deterministic.
    """
    if mode not in SELECTIONS:
        raise ValueError(f"unknown selection {mode!r}; expected one of {', '.join(SELECTIONS)}")
    scores = [_sortable(c.score) for c in candidates]
    by_score = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))
    if mode == "best":
        return by_score
    rank = {index: position for position, index in enumerate(by_score)}
    groups = [sorted(group, key=rank.__getitem__)
              for group in group_answers(candidates, compare_as_text=compare_as_text)]

    def group_key(group: list[int]) -> tuple:
        leader_rank = rank[group[0]]  # the best member: highest score, then lowest index
        if mode == "majority":
            return (-len(group), leader_rank)
        return (-math.fsum(scores[i] for i in group), leader_rank)

    return [index for group in sorted(groups, key=group_key) for index in group]


def _sortable(score: float) -> float:
    return -math.inf if math.isnan(score) else float(score)
