"""The tokens and scores of a search do not depend on the policy, the budget or the tiers.

The workload forks at unaligned positions (a 6-token step over 4-token blocks), so partially
filled blocks are shared and copied on write too.
"""

import pytest

from runtime.offload import POLICIES

from .helpers import all_resident, run, spec


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_and_budget_gives_the_tokens_of_an_all_resident_run(model, tmp_path, policy):
    search = spec()
    reference = all_resident(model, search)
    assert reference.bytes_in == 0 and reference.bytes_out == 0
    assert len(reference.tokens) == 8 and all(len(t) == 1 + 6 * 4 for t in reference.tokens)
    # budget 12: host tier only; budget 20: no host tier, every block below compute on disk
    for budget, host_bytes, disk_dir in ((12, 1 << 22, None), (20, 0, tmp_path)):
        report = run(model, search, policy, budget, host_bytes=host_bytes, disk_dir=disk_dir)
        assert report.tokens == reference.tokens, (policy, budget)
        # Group sizes change the row count of the model's matmuls, which may change the last
        # bits of a logit; the attention itself is exact.
        assert report.scores == pytest.approx(reference.scores, abs=1e-4)
        assert report.bytes_in > 0, "the budget did not force anything out of the compute tier"
        tiers = {pair.split("/")[0] for pair, n in report.bytes_moved.items()
                 if n and pair.endswith("/compute")}
        assert tiers == ({"host"} if disk_dir is None else {"disk"})


def test_the_layerwise_baseline_reads_offloaded_layers_only_from_its_reloads(model):
    search = spec()
    reference = all_resident(model, search)
    report = run(model, search, "token", 8)
    assert report.resident_layers == (0, 0, 0, 0)  # no layer of a full block stays in compute
    assert report.tokens == reference.tokens


def test_the_seed_changes_the_tokens(model):
    assert all_resident(model, spec(seed=3)).tokens != all_resident(model, spec(seed=4)).tokens
