"""Plain (non-search) requests in the engine: their choices fork from the first logits, each sampled
token goes through stops and detokenization, and every step's new text leaves as `Delta`s."""

from __future__ import annotations

from runtime.detokenizer import IncrementalDetokenizer
from runtime.protocol import Delta, Finished, FromRuntime, GenerateRequest
from runtime.requests import ChoiceState, RequestState, token_logprob
from runtime.sampler import SamplingState, derive_seed
from scheduler.sequence import Sequence


class PlainRequests:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.requests: dict[str, RequestState] = {}
        self.touched: dict[str, RequestState] = {}

    def add(self, request: GenerateRequest, ids: list[int], max_tokens: int, streamed: bool = False) -> RequestState:
        """`streamed`: its KV outgrows the compute pool and streams head-wise (runtime.streamed)."""
        params = request.sampling
        state = RequestState(request.request_id, params, ids, max_tokens)
        for index in range(params.n):
            sampling = SamplingState(params, derive_seed(params.seed, index), self.engine.device)
            detok = IncrementalDetokenizer(self.engine.tokenizer, params.stop, params.include_stop_str_in_output)
            state.choices.append(ChoiceState(state, index, sampling, detok))
        state.choices[0].seq = Sequence(ids, owner=state.choices[0])
        self.requests[state.request_id] = state
        if streamed:
            self.engine.streamed.add(state.choices[0].seq)
        else:
            self.engine.scheduler.add(state.choices[0].seq)
        return state

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for choice in state.choices:
                if choice.seq is not None and not choice.seq.is_finished:
                    self.engine.scheduler.finish(choice.seq)

    def on_logits(self, choice: ChoiceState, seq: Sequence) -> list[Sequence]:
        """The first logits of a request fork its other choices, which sample from the same row."""
        request = choice.request
        if request.is_forked:
            return [seq]
        request.is_forked = True
        request.num_cached_tokens = seq.num_cached_tokens
        engine = self.engine
        engine.stats["tokens_cached"] += seq.num_cached_tokens
        targets = []
        for other in request.choices[1:]:
            child = Sequence(seq.token_ids, seq.num_prompt_tokens, owner=other)
            engine.kv.fork(seq, child)
            engine.scheduler.add_running(child)
            other.seq = child
            targets.append(child)
        return targets + [seq]

    def on_sampled(self, choice: ChoiceState, out) -> None:
        engine = self.engine
        seq = choice.seq
        params = choice.request.params
        choice.pending_token_ids.append(out.token_id)
        if params.logprobs and out.logprob is not None:
            choice.pending_logprobs.append(token_logprob(engine.tokenizer, out.token_id, out.logprob, out.top))
        is_stop_token = out.token_id in params.stop_token_ids or (
            out.token_id in engine.eos_ids and not params.ignore_eos)
        if not is_stop_token:
            choice.detok.add(out.token_id)
        if is_stop_token or choice.detok.stopped:
            choice.finish_reason = "stop"
        elif seq.num_output_tokens >= choice.request.max_tokens or len(seq) >= engine.config.max_model_len:
            choice.finish_reason = "length"
        if choice.finish_reason is not None:
            engine.scheduler.finish(seq)
        self.touched[choice.request.request_id] = choice.request

    def emit(self) -> list[FromRuntime]:
        """This step's new text of every request that sampled, and `Finished` for those done."""
        messages: list[FromRuntime] = []
        touched, self.touched = self.touched, {}
        for request in touched.values():
            if request.request_id not in self.requests:
                continue  # aborted during this step
            for choice in request.choices:
                if not choice.pending_token_ids:
                    continue
                finished = choice.finish_reason is not None
                text = choice.detok.finish() if finished else choice.detok.flush()
                messages.append(Delta(
                    request_id=request.request_id, index=choice.index, text=text,
                    token_ids=tuple(choice.pending_token_ids),
                    logprobs=tuple(choice.pending_logprobs) if request.params.logprobs else None,
                    finish_reason=choice.finish_reason))
                choice.pending_token_ids.clear()
                choice.pending_logprobs.clear()
            if request.is_finished:
                del self.requests[request.request_id]
                messages.append(Finished(
                    request_id=request.request_id, prompt_tokens=len(request.prompt_ids),
                    cached_tokens=request.num_cached_tokens,
                    completion_tokens=sum(c.num_output_tokens for c in request.choices)))
        return messages
