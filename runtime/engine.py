"""The engine: requests in, one scheduled model step at a time, wire messages out.

A step reads as three calls: plan (scheduler), execute (runner), update (sampling, stops, output).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.detokenizer import IncrementalDetokenizer
from runtime.model_runner import ModelRunner
from runtime.protocol import Accepted, Delta, Finished, FromRuntime, GenerateRequest, RuntimeStats
from runtime.requests import ChoiceState, InvalidRequest, RequestState, prompt_token_ids, token_logprob
from runtime.sampler import SamplingState, derive_seed, sample
from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache, KVShape


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True


def kv_shape_of(model_config, block_size: int) -> KVShape:
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    return KVShape(text_config.num_hidden_layers, num_kv_heads, head_dim, block_size)


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, model_key: bytes = b"") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_ids = eos_token_ids(model, tokenizer)
        shape = kv_shape_of(model.config, config.block_size)
        self.cache = KVCache(shape, config.num_blocks, next(model.parameters()).dtype, self.device)
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.kv = KVManager(self.pool, extra_key=model_key, enable_prefix_cache=config.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache)
        self.requests: dict[str, RequestState] = {}
        self.stats = {"tokens_prompt": 0, "tokens_cached": 0, "tokens_generated": 0}

    # -- requests -------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, request: GenerateRequest) -> list[FromRuntime]:
        try:
            state = self._make_request(request)
        except InvalidRequest as err:
            return [err.to_message(request.request_id)]
        self.requests[state.request_id] = state
        self.scheduler.add(state.choices[0].seq)
        self.stats["tokens_prompt"] += len(state.prompt_ids)
        return [Accepted(request_id=state.request_id, prompt_tokens=len(state.prompt_ids))]

    def _make_request(self, request: GenerateRequest) -> RequestState:
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id} is already running")
        ids = prompt_token_ids(request, self.tokenizer)
        params = request.sampling
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        room = self.config.max_model_len - len(ids)
        if room <= 0:
            raise InvalidRequest(
                f"this model's maximum context length is {self.config.max_model_len} tokens, and the prompt "
                f"has {len(ids)} tokens", "messages" if request.messages is not None else "prompt",
                code="context_length_exceeded")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidRequest(
                f"this model's maximum context length is {self.config.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and max_tokens is {max_tokens}, {len(ids) + max_tokens} in all",
                "max_tokens", code="context_length_exceeded")
        if self.kv.num_blocks_for(len(ids) + max_tokens) > self.config.num_blocks:
            raise InvalidRequest(
                f"the prompt and max_tokens need {len(ids) + max_tokens} tokens of KV cache, more than the "
                f"{self.config.num_blocks * self.config.block_size} this server holds", "max_tokens")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must lie in [0, {self.vocab_size})", "stop_token_ids")
        if params.top_logprobs > 20:
            raise InvalidRequest("top_logprobs must be at most 20", "top_logprobs")
        state = RequestState(request.request_id, params, ids, max_tokens)
        for index in range(params.n):
            sampling = SamplingState(params, derive_seed(params.seed, index), self.device)
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
            state.choices.append(ChoiceState(state, index, sampling, detok))
        state.choices[0].seq = Sequence(ids, owner=state.choices[0])
        return state

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for choice in state.choices:
            if choice.seq is not None and not choice.seq.is_finished:
                self.scheduler.finish(choice.seq)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[FromRuntime]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampled = [i for i, entry in enumerate(plan.scheduled) if entry.completes_prompt]
        logits = self.runner.execute(plan.scheduled, plan.copies, sampled)
        for entry in plan.scheduled:
            self.kv.commit_computed(entry.seq, entry.seq.num_computed_tokens + entry.num_new_tokens)
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, index in enumerate(sampled):
            seq = plan.scheduled[index].seq
            request = seq.owner.request
            if not request.is_forked:
                request.is_forked = True
                request.num_cached_tokens = seq.num_cached_tokens
                self.stats["tokens_cached"] += seq.num_cached_tokens
                for choice in request.choices[1:]:
                    child = Sequence(seq.token_ids, seq.num_prompt_tokens, owner=choice)
                    self.kv.fork(seq, child)
                    self.scheduler.add_running(child)
                    choice.seq = child
                    rows.append(row)
                    seqs.append(child)
            rows.append(row)
            seqs.append(seq)
        if not seqs:
            return []
        samples = sample(logits[rows], [s.owner.sampling for s in seqs],
                         [(s.token_ids[:s.num_prompt_tokens], s.output_token_ids) for s in seqs])
        touched: dict[str, RequestState] = {}
        for seq, out in zip(seqs, samples):
            self._append(seq, out)
            touched[seq.owner.request.request_id] = seq.owner.request
        return self._emit(touched.values())

    def _append(self, seq: Sequence, out) -> None:
        choice: ChoiceState = seq.owner
        params = choice.request.params
        seq.append_token(out.token_id)
        self.stats["tokens_generated"] += 1
        choice.pending_token_ids.append(out.token_id)
        if out.logprob is not None:
            choice.pending_logprobs.append(token_logprob(self.tokenizer, out.token_id, out.logprob, out.top))
        is_stop_token = out.token_id in params.stop_token_ids or (
            out.token_id in self.eos_ids and not params.ignore_eos)
        if not is_stop_token:
            choice.detok.add(out.token_id)
        if is_stop_token or choice.detok.stopped:
            choice.finish_reason = "stop"
        elif seq.num_output_tokens >= choice.request.max_tokens or len(seq) >= self.config.max_model_len:
            choice.finish_reason = "length"
        if choice.finish_reason is not None:
            self.scheduler.finish(seq)

    def _emit(self, requests) -> list[FromRuntime]:
        messages: list[FromRuntime] = []
        for request in requests:
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

    # -- introspection --------------------------------------------------------------------------
    def runtime_stats(self) -> RuntimeStats:
        pool = self.pool
        tier = "gpu" if self.device.type == "cuda" else "cpu"
        return RuntimeStats(
            requests_running=sum(1 for r in self.requests.values() if r.is_forked),
            requests_waiting=sum(1 for r in self.requests.values() if not r.is_forked),
            kv_blocks={f"{tier}/used": pool.num_used, f"{tier}/cached": pool.num_cached, f"{tier}/free": pool.num_free},
            prefix_query_tokens=self.kv.prefix_stats.query_tokens,
            prefix_hit_tokens=self.kv.prefix_stats.hit_tokens,
            tokens_prompt=self.stats["tokens_prompt"],
            tokens_cached=self.stats["tokens_cached"],
            tokens_generated=self.stats["tokens_generated"],
        )

    def check_integrity(self) -> None:
        holders = [s.block_table for s in self.scheduler.running]
        self.pool.check_integrity(holders)
        for seq in self.scheduler.waiting:
            assert not seq.block_table, "a waiting sequence holds blocks"

