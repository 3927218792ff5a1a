"""Tiered KV execution of step-wise beam search: a compute tier of limited size over host and disk
tiers, under the layer-wise baseline (`token`) or locality-aware beam scheduling (`lbs`,
`lbs_no_prefix`). See `executor.run_offloaded`."""

from runtime.offload.executor import POLICIES, RunReport, TierSpec, run_offloaded
from runtime.offload.search import SearchSpec

__all__ = ["POLICIES", "RunReport", "SearchSpec", "TierSpec", "run_offloaded"]
