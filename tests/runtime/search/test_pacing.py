"""While a search with a deadline is live, steps are capped to what the measured rate computes in half
the search's slack; the generator's scheduler holds a step to the cap it is given."""

from types import SimpleNamespace

import pytest

from runtime.search.pacing import StepPacer
from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool


def search(timeout_s, finished=False):
    return SimpleNamespace(search=SimpleNamespace(timeout_s=timeout_s), is_finished=finished)


def test_no_cap_without_a_rate_or_a_deadline():
    pacer = StepPacer(16)
    assert pacer.token_cap([search(5.0)]) is None  # nothing measured yet
    pacer.observe(100, 0.5)
    assert pacer.token_cap([]) is None


def test_the_cap_is_half_the_slack_at_the_measured_rate():
    pacer = StepPacer(16)
    pacer.observe(4, 10.0)  # a step of a few tokens is its fixed cost: not a rate
    assert pacer.seconds_per_token is None
    pacer.observe(100, 0.5)  # 5 ms a token
    assert pacer.token_cap([search(5.0)]) == int((0.05 * 5 + 0.25) / 0.005) == 100
    assert pacer.token_cap([search(600.0), search(2.0)]) == int(0.35 / 0.005)  # the nearest budget decides
    pacer.observe(200, 2.0)  # 10 ms a token, smoothed: 0.7 x 5 + 0.3 x 10 ms
    assert pacer.seconds_per_token == pytest.approx(0.0065)
    pacer.observe(1000, 100.0)
    assert pacer.token_cap([search(1.0)]) == 16  # never below the smallest step


def test_only_live_searches_with_deadlines_cap_a_step():
    pacer = StepPacer(16)
    pacer.observe(100, 0.5)
    assert pacer.token_cap([search(5.0), search(None), search(1.0, finished=True)]) == 100
    assert pacer.token_cap([search(None), search(1.0, finished=True)]) is None


def test_the_scheduler_holds_a_step_to_its_token_cap():
    def scheduled(cap):
        s = Scheduler(KVManager(BlockPool(64, 4)), max_num_seqs=8, max_num_batched_tokens=64)
        for _ in range(2):
            s.add(Sequence(list(range(1, 31))))
        return [e.num_new_tokens for e in s.schedule(cap).scheduled]

    assert scheduled(12) == [12]
    assert scheduled(None) == [30, 30]
    assert scheduled(500) == [30, 30]  # never above the maximum
