"""Build a small search and run it offloaded."""

from __future__ import annotations

from runtime.offload import RunReport, SearchSpec, TierSpec, run_offloaded

PROMPT = (5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 6, 10, 14, 18, 22)
BLOCK_SIZE = 4


def spec(**overrides) -> SearchSpec:
    fields = dict(prompt_ids=PROMPT, num_beams=8, beam_width=2, step_tokens=6, num_steps=4, seed=3)
    fields.update(overrides)
    return SearchSpec(**fields)


def run(model, search: SearchSpec, policy: str, budget: int, *, host_bytes: int = 1 << 22,
        disk_dir=None) -> RunReport:
    """With `disk_dir`, a disk tier of 64 MiB below the host tier (or alone, with host_bytes=0)."""
    tiers = TierSpec(budget_blocks=budget, block_size=BLOCK_SIZE, host_bytes=host_bytes,
                     disk_dir=None if disk_dir is None else str(disk_dir),
                     disk_bytes=0 if disk_dir is None else 1 << 26)
    return run_offloaded(model, search, tiers, policy, check=True)


def all_resident(model, search: SearchSpec) -> RunReport:
    """Every block of the search fits in the compute tier: nothing moves."""
    return run(model, search, "lbs", search.num_logical_blocks(BLOCK_SIZE), host_bytes=0)
