"""Plain (non-search) requests in the engine: their choices fork from the first logits, each sampled
token goes through stops and detokenization, and every step's new text leaves as `Delta`s.

A request may ask for its prompt back (echo) and for prompt logprobs: the log-softmax at every prompt
position, kept only for the requests that ask (`prompt_rows`, `on_prompt_logits`), chunk by chunk as
its prompt is prefilled. With max_tokens 0 nothing is sampled: the request ends once its prompt is scored.
"""

from __future__ import annotations

from runtime.grammar.matcher import Grammar
from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.requests.host import RequestsHost
from runtime.grammar.thinking import ThinkingConstraint, ThinkingStart
from runtime.wire.protocol import Delta, Finished, FromRuntime, GenerateRequest
from runtime.requests.state import ChoiceState, InvalidRequest, RequestState, token_logprob
from runtime.model.sampler import SamplingState, derive_seed, score_tokens
from scheduler.scheduler import ScheduledSequence
from scheduler.sequence import Sequence


class PlainRequests:
    def __init__(self, host: RequestsHost, tokenizer, eos_ids: frozenset[int], device, max_model_len: int) -> None:
        """`host`: the engine, through which every change to a sequence goes (runtime.requests.host)."""
        self.host = host
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.device = device
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self.touched: dict[str, RequestState] = {}
        self.tokens_cached = 0  # prompt tokens the prefix cache served, over every request

    def add(self, request: GenerateRequest, ids: list[int], max_tokens: int, grammar: Grammar | None = None,
            streamed: bool = False, thinking: ThinkingStart | None = None) -> RequestState:
        """`grammar`: what every choice's output (its answer, on a thinking model) must match; `streamed`: its
        KV outgrows the compute pool and streams head-wise (runtime.kv.headwise); `thinking`: how the output
        begins, for a chat request on a model that thinks."""
        params = request.sampling
        if streamed and (params.prompt_logprobs is not None or max_tokens == 0):
            raise InvalidRequest("prompt logprobs and max_tokens 0 are not served for a request whose KV "
                                 "outgrows the compute pool", "prompt_logprobs")
        state = RequestState(request.request_id, params, ids, max_tokens)
        if params.echo:
            state.prompt_text = request.prompt if request.prompt is not None else self.tokenizer.decode(ids)
        if params.prompt_logprobs is not None:
            state.prompt_scores = [None] * len(ids)
        for index in range(params.n):
            constraint = grammar.start() if grammar is not None else None
            if thinking is not None:
                constraint = thinking.constraint(constraint, params.thinking_token_budget)
            sampling = SamplingState(params, derive_seed(params.seed, index), self.device, constraint=constraint)
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
            state.choices.append(ChoiceState(state, index, sampling, detok, self))
        state.choices[0].seq = Sequence(ids, owner=state.choices[0])
        self.requests[state.request_id] = state
        if streamed:
            self.host.stream_sequence(state.choices[0].seq)
        else:
            self.host.add_sequence(state.choices[0].seq)
        return state

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for choice in state.choices:
                if choice.seq is not None and not choice.seq.is_finished:
                    self.host.release_sequence(choice.seq)

    # -- prompt logprobs --------------------------------------------------------------------------
    def prompt_rows(self, scheduled: list[ScheduledSequence]) -> list[tuple[int, int]]:
        """(entry index, count) for each scheduled prompt whose logprobs are asked for: the logits of its
        first `count` new tokens are kept (ModelRunner.execute). Only such requests cost anything.

        Every prompt position must be computed, so a prefix the cache attached past what was scored is
        given back here and the sequence admitted again with no more cached than that (the simplest correct
        choice: such a request recomputes its prompt instead of reusing the cache). The entry keeps its
        token count, so the step stays within its budget, and needs the same number of new blocks."""
        rows = []
        for index, entry in enumerate(scheduled):
            seq = entry.seq
            choice = seq.owner
            if not isinstance(choice, ChoiceState) or not choice.request.is_scoring_prompt:
                continue
            request = choice.request
            if seq.num_computed_tokens > request.num_scored_positions:
                scheduled[index] = entry = self._uncache(entry, request.num_scored_positions)
            start = seq.num_computed_tokens
            count = min(start + entry.num_new_tokens, len(request.prompt_ids) - 1) - start
            if count > 0:
                rows.append((index, count))
        return rows

    def _uncache(self, entry: ScheduledSequence, max_cached_tokens: int) -> ScheduledSequence:
        """Admit `entry`'s sequence again (it was admitted this step) with at most `max_cached_tokens`
        tokens from the prefix cache, undoing the first admission's prefix statistics."""
        is_admitted = self.host.readmit(entry.seq, entry.num_new_tokens, max_cached_tokens)
        assert is_admitted, "the blocks just given back hold the same prompt chunk"
        return ScheduledSequence(entry.seq, entry.num_new_tokens)

    def on_prompt_logits(self, scheduled: list[ScheduledSequence], rows: list[tuple[int, int]], logits) -> None:
        """Score the prompt tokens of `rows` (from `prompt_rows`) with their `logits`, before the step's
        tokens are committed: the logits at position p score the token at p + 1."""
        offset = 0
        for index, count in rows:
            seq = scheduled[index].seq
            request = seq.owner.request
            start = seq.num_computed_tokens
            scores = score_tokens(logits[offset:offset + count], seq.token_ids[start + 1:start + 1 + count],
                                  request.params.prompt_logprobs)
            offset += count
            request.prompt_scores[start + 1:start + 1 + count] = scores
            request.num_scored_positions = max(request.num_scored_positions, start + count)

    # -- sampling ---------------------------------------------------------------------------------
    def on_logits(self, choice: ChoiceState, seq: Sequence) -> list[Sequence]:
        """The first logits of a request fork its other choices, which sample from the same row."""
        request = choice.request
        if request.is_forked:
            return [seq]
        request.is_forked = True
        request.num_cached_tokens = seq.num_cached_tokens
        self.tokens_cached += seq.num_cached_tokens
        if request.max_tokens == 0:  # the prompt alone (echo, prompt logprobs): nothing is sampled
            for other in request.choices:
                other.finish_reason = "length"
            self.host.release_sequence(seq)
            self.touched[request.request_id] = request
            return []
        targets = []
        for other in request.choices[1:]:
            child = Sequence(seq.token_ids, seq.num_prompt_tokens, owner=other)
            self.host.fork_sequence(seq, child, None)
            self.host.resume_sequence(child)  # it holds blocks: it runs, and samples from this row now
            other.seq = child
            targets.append(child)
        return targets + [seq]

    def on_sampled(self, choice: ChoiceState, out) -> None:
        seq = choice.seq
        params = choice.request.params
        choice.pending_token_ids.append(out.token_id)
        if params.logprobs and out.logprob is not None:
            choice.pending_logprobs.append(token_logprob(self.tokenizer, out.token_id, out.logprob, out.top))
        is_stop_token = out.token_id in params.stop_token_ids or (
            out.token_id in self.eos_ids and not params.ignore_eos)
        if not is_stop_token:
            choice.detok.add(out.token_id)
        if is_stop_token or choice.detok.stopped:
            choice.finish_reason = "stop"
        elif seq.num_output_tokens >= choice.request.max_tokens or len(seq) >= self.max_model_len:
            choice.finish_reason = "length"
        if choice.finish_reason is not None:
            self.host.release_sequence(seq)
        self.touched[choice.request.request_id] = choice.request

    def emit(self) -> list[FromRuntime]:
        """This step's new text of every request that sampled, and `Finished` for those done."""
        messages: list[FromRuntime] = []
        touched, self.touched = self.touched, {}
        for request in touched.values():
            if request.request_id not in self.requests:
                continue  # aborted during this step
            for choice in request.choices:
                finished = choice.finish_reason is not None
                if not choice.pending_token_ids and (not finished or choice.has_ended):
                    continue
                text = choice.detok.finish() if finished else choice.detok.flush()
                is_first = not choice.has_started
                messages.append(Delta(
                    request_id=request.request_id, index=choice.index, text=text,
                    token_ids=tuple(choice.pending_token_ids),
                    logprobs=tuple(choice.pending_logprobs) if request.params.logprobs else None,
                    finish_reason=choice.finish_reason,
                    prompt_text=request.prompt_text if is_first else None,
                    prompt_logprobs=request.prompt_logprobs(self.tokenizer) if is_first else None))
                choice.has_started = True
                choice.has_ended = finished
                choice.pending_token_ids.clear()
                choice.pending_logprobs.clear()
            if request.is_finished:
                del self.requests[request.request_id]
                messages.append(Finished(
                    request_id=request.request_id, prompt_tokens=len(request.prompt_ids),
                    cached_tokens=request.num_cached_tokens,
                    completion_tokens=sum(c.num_output_tokens for c in request.choices),
                    reasoning_tokens=_reasoning_tokens(request)))
        return messages


def _reasoning_tokens(request: RequestState) -> int | None:
    """The thinking tokens of every choice, where they are counted (a chat request on a thinking model)."""
    counts = [c.sampling.constraint.num_thinking for c in request.choices
              if isinstance(c.sampling.constraint, ThinkingConstraint)]
    return sum(counts) if counts else None
