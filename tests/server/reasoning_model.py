"""A Qwen3 replica (tests.replicas) served with Qwen3.5's published chat template, its tokenizer marking
`<think>`, `</think>`, `<tool_call>` and `</tool_call>` as the published Qwen3 tokenizers do: added tokens
that are not special (so they stay in the decoded text, where the reasoning and tool-call parsers read them)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.replicas.generators import write_qwen3

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
NOT_SPECIAL = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def write_thinking_model(directory: Path, template: str = "Qwen3.5-4B.jinja") -> Path:
    write_qwen3(directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in NOT_SPECIAL:
            token["special"] = False
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for token in config["added_tokens_decoder"].values():
        if token["content"] in NOT_SPECIAL:
            token["special"] = False
    config["chat_template"] = (TEMPLATES / template).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return directory
