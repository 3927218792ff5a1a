"""Telling a reasoning model's thinking from its answer (text work, no torch: both processes use it).

Formats: `think`, the `<think>...</think>` block of Qwen3, Qwen3.5, the DeepSeek-R1 distills and SmolLM3;
`none`, a model that does not think in its text. The chat template names the format
(`reasoning_format_of`). A template may open the block in the generation prompt (Qwen3.5, the R1
distills): the output then holds only the closing tag, and a prompt that ends inside an open block
(`opens_thinking`) starts the output in thinking. Without a closing tag, an output that started in
thinking is all thinking (cut short by max_tokens); one that did not is all answer.
"""

from __future__ import annotations

FORMATS = ("none", "think")
OPEN, CLOSE = "<think>", "</think>"


def reasoning_format_of(chat_template: str | None) -> str:
    """The format a chat template's model thinks in: `think` where the template knows the closing tag."""
    if chat_template and CLOSE in chat_template:
        return "think"
    return "none"


def opens_thinking(prompt_text: str, fmt: str) -> bool:
    """Whether a rendered prompt (its end is enough) leaves a thinking block open for the output."""
    if fmt != "think":
        return False
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def split_reasoning(text: str, fmt: str, starts_open: bool) -> tuple[str | None, str]:
    """(the thinking, or None where there was none; the answer). The whitespace between the closing tag
    and the answer is the format's, not the model's words, and is dropped; the thinking is as written."""
    if fmt == "none":
        return None, text
    stream = ReasoningStream(fmt, starts_open)
    thinking, answer = stream.feed(text)
    more_thinking, more_answer = stream.finish()
    thinking += more_thinking
    answer += more_answer
    return (thinking if stream.has_thought else None), answer


class ReasoningStream:
    """Text deltas in; (thinking, answer) deltas out. A tail that could begin a tag is held until the
    next delta shows it does not (or the text ends). Only the first block is thinking: text after it,
    tags included, is the answer."""

    def __init__(self, fmt: str, starts_open: bool) -> None:
        self.fmt = fmt
        self.state = "thinking" if starts_open else "before"  # before -> thinking -> answer
        self.pending = ""  # held text: a possible tag, or whitespace whose place is not known yet
        self.has_thought = starts_open
        self.num_answer_chars = 0

    def feed(self, delta: str) -> tuple[str, str]:
        if self.fmt == "none":
            return "", delta
        thinking, answer = "", ""
        text = self.pending + delta
        self.pending = ""
        while text:
            if self.state == "before":
                stripped = text.lstrip()
                if not stripped:  # only whitespace yet: it may precede an opening tag
                    self.pending = text
                    return thinking, answer
                if stripped.startswith(OPEN):
                    self.state, self.has_thought = "thinking", True
                    text = stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):  # the tag may still be arriving
                    self.pending = text
                    return thinking, answer
                self.state = "answer"
                continue
            if self.state == "thinking":
                at = text.find(CLOSE)
                if at >= 0:
                    thinking += text[:at]
                    self.state = "after"
                    text = text[at + len(CLOSE):]
                    continue
                hold = _partial_suffix(text, CLOSE)
                thinking += text[:len(text) - hold]
                self.pending = text[len(text) - hold:]
                return thinking, answer
            if self.state == "after":  # whitespace between the closing tag and the answer is the format's
                stripped = text.lstrip()
                if not stripped:
                    return thinking, answer
                self.state, text = "answer", stripped
                continue
            answer += text
            text = ""
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back, as the state it was held in."""
        rest, self.pending = self.pending, ""
        if self.state == "thinking":
            return rest, ""
        return "", rest


def _partial_suffix(text: str, marker: str) -> int:
    """How many final characters of `text` are a proper beginning of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
