"""What the README and docs/ say that the code can check: their code blocks and markers, every `ponder`
command's flags, every settings key and environment variable, every route.

A shell or Python block is preceded by `<!-- run: live -->` (tests/test_docs_blocks.py runs it against
a live `ponder serve`) or by `<!-- not run: REASON -->`; a TOML block is read as settings."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = {"sh", "bash", "python"}
LIVE = "run: live"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_MARKER = re.compile(r"<!--\s*(run: live|not run:\s*(.*?)|checked:\s*(.*?))\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    marker: str | None  # "run: live", "not run: <reason>", "checked: <what>" or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str, page: str) -> list[Block]:
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        found.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2),
                           marker.group(1).strip() if marker else None))
    return found


SHOWN = "checked: the output of the request above"


def shown_outputs(found: list[Block]) -> list[tuple[Block, Block]]:
    """(the live request, the output shown for it): each block marked `<!-- checked: the output of the
    request above ... -->` paired with the live block before it on its page."""
    pairs = []
    for i, block in enumerate(found):
        if block.marker is not None and block.marker.startswith(SHOWN):
            request = next(b for b in reversed(found[:i]) if b.page == block.page and b.marker == LIVE)
            pairs.append((request, block))
    return pairs


UNCOMPARED = {"id", "created"}  # a fresh id and clock every time


def output_differences(shown, actual, where: str = "") -> list[str]:
    """Where `actual` (a response) differs from `shown` (the page's output, abridged: only the fields it
    shows are compared). A number shown with d decimals is compared rounded to d decimals; seconds and
    the response's id and time are not compared (they are the machine's, not the code's)."""
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return [f"{where}: {actual!r} is not an object"]
        return [d for key, value in shown.items() if key not in UNCOMPARED and not key.startswith("seconds_")
                for d in (output_differences(value, actual[key], f"{where}.{key}") if key in actual
                          else [f"{where}.{key}: not in the response"])]
    if isinstance(shown, list):
        if not isinstance(actual, list) or len(actual) != len(shown):
            return [f"{where}: {actual!r} is not {len(shown)} items"]
        return [d for i, (s, a) in enumerate(zip(shown, actual)) for d in output_differences(s, a, f"{where}[{i}]")]
    if isinstance(shown, float) and isinstance(actual, float):
        decimals = len(repr(shown).partition(".")[2])
        return [] if round(actual, decimals) == shown else [f"{where}: shown {shown}, the code gives {actual}"]
    return [] if shown == actual and type(shown) is type(actual) else [f"{where}: shown {shown!r}, the code gives {actual!r}"]


def unmarked(found: list[Block]) -> list[str]:
    """Runnable blocks with no marker, or a `not run` marker that gives no reason."""
    return [b.where for b in found if b.lang in RUNNABLE
            and (b.marker is None or b.marker.startswith("checked") or b.marker.rstrip() == "not run:")]


# Commands --------------------------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def bench_parser(name: str) -> argparse.ArgumentParser:
    """The parser `ponder bench NAME` builds, caught before the benchmark runs."""
    module = importlib.import_module(f"bench.{name.replace('-', '_')}")

    def catch(self, *_args, **_kwargs):
        raise _Parsed(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        module.main([])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"bench.{name}.main did not parse its arguments")


def command_problem(words: list[str]) -> str | None:
    """Why `ponder serve ...`, `ponder bench NAME ...` or `python -m bench.NAME ...` (its words) would not
    parse, or None. A synopsis (`[--flag N]`, `a|b`) is checked flag by flag; a command as typed is parsed."""
    from server.cli import build_parser

    top = build_parser()
    if words[:2] == ["python", "-m"] or words[:2] == ["python3", "-m"]:
        words = ["ponder", "bench", words[2].removeprefix("bench.").replace("_", "-"), *words[3:]]
    if len(words) < 2 or words[1] not in ("serve", "bench"):
        return f"`{' '.join(words[:2])}`: not a ponder command"
    if words[1] == "bench" and (len(words) == 2 or words[2] in ("...", "NAME")):
        return None  # the command group named, not a command
    if words[1] == "bench":
        names = top._subparsers._group_actions[0].choices["bench"]._actions[-2].choices
        if len(words) < 3 or words[2] not in names:
            return f"`ponder bench {words[2] if len(words) > 2 else ''}`: no such benchmark"
        parser, args = bench_parser(words[2]), words[3:]
    else:
        parser, args = top._subparsers._group_actions[0].choices["serve"], words[2:]
    if any(ch in " ".join(args) for ch in "[]|") or "..." in args:
        known = set(parser._option_string_actions)
        bad = [flag for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(args)) if flag not in known]
        return f"`{' '.join(words[:3])}`: unknown flags {bad}" if bad else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        return f"`{' '.join(words)}`: {err.getvalue().strip().splitlines()[-1]}"
    return None


def commands(text: str, shell: bool) -> list[list[str]]:
    """Every ponder command in `text`: each line of a shell block (continuations joined), or each inline
    code span that starts with one."""
    found = []
    spans = re.sub(r"\\\n\s*", " ", text).splitlines() if shell else re.findall(r"`([^`\n]+)`", text)
    for span in spans:
        for part in re.split(r"&&|\|\||;|(?<![\[\w])\|(?![\w\]])", span.split(" # ")[0]):
            words = part.split() if not shell else _shell_words(part)
            for i, word in enumerate(words):
                name = word.rsplit("/", 1)[-1]
                if name == "ponder" and i + 1 < len(words) and words[i + 1] in ("serve", "bench"):
                    found.append(["ponder", *words[i + 1:]])
                    break
                if name in ("python", "python3") and words[i + 1:i + 2] == ["-m"] and i + 2 < len(words) \
                        and words[i + 2].startswith("bench."):
                    found.append(["python", "-m", *words[i + 2:]])
                    break
    return found


def _shell_words(part: str) -> list[str]:
    try:
        return shlex.split(part, comments=True)
    except ValueError:
        return part.split()


# Settings keys and routes ----------------------------------------------------------------------------

_ENV = re.compile(r"\bPONDER_[A-Z0-9_]+")
_SECTION_KEY = re.compile(r"`\[([a-z_]+)\] ([a-z_]+)")
_DOTTED = re.compile(r"`(server|model|cache|scheduler|device|limits|search|ui)\.([a-z_]+)(?=`| =|: )")
_ROUTE = re.compile(r"\b(GET|POST) (/[\w/{}.-]*)")
_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost):8000(/[^\s'\"`)>\],]*)?")
NOT_SETTINGS = {"PONDER_API_KEY", "PONDER_TEST_DEVICE", "PONDER_CI_KEEP_IMAGES"}  # read by compose, tests, CI


def key_problems(text: str) -> list[str]:
    from server.config_reference import model_keys
    from server.schemas import SearchRequest

    keys = set(model_keys())
    problems = []
    for env in set(_ENV.findall(text)) - NOT_SETTINGS:
        parts = env.removeprefix("PONDER_").lower().split("__")
        if parts[0] == "verifiers" and len(parts) == 3:
            parts = ["verifiers.NAME", parts[2]]
        if ".".join(parts) not in keys:
            problems.append(f"{env}: no such setting")
    for section, key in set(_SECTION_KEY.findall(text)) | set(_DOTTED.findall(text)):
        if section == "search" and not key.startswith("max_"):
            continue  # the request's or the response's `search` object, not a setting
        if f"{section}.{key}" not in keys and not (section == "search" and key in SearchRequest.model_fields):
            problems.append(f"{section}.{key}: no such setting")
    return sorted(problems)


def not_settings_are_read_somewhere() -> dict[str, bool]:
    sources = [p for d in ("deploy", "tests", ".ci") for p in (ROOT / d).rglob("*") if p.is_file()]
    texts = "\n".join(p.read_text(errors="replace") for p in sources if p.suffix != ".pyc" and p.name != "docs_blocks.py")
    return {name: name in texts for name in NOT_SETTINGS}


@cache
def app_routes() -> frozenset[tuple[str, str]]:
    from server.app import create_app
    from server.config import Settings

    app = create_app(Settings())
    return frozenset((method, _shape(route.path)) for route in app.routes for method in getattr(route, "methods", ()))


def route_problems(text: str) -> list[str]:
    routes = app_routes()
    paths = {path for _, path in routes}
    problems = [f"{method} {path}: no such route" for method, path in _ROUTE.findall(text)
                if (method, _shape(path)) not in routes]
    for path in _URL.findall(text):
        path = _shape(path.split("?")[0])
        if path and path not in paths and not any(p.startswith(path.rstrip("/") + "/") for p in paths):
            problems.append(f"{path}: no such route")
    return sorted(set(problems))


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path.rstrip("/") or "/")


def toml_problem(code: str) -> str | None:
    import tomllib

    from pydantic import ValidationError

    from server.config import Settings

    try:
        Settings(**tomllib.loads(code))
    except (tomllib.TOMLDecodeError, ValidationError) as exc:
        return str(exc).splitlines()[0]
    return None
