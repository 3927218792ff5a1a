"""While a search with a deadline is live, steps are capped to what the measured rate computes in half
the search's slack; the cap reaches the generator's scheduler and every reward model's store."""

from types import SimpleNamespace

import pytest

from runtime.search.pacing import StepPacer
from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool


def search(timeout_s, finished=False):
    return SimpleNamespace(search=SimpleNamespace(timeout_s=timeout_s), deadline=None if timeout_s is None else 1.0,
                           is_finished=finished)


def test_no_cap_without_a_rate_or_a_deadline():
    pacer = StepPacer(16)
    assert pacer.token_cap([5.0]) is None  # nothing measured yet
    pacer.observe(100, 0.5)
    assert pacer.token_cap([]) is None


def test_the_cap_is_half_the_slack_at_the_measured_rate():
    pacer = StepPacer(16)
    pacer.observe(4, 10.0)  # a step of a few tokens is its fixed cost: not a rate
    assert pacer.seconds_per_token is None
    pacer.observe(100, 0.5)  # 5 ms a token
    assert pacer.token_cap([5.0]) == int((0.05 * 5 + 0.25) / 0.005) == 100
    assert pacer.token_cap([600.0, 2.0]) == int(0.35 / 0.005)  # the nearest budget decides
    pacer.observe(200, 2.0)  # 10 ms a token, smoothed: 0.7 x 5 + 0.3 x 10 ms
    assert pacer.seconds_per_token == pytest.approx(0.0065)
    pacer.observe(1000, 100.0)
    assert pacer.token_cap([1.0]) == 16  # never below the smallest step


def test_pace_caps_the_scheduler_and_stores_for_live_searches_with_deadlines():
    pacer = StepPacer(16)
    pacer.observe(100, 0.5)
    scheduler, store = SimpleNamespace(token_cap=None), SimpleNamespace(pace_cap=None)
    pacer.pace(scheduler, [store], [search(5.0), search(None), search(1.0, finished=True)])
    assert scheduler.token_cap == store.pace_cap == 100
    pacer.pace(scheduler, [store], [search(None), search(1.0, finished=True)])
    assert scheduler.token_cap is None and store.pace_cap is None


def test_the_scheduler_holds_a_step_to_its_token_cap():
    def scheduler(cap):
        s = Scheduler(KVManager(BlockPool(64, 4)), max_num_seqs=8, max_num_batched_tokens=64)
        for _ in range(2):
            s.add(Sequence(list(range(1, 31))))
        s.token_cap = cap
        return s

    assert [e.num_new_tokens for e in scheduler(12).schedule().scheduled] == [12]
    assert [e.num_new_tokens for e in scheduler(None).schedule().scheduled] == [30, 30]
    assert [e.num_new_tokens for e in scheduler(500).schedule().scheduled] == [30, 30]  # never above the maximum
