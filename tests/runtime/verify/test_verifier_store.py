"""Reward models scored from their own paged store match the plain transformers adapters."""

import pytest
from transformers import AutoModelForCausalLM

from runtime.bootstrap import build_engine
from runtime.wire.options import RuntimeOptions
from runtime.verify.verifiers.registry import load_verifier
from tests.runtime.search.reference import ReferenceSearch
from tests.runtime.search.test_search_engine import QUESTION, engine_choices, run_search, search_request


@pytest.fixture(scope="module")
def engine(tiny_llama, causal_lm_dir, qwen_prm_dir, skywork_dir):
    verifiers = {"shepherd": {"kind": "math-shepherd", "path": str(causal_lm_dir)},
                 "qwen": {"kind": "qwen-prm", "path": str(qwen_prm_dir)},
                 "sky": {"kind": "skywork", "path": str(skywork_dir)}}
    engine, _ = build_engine(RuntimeOptions(model=str(tiny_llama), device="cpu", num_blocks=1024, block_size=4,
                                            batch_invariant=True, speculative_extension=True,
                                            verifiers=verifiers, verifier_kv_memory_bytes=4 << 20))
    return engine


def assert_matches_reference(engine, tiny_llama, plain, search, messages):
    """The engine chose what the plain reference over transformers chooses, with its scores."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        list(search.messages), add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    reference = ReferenceSearch(hf, engine.tokenizer, prompt_ids, QUESTION, search.search, 1.0, 11, 30,
                                engine.eos_ids, plain).run(3)
    ours = engine_choices(messages)
    assert [t for t, _, _ in ours] == [t for t, _, _ in reference]
    for (_, score, steps), (_, ref_score, ref_steps) in zip(ours, reference):
        assert score == pytest.approx(ref_score, rel=1e-4, abs=1e-5)
        assert steps == pytest.approx(ref_steps, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("name, kind, directory", [
    ("shepherd", "math-shepherd", "causal_lm_dir"), ("qwen", "qwen-prm", "qwen_prm_dir"),
    ("sky", "skywork", "skywork_dir")])
def test_paged_reward_model_search_matches_the_reference(engine, tiny_llama, request, name, kind, directory):
    # The reference is the strategies alone: no greedy anchor (tests/runtime/search/test_search_anchor.py).
    search = search_request(f"prm-{name}", verifier=name, n=4, beam_width=2, max_steps=4, greedy_anchor=False)
    messages = run_search(engine, search)
    assert_matches_reference(engine, tiny_llama, load_verifier(kind, request.getfixturevalue(directory)), search,
                             messages)
    summary = messages[-1].search
    # Step k's input extends step k-1's: later calls find the problem and earlier steps cached.
    assert summary.prefix_hit_tokens > 0 and summary.verifier_tokens_prefilled > 0
    store = engine.scorers[name]
    assert store.pool.num_used == 0
    store.pool.check_integrity([])
    engine.pool.check_integrity([])


@pytest.mark.parametrize("name, kind, directory", [
    ("shepherd", "math-shepherd", "causal_lm_dir"), ("qwen", "qwen-prm", "qwen_prm_dir"),
    ("sky", "skywork", "skywork_dir")])
def test_lookahead_verification_scores_speculated_steps_once_and_changes_nothing(engine, tiny_llama, request,
                                                                                 monkeypatch, name, kind,
                                                                                 directory):
    # "w1" ends steps often and unevenly, so paths done early speculate whole next steps.
    search = search_request(f"ahead-{name}", verifier=name, n=8, beam_width=4, max_steps=4, step_delimiter="w1",
                            max_step_tokens=8, greedy_anchor=False)
    finished = []
    monkeypatch.setattr(engine, "search_finished",
                        lambda controller, done=engine.search_finished: (finished.append(controller), done(controller)))
    messages = run_search(engine, search)
    assert_matches_reference(engine, tiny_llama, load_verifier(kind, request.getfixturevalue(directory)), search,
                             messages)
    (controller,) = finished
    store = engine.scorers[name]
    assert controller.spec_tokens["used"] > 0 and store.scores_ahead > 0
    # Scores read ahead are used only when the path goes on to that step (here, for the first family).
    assert controller.verification.scores_ahead <= store.scores_ahead
    if name == "shepherd":
        assert controller.verification.scores_ahead > 0
    assert engine.scorers[name].pool.num_used == 0
