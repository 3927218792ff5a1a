import pytest

from scheduler.grouping import (Beam, BeamGroup, RoundPlan, balanced_sizes, greedy_groups,
                                group_beams, order_groups, prefetch_blocks, round_plan)
from storage.block_hash import hash_blocks


def ids(groups):
    return [list(g.beam_ids) for g in groups]


def two_subtrees():
    """Six beams after a step: all share the prompt blocks p0 p1; beams 0, 2, 4 then share `b`,
    beams 1, 3, 5 share `a`; the last block of each is its own."""
    return [Beam(i, ("p0", "p1", "b" if i % 2 == 0 else "a", f"own{i}")) for i in range(6)]


def test_round_plan_is_budget_over_the_largest_beam():
    assert round_plan(16, 1, 7) == RoundPlan(max_beams_per_round=7, num_rounds=3)
    assert round_plan(12, 6, 40) == RoundPlan(6, 2)  # the paper's 4 GB / 0.6 GB example
    assert round_plan(5, 2, 100) == RoundPlan(5, 1)
    assert round_plan(4, 0, 0) == RoundPlan(4, 1)
    assert round_plan(0, 0, 10) == RoundPlan(0, 0)
    assert round_plan(3, 11, 10) is None


def test_balanced_sizes_put_the_larger_rounds_last():
    assert balanced_sizes(16, 3) == (5, 5, 6)
    assert balanced_sizes(12, 2) == (6, 6)
    assert balanced_sizes(7, 3) == (2, 2, 3)
    assert balanced_sizes(5, 1) == (5,)
    assert balanced_sizes(0, 0) == ()


def test_sixteen_beams_capacity_seven_run_as_five_five_six():
    beams = [Beam(i, (f"blk{i}",)) for i in range(16)]
    for share_prefix in (True, False):
        groups = group_beams(beams, 7, share_prefix=share_prefix)
        assert ids(groups) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]
        assert [g.num_blocks for g in groups] == [5, 5, 6]


def test_shared_blocks_are_charged_once_so_all_beams_fit_in_one_round():
    groups = group_beams(two_subtrees(), 12)
    # Seed beam 0, then the `b` beams (3 shared blocks each), then the `a` beams.
    assert groups == (BeamGroup((0, 2, 4, 1, 3, 5),
                                ("p0", "p1", "b", "own0", "own2", "own4", "a", "own1", "own3",
                                 "own5"),
                                10),)


def test_no_prefix_ablation_charges_every_beam_in_full_and_keeps_input_order():
    groups = group_beams(two_subtrees(), 12, share_prefix=False)
    assert ids(groups) == [[0, 1, 2], [3, 4, 5]]
    assert [g.num_blocks for g in groups] == [12, 12]
    assert groups[0].block_ids == ("p0", "p1", "b", "own0", "a", "own1", "own2")


def test_algorithm_one_groups_subtrees_and_balances_rounds():
    # Packing to 8 blocks needs 2 rounds ([0, 2, 4, 1] then [3, 5]); balanced they are 3 + 3.
    assert ids(greedy_groups(two_subtrees(), 8)) == [[0, 2, 4, 1], [3, 5]]
    groups = group_beams(two_subtrees(), 8)
    assert groups == (BeamGroup((0, 2, 4), ("p0", "p1", "b", "own0", "own2", "own4"), 6),
                      BeamGroup((1, 3, 5), ("p0", "p1", "a", "own1", "own3", "own5"), 6))
    # Ignoring sharing, 8 // 4 = 2 beams per round: three rounds of 8 blocks.
    no_prefix = group_beams(two_subtrees(), 8, share_prefix=False)
    assert ids(no_prefix) == [[0, 1], [2, 3], [4, 5]]
    assert [g.num_blocks for g in no_prefix] == [8, 8, 8]


def test_a_beam_that_does_not_fit_is_passed_over_for_one_that_does():
    beams = [Beam(0, ("a", "b", "c")), Beam(1, ("a", "d", "e", "f")), Beam(2, ("g", "h"))]
    # Beam 1 shares `a` but would need 3 more blocks (6 > 5); beam 2 needs 2 (5 <= 5).
    assert ids(greedy_groups(beams, 5)) == [[0, 2], [1]]
    # Balanced sizes (1, 2) cannot hold beams 1 and 2 together (6 blocks): the packing is kept.
    assert greedy_groups(beams, 5, balanced_sizes(3, 2)) is None
    assert ids(group_beams(beams, 5)) == [[0, 2], [1]]


def test_sharing_needs_fewer_rounds_than_the_per_beam_rule():
    beams = [Beam(0, ("p", "q", "x")), Beam(1, ("p", "q", "y")), Beam(2, ("p", "q", "z")),
             Beam(3, ("u", "v", "w"))]
    assert round_plan(4, 3, 5).num_rounds == 4
    groups = group_beams(beams, 5)
    assert ids(groups) == [[0, 1, 2], [3]]
    assert [g.num_blocks for g in groups] == [5, 3]


def test_new_blocks_are_charged_per_beam():
    beams = [Beam(0, ("a", "b"), num_new_blocks=1), Beam(1, ("a", "b"), num_new_blocks=1)]
    assert group_beams(beams, 4) == (BeamGroup((0, 1), ("a", "b"), 4),)
    assert group_beams(beams, 3) == (BeamGroup((0,), ("a", "b"), 3), BeamGroup((1,), ("a", "b"), 3))
    assert group_beams(beams, 2) is None
    assert group_beams(beams, 2, share_prefix=False) is None


def test_next_group_is_seeded_from_the_previous_groups_blocks():
    # Beam 3 shares nothing with beam 0 but two blocks with group 0's beam 1.
    beams = [Beam(0, ("a", "b")), Beam(1, ("a", "c", "d")), Beam(2, ("x", "y")),
             Beam(3, ("c", "d", "z"))]
    assert ids(greedy_groups(beams, 4)) == [[0, 1], [3], [2]]


def test_block_hashes_work_as_block_ids():
    prompt = list(range(8))  # two shared blocks of 4 tokens, then one block of each beam's own
    chains = [hash_blocks(prompt + [100 + i] * 4, block_size=4) for i in range(4)]
    beams = [Beam(i, chain) for i, chain in enumerate(chains)]
    own = [c[2] for c in chains]
    assert group_beams(beams, 6) == (BeamGroup((0, 1, 2, 3), (*chains[0], *own[1:]), 6),)
    assert group_beams(beams, 5) == (BeamGroup((0, 1), (*chains[0], chains[1][2]), 4),
                                     BeamGroup((2, 3), (*chains[2], chains[3][2]), 4))


def test_empty_and_invalid_input():
    assert group_beams([], 4) == ()
    assert group_beams([], 4, share_prefix=False) == ()
    with pytest.raises(ValueError):
        group_beams([Beam(0, ("a",)), Beam(0, ("b",))], 4)
    with pytest.raises(ValueError):
        Beam(0, ("a",), num_new_blocks=-1)


def test_order_groups_puts_neighbours_that_share_next_to_each_other():
    g0 = BeamGroup((0,), ("a", "b"), 2)
    g1 = BeamGroup((1,), ("x", "y"), 2)
    g2 = BeamGroup((2,), ("a", "c"), 2)
    assert order_groups([g0, g1, g2]) == (g0, g2, g1)
    assert order_groups([g0, g1, g2], resident=["y"]) == (g1, g0, g2)
    assert order_groups([]) == ()


def test_prefetch_takes_the_next_groups_missing_blocks_that_fit_the_headroom():
    current, following = group_beams(two_subtrees(), 8)
    assert prefetch_blocks(current, following, 8) == ("a", "own1")
    assert prefetch_blocks(current, following, 6) == ()
    assert prefetch_blocks(current, following, 100) == ("a", "own1", "own3", "own5")


def test_a_cap_on_beams_per_group_adds_balanced_rounds():
    # Everything fits in 12 blocks, but at most 2 sequences may run at once: 3 rounds of 2,
    # each a subtree's pair where it can be.
    groups = group_beams(two_subtrees(), 12, max_beams=2)
    assert ids(groups) == [[0, 2], [4, 1], [3, 5]]
    assert [g.num_blocks for g in groups] == [5, 6, 5]
    no_prefix = group_beams(two_subtrees(), 12, share_prefix=False, max_beams=2)
    assert ids(no_prefix) == [[0, 1], [2, 3], [4, 5]]
    assert ids(group_beams(two_subtrees(), 12, max_beams=4)) == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(ValueError):
        group_beams(two_subtrees(), 12, max_beams=0)
