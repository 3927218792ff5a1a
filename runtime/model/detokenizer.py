"""Incremental detokenization with stop strings, and the end-of-sequence tokens a model stops on.

Text is decoded over a short window of recent tokens so each step costs O(1) in the output length,
and characters that may still become the start of a stop string are held back until they cannot.
"""

from __future__ import annotations


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every id the model's generation config or the tokenizer names as end of sequence."""
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded output text
        self.num_emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> None:
        """Append a token; sets `stopped` when a stop string appears (the text is cut there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._append_text(new)

    def _append_text(self, new: str) -> None:
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new
        if not self.stop:
            return
        best = -1
        best_stop = ""
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best == -1 or i < best):
                best, best_stop = i, s
        if best != -1:
            self.text = self.text[:best + len(best_stop)] if self.include_stop else self.text[:best]
            self.stopped = True

    def flush(self) -> str:
        """Text settled so far: everything when finished, else all but a possible stop-string start."""
        return self._take(len(self.text) - max(0, self.max_stop_len - 1))

    def finish(self) -> str:
        """All remaining text, the tail of an incomplete character included."""
        if not self.stopped and self.read_offset < len(self.ids):
            tail = self._decode(self.ids[self.prefix_offset:])
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            if len(tail) > len(prefix):
                self._append_text(tail[len(prefix):])
                self.read_offset = len(self.ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:upto]
        self.num_emitted = upto
        return delta

    def pending_text(self) -> str:
        """The text of the tokens held back so far (an incomplete character), without settling it."""
        if self.stopped or self.read_offset >= len(self.ids):
            return ""
        tail = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return tail[len(prefix):] if len(tail) > len(prefix) else ""


class StepText:
    """The text of a sequence's tokens from `start` on, as `tokenizer.decode(ids[start:],
    skip_special_tokens=True)` gives it, decoded incrementally: each new token costs O(1)."""

    def __init__(self, tokenizer, start: int) -> None:
        self.start = start
        self.detok = IncrementalDetokenizer(tokenizer)

    def text(self, token_ids: list[int]) -> str:
        for token in token_ids[self.start + len(self.detok.ids):]:
            self.detok.add(token)
        return self.detok.text + self.detok.pending_text()
