"""A search's tokens and scores do not depend on how its paths are scheduled: the policy, the
compute budget, speculative extension or the tier a block came back from."""

import pytest
import torch

from runtime.wire.options import RuntimeOptions
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import engine_choices, run_search, search_request

# A delimiter the tiny model writes often, so steps end at different tokens and stragglers leave
# idle slots for speculation.
SEARCH = dict(n=8, beam_width=4, max_steps=4, step_delimiter="w1", max_step_tokens=8)


def traced_run(engine, request):
    """Run to the end, recording the most sequences running at once."""
    out = engine.add_request(request)
    messages, most = [], 0
    while engine.has_work:
        messages += engine.step()
        most = max(most, len(engine.scheduler.running))
        engine.check_integrity()
    return messages, most


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """Everything resident, every path advancing together, no speculation."""
    engine = engine_for(tiny_llama, num_blocks=1024, scheduler_policy="token", speculative_extension=False)
    return engine_choices(run_search(engine, search_request("baseline", **SEARCH)))


def same(got, expected):
    """The same texts and the same scores, to the bit."""
    assert got == expected


@pytest.mark.parametrize("policy", ["lbs", "lbs_no_prefix", "token"])
@pytest.mark.parametrize("num_blocks", [1024, 24])
@pytest.mark.parametrize("speculative", [False, True])
def test_every_policy_budget_and_speculation_gives_the_same_search(tiny_llama, expected, policy, num_blocks,
                                                                    speculative):
    engine = engine_for(tiny_llama, num_blocks=num_blocks, scheduler_policy=policy,
                        speculative_extension=speculative)
    same(engine_choices(run_search(engine, search_request("run", **SEARCH))), expected)
    assert engine.pool.num_used == 0
    spec = engine.stats["speculative_tokens"]
    assert (sum(spec.values()) > 0) == speculative


@pytest.mark.parametrize("policy, num_blocks", [("lbs", 1024), ("lbs", 24), ("token", 24)])
def test_a_judged_search_is_the_same_under_every_policy_and_budget(tiny_llama, policy, num_blocks):
    # The judge's questions are kept parked between verifications and forked from; a tight pool
    # takes their blocks back, and their forks then come from the prefix cache instead.
    judged = dict(SEARCH, verifier="judge")
    baseline = engine_for(tiny_llama, num_blocks=1024, scheduler_policy="token", speculative_extension=False)
    expected = engine_choices(run_search(baseline, search_request("judged", **judged)))
    engine = engine_for(tiny_llama, num_blocks=num_blocks, scheduler_policy=policy)
    same(engine_choices(run_search(engine, search_request("judged", **judged))), expected)
    assert engine.pool.num_used == 0 and engine.scoring == {}


def test_lbs_runs_a_tight_step_in_groups_that_fit_and_never_preempts(tiny_llama, expected):
    # 24 blocks of 4 tokens cannot hold 8 paths growing 8 tokens each: the step runs in groups,
    # each small enough to finish its step without taking a running path's blocks.
    engine = engine_for(tiny_llama, num_blocks=24, scheduler_policy="lbs", speculative_extension=False)
    messages, most = traced_run(engine, search_request("groups", **SEARCH))
    same(engine_choices(messages), expected)
    steps = messages[-1].search.steps
    assert engine.planner.num_groups > steps  # some steps needed more than one group
    assert most < 8
    token = engine_for(tiny_llama, num_blocks=24, scheduler_policy="token", speculative_extension=False)
    messages, most = traced_run(token, search_request("together", **SEARCH))
    same(engine_choices(messages), expected)
    assert token.planner.num_groups == messages[-1].search.steps and most == 8 + 1  # the paths and the greedy anchor


def test_a_group_is_capped_by_the_batch_size(tiny_llama, expected):
    engine = engine_for(tiny_llama, num_blocks=1024, max_num_seqs=3, speculative_extension=False)
    messages, most = traced_run(engine, search_request("capped", **SEARCH))
    same(engine_choices(messages), expected)
    assert most <= 3


def test_speculative_tokens_are_kept_by_surviving_paths(tiny_llama, expected):
    engine = engine_for(tiny_llama, num_blocks=1024, speculative_extension=True)
    same(engine_choices(run_search(engine, search_request("spec", **SEARCH))), expected)
    spec = engine.stats["speculative_tokens"]
    assert spec["used"] > 0 and spec["discarded"] > 0
    assert engine.runtime_stats().speculative_tokens == spec


def test_blocks_brought_back_from_the_host_tier_give_the_same_search(tiny_llama, expected):
    # 16 blocks: parked paths give their blocks up, evicted blocks go to the host tier and the
    # ones a later step needs come back from there.
    engine = engine_for(tiny_llama, num_blocks=16, host_kv_memory_bytes=4 << 20)
    same(engine_choices(run_search(engine, search_request("host", **SEARCH))), expected)
    moved = engine.residency.chain.bytes_moved
    block_bytes = engine.cache.shape.bytes_per_block(engine.cache.dtype)
    assert engine.residency.num_promoted > 0 and moved["host/cpu"] == engine.residency.num_promoted * block_bytes


def test_an_unknown_policy_is_refused_at_start(tiny_llama):
    with pytest.raises(ValueError, match="scheduler policy"):
        engine_for(tiny_llama, scheduler_policy="fastest")
    assert RuntimeOptions().scheduler_policy == "lbs"


def test_speculation_is_decided_by_the_step_cost_by_default(tiny_llama, expected):
    from runtime.bootstrap import speculates

    assert [speculates(setting, torch.device(device)) for setting in ("auto", True, False)
            for device in ("cpu", "cuda")] == ["auto", "auto", True, True, False, False]
    engine = engine_for(tiny_llama, num_blocks=1024)
    assert engine.config.speculative_extension == "auto"
    assert engine.speculative_row_cap(0) == 0  # nothing measured yet: no speculative rows
    same(engine_choices(run_search(engine, search_request("auto", **SEARCH))), expected)
    # The search's decode steps, of several batch sizes, fitted the model: it now decides.
    assert engine.step_cost.fit() is not None and engine.speculation_pays is not None
