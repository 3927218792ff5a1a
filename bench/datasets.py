"""A user's own problem set: JSON Lines in the shapes the common math sets are published in.

    load_problems(path) -> list[Problem]

One JSON object a line (blank lines are skipped); each line's keys decide its shape:

- MATH-500: `problem` and `answer` (LaTeX, e.g. `\\frac{14}{3}`); a `level` of 1-5 or `"Level 3"` is kept;
- GSM8K: `question` and an `answer` whose worked solution ends in `#### N`: the gold answer is what follows
  the last `####`, thousands commas removed (`#### 1,200` -> `1200`);
- plain: `question` and `answer`, the answer as it stands (a string or a number).

Other keys are ignored. The first line that is not JSON, not an object, of no known shape, or with an
empty answer stops the load with a `DatasetError` naming the file and the line, in one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.problems import Problem

SHAPES = "MATH-500 (problem, answer), GSM8K (question, answer ending in '#### N') or plain (question, answer)"
_LEVEL = re.compile(r"(?:level\s*)?([1-9])", re.IGNORECASE)


class DatasetError(ValueError):
    """A problem file that cannot be read; the message is one line naming the file and line."""


def load_problems(path: str | Path) -> list[Problem]:
    """Every problem in `path`, in file order."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            problems.append(parse_line(line, f"{path} line {number}"))
    if not problems:
        raise DatasetError(f"{path}: no problems (expected one JSON object a line)")
    return problems


def parse_line(line: str, where: str) -> Problem:
    """One line as a Problem; `where` (`FILE line N`) starts any error's message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: not a JSON object but {type(record).__name__}")
    if "problem" in record and "answer" in record:
        return Problem(_level(record.get("level"), where), _text(record, "problem", where),
                       _text(record, "answer", where))
    if "question" in record and "answer" in record:
        question, answer = _text(record, "question", where), _text(record, "answer", where)
        if "####" in answer:
            answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
            if not answer:
                raise DatasetError(f"{where}: nothing after '####' in the answer")
        return Problem(_level(record.get("level"), where), question, answer)
    keys = ", ".join(sorted(record)) or "none"
    raise DatasetError(f"{where}: unknown shape (keys: {keys}); expected {SHAPES}")


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: {key!r} must be a string or a number, not {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise DatasetError(f"{where}: {key!r} is empty")
    return text


def _level(value, where: str) -> int | None:
    """MATH-500's `level` (3 or "Level 3"); None when the line has none."""
    if value is None:
        return None
    match = _LEVEL.fullmatch(str(value).strip())
    if isinstance(value, bool) or not match:
        raise DatasetError(f"{where}: level must be 1-9 or 'Level N', not {value!r}")
    return int(match.group(1))
