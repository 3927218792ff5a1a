"""Groups stay within the compute-tier budget; the next group's blocks are prefetched."""

import pytest

from runtime.offload.layerwise import resident_layers

from .helpers import run, spec


@pytest.mark.parametrize("policy", ["lbs", "lbs_no_prefix"])
def test_groups_and_residency_stay_within_the_budget(model, policy):
    budget = 14
    report = run(model, spec(), policy, budget)
    assert max(report.groups_per_step) > 1, "the budget never split the beams"
    for sizes, blocks in zip(report.group_sizes, report.group_blocks):
        assert sum(sizes) == 8
        assert all(b <= budget for b in blocks)
    assert report.max_resident_blocks <= budget


def test_the_ablation_balances_its_rounds(model):
    report = run(model, spec(), "lbs_no_prefix", 14)
    # Beams need 7, 8, 10 and 11 blocks over the steps: 2, 1, 1 and 1 per round of 14 blocks.
    assert report.group_sizes == ((2, 2, 2, 2), (1,) * 8, (1,) * 8, (1,) * 8)


def test_a_beam_larger_than_the_budget_is_refused(model):
    with pytest.raises(MemoryError):
        run(model, spec(), "lbs", 10)  # the last step's beams need 11 blocks


def test_lbs_prefetches_the_next_group_into_the_headroom(model):
    report = run(model, spec(), "lbs", 16)
    assert 0 < report.bytes_prefetched <= report.bytes_in
    assert report.stall_seconds < report.seconds


def test_eq1_keeps_the_layers_that_fit():
    assert resident_layers(30, 96, 128) == 22  # floor(96 * 30 / 128)
    assert resident_layers(30, 96, 400) == 7
    assert resident_layers(30, 96, 96) == 30
    assert resident_layers(2, 1, 100) == 0
