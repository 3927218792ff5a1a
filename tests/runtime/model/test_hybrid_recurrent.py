"""Qwen3.5 (Gated DeltaNet layers beside full attention, dense and MoE) served exactly: greedy tokens and
log-probabilities are transformers' own, and a sequence's recurrent state follows it through forks, the
prefix cache, crowds and searches (runtime.model.recurrent, storage.recurrent_state)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.model.recurrent import _initial
from runtime.model.row_padding import InvarianceUnavailable
from runtime.wire.protocol import Delta, Finished, GenerateRequest
from runtime.wire.params import SamplingParams, SearchParams
from storage.recurrent_state import Resume, State
from tests.replicas.hybrid import write_qwen3_next, write_qwen35
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run
from tests.runtime.model.test_replica_generators import prompt_ids
from tests.runtime.search.reference import ReferenceSearch
from tests.runtime.search.test_search_engine import engine_choices, run_search

SHORT = [{"role": "user", "content": "What is 2 + 3?"}]
LONG = [{"role": "user", "content": "Tom has 5 apples and buys 3 more. Janet has 3 ducks and they lay 16 eggs "
                                    "a day. She eats three for breakfast. How many eggs are left?"}]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_next":
        write_qwen3_next(directory)
    else:
        write_qwen35(directory, moe=request.param == "qwen3_5_moe")
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    directory = write_qwen35(tmp_path_factory.mktemp("qwen35_search"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_the_replica_loads_as_transformers_hybrid_model(hybrid):
    _, reference = hybrid
    kinds = reference.config.layer_types
    assert kinds.count("linear_attention") == 3 and kinds.count("full_attention") == 1
    assert type(reference).__name__ in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_decoding_matches_transformers_generate(hybrid, batch_invariant):
    """Short and long prompts (the long one passes many KV blocks and state snapshots) side by side."""
    directory, reference = hybrid
    prompts = [prompt_ids(directory, SHORT), prompt_ids(directory, LONG)]
    assert len(prompts[1]) > 40
    # Qwen3-Next's routed experts: refused, see docs/models.md (Qwen3.5-MoE's run in kernel layers: served)
    if batch_invariant and reference.config.model_type == "qwen3_next":
        with pytest.raises(InvarianceUnavailable, match="routed experts"):
            engine_for(directory, batch_invariant=True)
        batch_invariant = "auto"
    engine = engine_for(directory, batch_invariant=batch_invariant)
    results = run(engine, [request(str(i), p, max_tokens=12) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 12)


def test_a_lost_state_is_recomputed_from_token_0(dense):
    """With no state ever found, each step recomputes its sequence's linear layers from token 0 against
    the KV it has: slower, the same tokens."""
    directory, reference = dense
    prompt = prompt_ids(directory, LONG)
    engine = engine_for(directory)
    states = engine.runner.recurrent.states
    states.resume = lambda seq_id, token_ids, start: Resume(None)
    assert run(engine, [request("r", prompt, max_tokens=8)])["r"]["choices"][0] == hf_greedy(reference, prompt, 8)


def test_a_step_started_from_an_empty_state_decodes_other_tokens(dense):
    """What the tests above guard against: the linear layers run from an empty state at every step (as
    they did with transformers' cache left out) decode other tokens than transformers."""
    directory, reference = dense
    prompt = prompt_ids(directory, LONG)
    engine = engine_for(directory)
    layers = engine.runner.recurrent.layers
    empty = tuple(t for i, layer in enumerate(layers) for t in _initial(layer, i, Resume(None), torch.device("cpu")))
    engine.runner.recurrent.states.resume = lambda seq_id, token_ids, start: Resume(State(start, 0, empty))
    assert run(engine, [request("r", prompt, max_tokens=8)])["r"]["choices"][0] != hf_greedy(reference, prompt, 8)


def test_logprobs_equal_transformers_forward_over_prompt_and_path(hybrid):
    directory, reference = hybrid
    prompt = prompt_ids(directory, LONG)
    engine = engine_for(directory, batch_invariant="auto")
    engine.add_request(request("r", prompt, max_tokens=10, temperature=1.0, seed=3, logprobs=True))
    tokens, logprobs = [], []
    while engine.has_work:
        for m in engine.step():
            if isinstance(m, Delta):
                tokens += m.token_ids
                logprobs += [t.logprob for t in m.logprobs]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected.tolist())


def test_a_prompt_served_twice_resumes_from_the_prefix_cache(dense):
    directory, reference = dense
    prompt = prompt_ids(directory, LONG)
    engine = engine_for(directory)
    states = engine.runner.recurrent.states
    first = run(engine, [request("a", prompt, max_tokens=8)])
    recomputed = states.num_resumed_tokens
    second = run(engine, [request("b", prompt, max_tokens=8)])
    assert second["b"]["finished"].cached_tokens > 0
    assert second["b"]["finished"].cached_tokens == (len(prompt) - 1) // 4 * 4
    assert states.num_resumed_tokens == recomputed  # resumed from the snapshot at the cached prefix's end
    assert first["a"]["choices"][0] == second["b"]["choices"][0] == hf_greedy(reference, prompt, 8)
    states.check_integrity()


def test_a_cached_prefix_without_its_snapshot_is_recomputed_not_guessed(dense):
    directory, reference = dense
    prompt = prompt_ids(directory, LONG)
    engine = engine_for(directory)
    states = engine.runner.recurrent.states
    run(engine, [request("a", prompt, max_tokens=8)])
    states.snapshots.clear()
    states.num_snapshot_bytes = 0
    second = run(engine, [request("b", prompt, max_tokens=8)])
    assert second["b"]["finished"].cached_tokens > 0
    assert states.num_resumed_tokens >= second["b"]["finished"].cached_tokens
    assert second["b"]["choices"][0] == hf_greedy(reference, prompt, 8)


def seeded(request_id, prompt, n=4):
    return request(request_id, prompt, max_tokens=10, temperature=1.0, seed=5, n=n, logprobs=True)


def choices_with_logprobs(engine, requests):
    out: dict[str, dict[int, list]] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for m in engine.step():
            if isinstance(m, Delta) and m.logprobs is not None:
                out.setdefault(m.request_id, {}).setdefault(m.index, []).extend(
                    (t, lp.logprob) for t, lp in zip(m.token_ids, m.logprobs))
        engine.check_integrity()
    return out


def test_seeded_n4_is_the_same_alone_cached_and_in_a_crowd(dense):
    """n = 4 forks the prompt's state four ways; bit for bit the same tokens and log-probabilities."""
    directory, _ = dense
    prompt = prompt_ids(directory, LONG)
    alone = choices_with_logprobs(engine_for(directory), [seeded("x", prompt)])["x"]
    assert len(alone) == 4 and len({tuple(t for t, _ in c) for c in alone.values()}) > 1
    engine = engine_for(directory)
    choices_with_logprobs(engine, [seeded("warm", prompt, n=1)])
    assert choices_with_logprobs(engine, [seeded("x", prompt)])["x"] == alone  # the prompt cached
    crowd = [request(f"c{i}", prompt_ids(directory, SHORT) + [i + 5], max_tokens=6 + i) for i in range(3)]
    assert choices_with_logprobs(engine_for(directory), [crowd[0], seeded("x", prompt), *crowd[1:]])["x"] == alone


QUESTION = "w1 w2 w3"


def search(request_id, strategy, **extra):
    params = dict(strategy=strategy, n=8, beam_width=4, max_steps=4, max_step_tokens=5, verifier="confidence",
                  greedy_anchor=False)
    params.update(extra)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=({"role": "user", "content": QUESTION},),
                           sampling=SamplingParams(max_tokens=30, temperature=1.0, seed=11, n=3),
                           search=SearchParams(**params))


@pytest.mark.parametrize("strategy", ["beam", "dvts"])
def test_search_selects_what_the_reference_over_transformers_selects(dense, strategy):
    """Every child forks its parent's state at its step's end; the reference recomputes each path whole."""
    directory, reference = dense
    engine = engine_for(directory, num_blocks=1024)
    req = search(strategy, strategy)
    ours = engine_choices(run_search(engine, req))
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        list(req.messages), add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    expected = ReferenceSearch(reference, engine.tokenizer, prompt, QUESTION, req.search, 1.0, 11, 30,
                               engine.eos_ids, None).run(3)
    assert [t for t, _, _ in ours] == [t for t, _, _ in expected]
    for (_, score, steps), (_, ref_score, ref_steps) in zip(ours, expected):
        assert score == pytest.approx(ref_score, rel=1e-4, abs=1e-5)
        assert steps == pytest.approx(ref_steps, rel=1e-4, abs=1e-5)


def outcome(messages, request_id):
    texts, finals = {}, {}
    for m in messages:
        if isinstance(m, Delta) and m.request_id == request_id:
            texts[m.index] = texts.get(m.index, ()) + tuple(m.token_ids)
            if m.search is not None:
                finals[m.index] = (m.search.score, tuple(m.search.step_scores), m.search.answer)
        if isinstance(m, Finished) and m.request_id == request_id:
            finals["steps"] = m.search.steps
    return texts, finals


@pytest.mark.parametrize("strategy", ["beam", "dvts"])
def test_search_is_the_same_cached_in_a_crowd_and_with_speculation(dense, strategy):
    directory, _ = dense
    req = search("s", strategy, include_events=False)
    alone = outcome(run_search(engine_for(directory, num_blocks=1024), req), "s")
    speculative = engine_for(directory, num_blocks=1024, speculative_extension=True)
    assert outcome(run_search(speculative, req), "s") == alone
    assert outcome(run_search(speculative, req), "s") == alone  # its prompt cached now
    crowded = engine_for(directory, num_blocks=1024)
    others = [msgspec.structs.replace(req, request_id="t", sampling=msgspec.structs.replace(req.sampling, seed=12)),
              request("p", prompt_ids(directory, LONG), max_tokens=20)]
    for other in others:
        crowded.add_request(other)
    assert outcome(run_search(crowded, req), "s") == alone


def test_a_search_under_memory_pressure_recomputes_states_and_keeps_the_result(dense):
    """Parked paths give up their blocks and states; resumed, each recomputes from a snapshot (or token
    0) against the KV it gets back: the same answers as with room to spare."""
    directory, _ = dense
    req = search("s", "beam", include_events=False, n=8, beam_width=4)
    roomy = engine_for(directory, num_blocks=1024)
    tight = engine_for(directory, num_blocks=16)
    assert outcome(run_search(tight, req), "s") == outcome(run_search(roomy, req), "s")
    assert tight.stats["preemptions"] > 0 and roomy.stats["preemptions"] == 0


def test_the_torch_token_loop_serves_what_the_cpu_kernel_serves(dense, monkeypatch):
    """Where ponder's kernel does not run (a bfloat16 model, a GPU), the same recurrent form runs in torch:
    transformers' greedy tokens, and seeds kept alone and in a crowd."""
    serves_what_the_cpu_kernel_serves(dense, monkeypatch, None)


def serves_what_the_cpu_kernel_serves(dense, monkeypatch, kernel, between=None):
    """An engine whose recurrent layers run `kernel` (None: the torch token loop): transformers' greedy
    tokens, the CPU kernel's seeded tokens (log-probabilities within 1e-4), the same bits alone and in a
    crowd; `between(engine, prompt, greedy)` runs after the greedy request. Returns the engine."""
    import runtime.model.recurrent as recurrent

    directory, reference = dense
    prompt = prompt_ids(directory, LONG)
    cpu = engine_for(directory)
    assert cpu.runner.recurrent.layers[0].forward.args[0].kernel is not None
    kernel_choices = choices_with_logprobs(cpu, [seeded("x", prompt, n=2)])["x"]
    monkeypatch.setattr(recurrent, "_kernel_for", lambda layer: kernel)
    engine = engine_for(directory)
    assert engine.runner.recurrent.layers[0].forward.args[0].kernel is kernel
    greedy = hf_greedy(reference, prompt, 8)
    assert run(engine, [request("g", prompt, max_tokens=8)])["g"]["choices"][0] == greedy
    if between is not None:
        between(engine, prompt, greedy)
    alone = choices_with_logprobs(engine, [seeded("x", prompt, n=2)])["x"]
    crowd = [request(f"c{i}", prompt_ids(directory, SHORT) + [i + 5], max_tokens=6 + i) for i in range(2)]
    assert choices_with_logprobs(engine_for(directory), [crowd[0], seeded("x", prompt, n=2), crowd[1]])["x"] == alone
    for ours, theirs in zip(alone.values(), kernel_choices.values()):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)
    return engine
