"""Where a request with a grammar waits while it compiles: off the engine's step loop, so a heavy
schema never stalls the other requests' tokens. A grammar compiled before is found in the cache and
the request is admitted at once; one that does not compile is a 400 naming its field."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from runtime.grammar.compiler import GrammarCompiler, GrammarError
from runtime.grammar.matcher import Grammar
from runtime.grammar.tools import tool_format_of
from runtime.requests.state import InvalidRequest
from runtime.wire.protocol import FromRuntime, GenerateRequest

IDLE_WAIT_S = 0.01  # with nothing else to run, how long a step waits for a compilation to finish


class GrammarGate:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int],
                 admit: Callable[[GenerateRequest, Grammar | None], list[FromRuntime]]) -> None:
        """`admit(request, grammar)`: the engine's admission, answering Accepted or the request's error."""
        self.tool_format, _ = tool_format_of(getattr(tokenizer, "chat_template", None))
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_ids, self.tool_format)
        self.admit = admit
        self.compiling: dict[str, tuple[GenerateRequest, str, Future]] = {}  # request id -> (it, grammar, compiling)
        self.admitted: list[FromRuntime] = []  # Accepted (or the 400) of the held requests `poll` let in

    @property
    def has_work(self) -> bool:
        return bool(self.compiling)

    def add(self, request: GenerateRequest) -> list[FromRuntime]:
        """Admit `request` now, or hold it until its grammar is compiled (then `poll` answers for it)."""
        if request.constraint is None and request.tools is None:
            return self.admit(request, None)
        try:
            text, param = self.grammars.key(request.constraint, request.tools)
        except GrammarError as err:
            return [InvalidRequest(str(err), err.param).to_message(request.request_id)]
        compiled = self.grammars.get(text)
        if compiled is not None:
            return self.admit(request, Grammar(compiled, self.grammars.num_words))
        self.compiling[request.request_id] = (request, text, self.grammars.submit(text, param))
        return []

    def poll(self, is_idle: bool) -> None:
        """Admit the held requests whose grammar is compiled (`take_admitted` hands out their answers);
        `is_idle`: nothing else would run this step, so wait a little for one."""
        if not self.compiling:
            return
        if is_idle:
            wait([future for _, _, future in self.compiling.values()], timeout=IDLE_WAIT_S,
                 return_when=FIRST_COMPLETED)
        out = self.admitted
        for request_id, (request, text, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                compiled = self.grammars.store(text, future)
            except GrammarError as err:
                out.append(InvalidRequest(str(err), err.param).to_message(request_id))
                continue
            out += self.admit(request, Grammar(compiled, self.grammars.num_words))

    def take_admitted(self) -> list[FromRuntime]:
        admitted, self.admitted = self.admitted, []
        return admitted

    def abort(self, request_id: str) -> None:
        self.compiling.pop(request_id, None)

    def close(self) -> None:
        self.grammars.close()
