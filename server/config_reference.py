"""The configuration reference, made from the settings model itself: every key, its type, default and
environment variable from `server.config.Settings`, its description from `config.example.toml`.

The documentation site renders it (docs/hooks/config_reference.py), so the reference cannot drift from
the model; `tests/server/test_config_reference.py` checks that the example file documents every key
of the model once, with the model's defaults, and names no other.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from server.config import Settings, VerifierSettings

EXAMPLE = Path(__file__).resolve().parents[1] / "config.example.toml"
VERIFIER = "verifiers.NAME"  # the section of one reward model, `[verifiers.<name>]`

_SECTION = re.compile(r"^#?\s*\[([a-z_.]+)\]\s*(?:#\s*(.*))?$")
_KEY = re.compile(r"^#?\s*([a-z_]+)\s*=\s*(.+?)\s*(?:#\s*(.*))?$")
_MORE = re.compile(r"^\s+#\s*(.*)$")  # an indented comment line continues the description above it


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str
    default: str
    description: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        section = self.section.replace(".", "__").upper()
        return f"PONDER_{section}__{self.name.upper()}"


def model_keys() -> dict[str, tuple[str, str]]:
    """`section.key` -> (type, default) for every key of the settings model."""
    keys = {}
    for section, field in Settings.model_fields.items():
        model = VerifierSettings if section == "verifiers" else field.annotation
        name = VERIFIER if section == "verifiers" else section
        for key, sub in model.model_fields.items():
            default = "required" if sub.default is PydanticUndefined else _value(sub.default)
            keys[f"{name}.{key}"] = (_type(sub.annotation), default)
    return keys


def sections() -> list[str]:
    return [VERIFIER if name == "verifiers" else name for name in Settings.model_fields]


def section_docs(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def example_descriptions(text: str | None = None) -> dict[str, list[str]]:
    """`section.key` -> the descriptions `config.example.toml` gives it (one per time it names the key)."""
    text = EXAMPLE.read_text() if text is None else text
    found: dict[str, list[str]] = {}
    section, last = None, None
    for line in text.splitlines():
        if (match := _SECTION.match(line)) is not None:
            section = VERIFIER if match.group(1).startswith("verifiers.") else match.group(1)
            found.setdefault(f"[{section}]", []).append(match.group(2) or "")
            last = f"[{section}]"
        elif section is not None and (match := _KEY.match(line)) is not None and not line.startswith("# ["):
            last = f"{section}.{match.group(1)}"
            found.setdefault(last, []).append(match.group(3) or "")
        elif last is not None and (match := _MORE.match(line)) is not None:
            found[last][-1] = f"{found[last][-1]} {match.group(1)}".strip()
        else:
            last = None
    return found


def example_defaults(text: str | None = None) -> dict[str, str]:
    """`section.key` -> the value the example file sets (its keys that are not commented out)."""
    import tomllib

    data = tomllib.loads(EXAMPLE.read_text() if text is None else text)
    return {f"{section}.{key}": _value(value) for section, table in data.items() for key, value in table.items()}


def keys() -> list[Key]:
    described = example_descriptions()
    return [Key(*dotted.rsplit(".", 1), type_, default, " ".join(described.get(dotted, [""])))
            for dotted, (type_, default) in model_keys().items()]


def markdown() -> str:
    """The reference as Markdown: a table per section, every key once."""
    described = example_descriptions()
    lines = []
    for section in sections():
        lines += [f"### `[{section}]`", ""]
        intro = " ".join(described.get(f"[{section}]", [""])).strip()
        if intro:
            lines += [intro[0].upper() + intro[1:] + ".", ""]
        lines += ["| key | type | default | environment variable | what it does |", "|---|---|---|---|---|"]
        for key in keys():
            if key.section == section:
                text = key.description.replace("|", "\\|")
                lines.append(f"| `{key.name}` | {key.type} | `{key.default}` | `{key.env}` | {text} |")
        lines.append("")
    return "\n".join(lines)


def _type(annotation) -> str:
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{_value(arg)}`" for arg in args)
    if origin is dict:
        return "table"
    if args and origin is not list:
        return " \\| ".join(_type(arg) for arg in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if annotation is type(None):
        return "unset"
    name = getattr(annotation, "__name__", str(annotation))
    return "secret string" if name == "SecretStr" else name


def _value(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)
