"""A plain reference of the search semantics: no paged KV, no engine, no forks.

Every token is sampled from a full forward pass of the transformers model over the path's tokens,
with the same per-path seeded generator the engine uses, and every score is computed directly with
transformers. Paths are plain token lists; strategies follow the reference description
(search-and-learn): refill by duplication, completion on EOS/length/empty step, the last step without
the delimiter, DVTS subtrees, dynamic branching's proportional allocation and granularity g.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.sampler import derive_seed
from runtime.search.aggregate import aggregate, allocate_children, normalize_step
from runtime.search.answers import Candidate, extract_answer, select
from runtime.verify.verifiers.confidence import confidence_from_logprobs


@dataclass
class RefPath:
    uid: int
    subtree: int
    tokens: list[int]
    generator: torch.Generator
    step_start: int = 0
    chunk_start: int = 0
    chunks: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    chunk_logprobs: list[float] = field(default_factory=list)
    done: bool = False
    reason: str | None = None
    text: str = ""
    seed_key: tuple[int, ...] = ()


class ReferenceSearch:
    def __init__(self, model, tokenizer, prompt_ids, question, search, temperature, seed, max_tokens, eos_ids,
                 judge=None):
        self.model, self.tok = model, tokenizer
        self.prompt = list(prompt_ids)
        self.question = question
        self.s = search
        self.temperature = temperature
        self.seed = seed
        self.max_tokens = max_tokens
        self.eos = set(eos_ids)
        self.judge = judge
        self.next_uid = 0
        self.step_index = 0

    def new_path(self, tokens, subtree, parent=None, ordinal=0):
        # A first path's seed derives from its uid; a child's from its parent's, the fork point and
        # its place among the parent's new children.
        key = (self.next_uid,) if parent is None else parent.seed_key + (len(tokens), ordinal)
        g = torch.Generator()
        g.manual_seed(derive_seed(self.seed, *key))
        path = RefPath(self.next_uid, subtree, list(tokens), g, len(tokens), len(tokens), seed_key=key)
        if parent is not None:
            path.chunks, path.scores = list(parent.chunks), list(parent.scores)
            path.chunk_start, path.text = parent.chunk_start, parent.text
        self.next_uid += 1
        return path

    def score(self, p):
        return aggregate(p.scores, self.s.aggregation) if p.scores else float("-inf")

    @torch.no_grad()
    def generate_step(self, path):
        last = self.step_index >= self.s.max_steps - 1
        while True:
            logits = self.model(torch.tensor([path.tokens])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            probs = torch.softmax(logits / self.temperature, -1)
            # One uniform draw from the path's generator, inverted through the cumulative distribution.
            cdf = probs.cumsum(-1)
            u = torch.rand((), generator=path.generator, dtype=cdf.dtype)
            token = min(int(torch.searchsorted(cdf, (u * cdf[-1]).unsqueeze(-1), right=True)), len(cdf) - 1)
            path.tokens.append(token)
            path.chunk_logprobs.append(float(logprobs[token]))
            step_ids = path.tokens[path.step_start:]
            step_text = self.tok.decode(step_ids, skip_special_tokens=True)
            ends = False
            if token in self.eos:
                path.done, path.reason = True, "stop"
            elif len(path.tokens) - len(self.prompt) >= self.max_tokens:
                path.done, path.reason = True, "length"
            elif self.s.strategy == "dvts" and "\\boxed{" in step_text and "}" in step_text.split("\\boxed{")[-1]:
                path.done, path.reason = True, "stop"
            elif not last and self.s.step_delimiter in step_text:
                ends = True
            elif len(step_ids) >= self.s.max_step_tokens and not last:
                ends = True
            if ends and not normalize_step(step_text, self.s.step_delimiter).strip():
                path.done, path.reason = True, "stop"
            if ends or path.done:
                path.text = self.tok.decode(path.tokens[len(self.prompt):], skip_special_tokens=True)
                return

    @torch.no_grad()
    def lookahead(self, path):
        """Greedy roll-out of `lookahead` more steps past the path: (extra units, their log-probs)."""
        tokens, start, step_start, left, logps = list(path.tokens), len(path.tokens), len(path.tokens), \
            self.s.lookahead, []
        while True:
            logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            logps.append(float(torch.log_softmax(logits, -1)[token]))
            tokens.append(token)
            step_ids = tokens[step_start:]
            step_text = self.tok.decode(step_ids, skip_special_tokens=True)
            ends = token in self.eos or len(tokens) - len(self.prompt) >= self.max_tokens
            if not ends and (self.s.step_delimiter in step_text or len(step_ids) >= self.s.max_step_tokens):
                if not normalize_step(step_text, self.s.step_delimiter).strip():
                    break  # an empty step ends the roll-out as it would end the path
                left -= 1
                step_start = len(tokens)
                ends = left == 0
            if ends:
                break
        text = self.tok.decode(tokens[start:], skip_special_tokens=True)
        units = [normalize_step(u, self.s.step_delimiter) for u in text.split(self.s.step_delimiter)]
        return [u for u in units if u.strip()], logps

    @torch.no_grad()
    def verify(self, paths):
        extra = {}
        for p in paths:
            unit = self.tok.decode(p.tokens[p.chunk_start:], skip_special_tokens=True)
            p.chunks.append(normalize_step(unit, self.s.step_delimiter))
            if self.s.lookahead and not p.done and self.step_index < self.s.max_steps:
                extra[p.uid] = self.lookahead(p)
        units = {p.uid: p.chunks + extra.get(p.uid, ([], []))[0] for p in paths}
        if self.s.verifier == "confidence":
            scores = [confidence_from_logprobs(p.chunk_logprobs + extra.get(p.uid, ([], []))[1]) for p in paths]
        else:  # a verifier re-scoring the full path through plain transformers: the last unit's score
            scores = [self.judge.score(self.question, [units[p.uid]])[0][-1] for p in paths]
        for p, sc in zip(paths, scores):
            p.scores.append(float(sc))
            p.chunk_logprobs = []
            p.chunk_start = len(p.tokens)

    def rank(self, paths):
        return sorted(paths, key=lambda p: (-self.score(p), p.uid))

    def run(self, n_choices):
        s = self.s
        subtrees = [i // s.beam_width for i in range(s.n)] if s.strategy == "dvts" else [0] * s.n
        live = [self.new_path(self.prompt, t) for t in subtrees]
        final = []
        while True:
            for p in sorted(live, key=lambda p: p.uid):
                self.generate_step(p)
            self.step_index += 1
            verify_now = self.step_index % s.granularity == 0 or self.step_index >= s.max_steps
            self.verify([p for p in sorted(live, key=lambda p: p.uid) if verify_now or p.done])
            if verify_now:
                done_now, live = self.settle(live)
            else:
                done_now, live = [p for p in live if p.done], [p for p in live if not p.done]
            final += done_now
            if self.step_index >= s.max_steps or not live:
                for p in live:
                    p.reason = "length"
                final += live
                break
            if verify_now:
                live = self.expand(live)
            for p in live:
                p.step_start = len(p.tokens)
        cands = [Candidate(extract_answer(p.text), self.score(p)) for p in final]
        order = select(cands, s.select)
        return [(final[i].text, self.score(final[i]), final[i].scores) for i in order[:n_choices]]

    def settle(self, stepped):
        if self.s.strategy != "dvts":
            return [p for p in stepped if p.done], [p for p in stepped if not p.done]
        final, live = [], []
        for t in sorted({p.subtree for p in stepped}):
            cands = [p for p in stepped if p.subtree == t]
            best = self.rank(cands)[0]
            if best.done:
                for p in cands:
                    if not p.done:
                        p.reason = "length"
                final += cands
            else:
                live.append(best)
        return final, live

    def expand(self, live):
        s = self.s
        keep = max(1, s.n // s.beam_width)
        if s.strategy == "best_of_n":
            return sorted(live, key=lambda p: p.uid)
        if s.strategy == "dvts":
            pairs = [(p, s.beam_width) for p in sorted(live, key=lambda p: p.subtree)]
        else:
            seen, unique = set(), []
            for p in sorted(live, key=lambda p: p.uid):
                if p.text not in seen:
                    seen.add(p.text)
                    unique.append(p)
            survivors = self.rank(unique)[:keep]
            if s.strategy == "beam":
                counts = {}
                cycle = [survivors[i % len(survivors)] for i in range(s.n)]
                for p in cycle:
                    counts[p.uid] = counts.get(p.uid, 0) + 1
                pairs = [(p, counts[p.uid]) for p in survivors]
            else:
                alloc = allocate_children([self.score(p) for p in survivors], s.n)
                pairs = [(p, c) for p, c in zip(survivors, alloc) if c > 0]
        out = []
        for parent, count in pairs:
            for ordinal in range(1, count):
                out.append(self.new_path(parent.tokens, parent.subtree, parent, ordinal))
            out.append(parent)
        return sorted(out, key=lambda p: p.uid)
