"""`ponder bench router`'s workload and report, without servers (tests/deploy/test_router.py runs the
router itself)."""

from __future__ import annotations

from bench.router import SETTINGS, Workload, table
from server.cli import build_parser


def test_registered_in_the_bench_cli():
    args = build_parser().parse_args(["bench", "router", "--requests", "4"])
    assert (args.name, args.args) == ("router", ["--requests", "4"])


def test_prompts_share_few_shot_prefixes_of_their_own_per_setting():
    work = Workload(prefixes=3, prefix_words=20, question_words=4, requests=30, seed=7)
    prompts = work.prompts(0)
    assert prompts == work.prompts(0) and len(prompts) == 30
    prefixes = {" ".join(p.split()[:20]) for p in prompts}
    assert len(prefixes) == 3  # every request opens with one of the three prefixes
    assert all(len(p.split()) == 24 for p in prompts)
    other = {" ".join(p.split()[:20]) for p in work.prompts(1)}
    assert not prefixes & other, "a setting never finds another's prefixes in the caches"


def test_table_shows_every_setting():
    rows = [{"setting": name, "replicas": count, "policy": policy, "requests": 4, "errors": [], "wall_s": 2.0,
             "requests_per_s": 2.0, "tokens_per_s": 16.0, "latency_p50_s": 0.5, "latency_p95_s": 0.9,
             "served_by": {"replica 0": 2, "replica 1": 2}, "prefix_hit_share": 0.5}
            for name, count, policy in SETTINGS]
    rows[0]["prefix_hit_share"] = None
    rows[1]["errors"] = ["request 3: 503 busy"]
    text = table({"workload": Workload().__dict__, "settings": rows, "model": "tiny"})
    for name, _, _ in SETTINGS:
        assert name in text
    assert "50 %" in text and "2 / 2" in text and "request 3: 503 busy" in text

