"""Speculative branches decode exactly the children they become: a search's tokens, scores and answers
are the same with speculation on and off, for every strategy that expands, with a verifier that reads
logits (the judge) and one that reads text (calculator), and several seeds; and with the confidence
verifier, whose scores speculation reads ahead, with few rows and beams refilled from fewer survivors."""

import random
from types import SimpleNamespace

import msgspec
import pytest

from runtime.search.strategies import make_strategy
from runtime.wire.protocol import Delta, Finished
from bench.steps import StepLog
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import run_search, search_request

# "w1" ends steps often and unevenly, so paths done early leave slots for their children's branches.
SEARCH = dict(n=8, beam_width=4, max_steps=4, step_delimiter="w1", max_step_tokens=8)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return {speculative: engine_for(tiny_llama, num_blocks=1024, speculative_extension=speculative)
            for speculative in (False, True)}


def outcome(messages):
    """Every choice's token ids, text, score, step scores and answer, and the search's summary counts."""
    choices: dict[int, dict] = {}
    summary = None
    for m in messages:
        if isinstance(m, Delta):
            choice = choices.setdefault(m.index, {"text": "", "token_ids": []})
            choice["text"] += m.text
            choice["token_ids"] += list(m.token_ids)
            if m.search is not None:
                choice.update(score=m.search.score, step_scores=list(m.search.step_scores), answer=m.search.answer)
        elif isinstance(m, Finished):
            summary = (m.completion_tokens, m.search.steps, m.search.paths_explored)
    return [choices[i] for i in sorted(choices)], summary


def with_seed(request, seed: int):
    return msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, seed=seed))


@pytest.mark.parametrize("strategy", ["beam", "dvts", "dynamic_branching"])
@pytest.mark.parametrize("verifier", ["judge", "calculator"])
def test_speculation_changes_no_token_score_or_answer(engines, strategy, verifier):
    adopted = 0
    for seed in (11, 12, 13):
        request = with_seed(search_request(f"{strategy}-{verifier}-{seed}", strategy=strategy, verifier=verifier,
                                           **SEARCH), seed)
        results = {}
        for speculative, engine in engines.items():
            before = dict(engine.stats["speculative_tokens"])
            results[speculative] = outcome(run_search(engine, request))
            assert engine.pool.num_used == 0 and engine.scoring == {}
            if speculative:
                adopted += engine.stats["speculative_tokens"].get("adopted", 0) - before.get("adopted", 0)
        assert results[True] == results[False]
        assert results[True][0] and all(c["token_ids"] for c in results[True][0])
    assert adopted > 0  # children did adopt their branches' tokens


def test_a_search_takes_fewer_decode_steps_when_children_start_ahead(tiny_llama):
    """Children adopt branches whose steps are already under way, so the search takes fewer decode
    steps (fresh engines: the same pool, the same prefix cache), its answer unchanged."""
    request = search_request("steps", strategy="beam", verifier="judge", **dict(SEARCH, max_steps=6, max_step_tokens=16))
    counts, saved = {}, {}
    for speculative in (False, True):
        engine = engine_for(tiny_llama, num_blocks=1024, speculative_extension=speculative)
        steps = StepLog(engine.runner)
        counts[speculative] = (outcome(run_search(engine, request)), len(steps.decode))
        saved[speculative] = (engine.step_cost.saved, engine.step_cost.speculated)
    assert counts[True][0] == counts[False][0]
    assert counts[True][1] < counts[False][1]
    # What the step-cost model learns: the groups' last paths' head starts, steps saved, and every
    # speculative token decoded; none without speculation.
    assert saved[False] == (0, 0) and 0 < saved[True][0] < saved[True][1]


def test_descendants_decode_several_steps_ahead_and_are_adopted(tiny_llama, monkeypatch):
    """A branch that completes its step goes on and gets branches of its own; children adopt branches
    holding more than one step, with branches below them; the search is the one without speculation."""
    from runtime.search.speculation import Speculation

    handed = []
    hand_over = Speculation.hand_over

    def watch(self, branch, child):
        handed.append((len(branch.ahead), len(self.branches.get(branch, {}))))
        hand_over(self, branch, child)

    monkeypatch.setattr(Speculation, "hand_over", watch)
    request = search_request("deep", strategy="beam", verifier="judge", **dict(SEARCH, max_steps=6, max_step_tokens=16))
    results, accounts = {}, []
    for speculative in (False, True):
        engine = engine_for(tiny_llama, num_blocks=1024, speculative_extension=speculative)
        finished = engine.search_finished

        def account(controller, finished=finished):
            accounts.append((dict(controller.speculation.tokens), controller.speculation.num_decoded))
            finished(controller)

        engine.search_finished = account
        results[speculative] = outcome(run_search(engine, request))
        assert engine.pool.num_used == 0
    assert results[True] == results[False]
    assert any(steps > 1 for steps, _ in handed)  # a child adopted steps past its first
    assert any(below > 0 for _, below in handed)  # and the branches below them
    # Every speculative token decoded is counted once: used, adopted or discarded.
    tokens, decoded = accounts[-1]
    assert decoded > 0 and sum(tokens.values()) == decoded


def test_branches_yield_their_slots_fewer_survivors_want_more_and_the_surely_pruned_stop(tiny_llama, monkeypatch):
    """With 12 rows, a running lineage ranked after a want gives up its slot at its next token and
    decodes the rest of its step later; paths finishing early leave fewer survivors than the beam
    keeps (4 of 8), whose children past `beam_width` are wanted, and so are those that the lineages
    completing a later step ahead make likely there; a group's opening wants the children of every
    step a lineage completed ahead again; the confidence verifier's step scores are read ahead, paths
    they surely prune stop speculating before the step settles, and the beam's settling replayed on
    them orders what decodes first. The search is the one without
    speculation, for every seed."""
    from runtime.search.child_counts import ChildCounts
    from runtime.search.ranking import LineageRanking
    from runtime.search.speculation import Speculation

    import runtime.search.ranking as ranking

    seen = {"yielded": 0, "past_width": 0, "scored_ahead": 0, "doomed": 0, "likely_grew": 0, "wanted_again": 0,
            "projected": 0}
    project = ranking.project

    def watch_project(*args):
        projection = project(*args)
        seen["projected"] += bool(projection.children)
        return projection
    make_way, want = Speculation._make_way, LineageRanking.want
    score, doom = LineageRanking._score, LineageRanking._doom
    completed, reached = ChildCounts.completed, LineageRanking.reached

    def watch_reached(self, lineage, at, step, itself=True):
        seen["wanted_again"] += not itself
        reached(self, lineage, at, step, itself)

    def watch_completed(self, step, finished):
        grown = completed(self, step, finished)
        seen["likely_grew"] += grown is not None
        return grown

    def watch_doom(self):
        before = len(self.doomed)
        doom(self)
        seen["doomed"] += len(self.doomed) - before

    def watch_make_way(self):
        before = len(self.yielding)
        make_way(self)
        seen["yielded"] += len(self.yielding) - before

    def watch_want(self, step, lineage, ordinal, *rest):
        seen["past_width"] += ordinal >= self.beam_width
        want(self, step, lineage, ordinal, *rest)

    def watch_score(self, lineage, step):
        found = score(self, lineage, step)
        seen["scored_ahead"] += found is not None
        return found

    monkeypatch.setattr(Speculation, "_make_way", watch_make_way)
    monkeypatch.setattr(LineageRanking, "want", watch_want)
    monkeypatch.setattr(LineageRanking, "_score", watch_score)
    monkeypatch.setattr(LineageRanking, "_doom", watch_doom)
    monkeypatch.setattr(ChildCounts, "completed", watch_completed)
    monkeypatch.setattr(LineageRanking, "reached", watch_reached)
    monkeypatch.setattr(ranking, "project", watch_project)
    engines = {speculative: engine_for(tiny_llama, num_blocks=1024, max_num_seqs=12, speculative_extension=speculative)
               for speculative in (False, True)}
    for seed in (11, 12, 13):
        request = with_seed(search_request(f"yield-{seed}", strategy="beam", verifier="confidence",
                                           **dict(SEARCH, beam_width=2, max_steps=6, max_step_tokens=16)), seed)
        results = {speculative: outcome(run_search(engine, request)) for speculative, engine in engines.items()}
        assert results[True] == results[False]
        assert engines[True].pool.num_used == 0
    assert all(count > 0 for count in seen.values()), seen


@pytest.mark.parametrize("strategy", ["beam", "dynamic_branching"])
def test_a_path_surely_pruned_is_pruned_whatever_paths_join(strategy):
    """The sure-pruning rule speculation reads ahead against the strategy's own `expand`: a path it
    calls pruned, given the live paths that ended the step, is no parent in any expansion of those
    paths and others that end later (paths of one text have one score, as the same tokens do)."""
    import random
    from types import SimpleNamespace

    from runtime.search.strategies import make_strategy

    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        n, beam_width = rng.choice([(8, 4), (16, 4), (8, 2), (6, 3)])
        rule = make_strategy(strategy, n, beam_width)
        score_of = {}  # text -> its score

        def path(uid):
            text = rng.choice("abcdefghij")
            return SimpleNamespace(uid=uid, subtree=0, is_done=False, text=text,
                                   score=score_of.setdefault(text, rng.choice([0.1, 0.2, 0.3, 0.5, 0.8])))

        uids = rng.sample(range(40), rng.randint(2, 14))
        ended = [path(uid) for uid in uids[:rng.randint(1, len(uids))]]
        later = [path(uid) for uid in uids[len(ended):]]
        for uid in rule.surely_pruned(ended):
            checked += 1
            for joined in (ended, ended + later, ended + later[:1]):
                assert uid not in rule.expand(joined).parents
    assert checked > 50


def test_a_later_steps_children_are_the_sure_count_until_its_lineages_tell_how_its_paths_end():
    """`ChildCounts`: a later step's count is the strategy's for a full step until half a step's paths
    have completed it ahead; then the share of them that ended it live, of `n` paths, gives the
    survivors' children (beam search, n=16, width 4: 4 survivors, 4 children each, while 8 or more
    are live; 2 live, 8 children). It never shrinks, and the step being decoded counts only surely."""
    from runtime.search.child_counts import ChildCounts

    strategy = make_strategy("beam", 16, 4)
    port = SimpleNamespace(step_index=1, children_limit=lambda step: 4 if step > 1 else 5,
                           likely_children=lambda share: strategy.widest_child(max(1, round(16 * share))))
    counts = ChildCounts(port, 16)
    assert counts.at(3) == 4 and counts.at(1) == 5
    for _ in range(5):
        assert counts.completed(3, finished=True) is None  # 5 of the 8 it waits for
    assert counts.completed(3, finished=False) is None
    assert counts.completed(3, finished=True) is None
    assert counts.completed(3, finished=True) == (4, 8)  # 1 of 8 ended live: 2 survivors' worth, 8 children
    assert counts.at(3) == 8
    for _ in range(8):
        assert counts.completed(3, finished=False) is None  # more live now: never fewer children
    assert counts.at(3) == 8
    assert counts.completed(1, finished=True) is None and counts.at(1) == 5  # the step being decoded: sure only


def test_the_projection_replays_the_beam_over_the_steps_decoded_ahead():
    """`project`: beam search (n=4, width 2: it keeps 2) over the paths that ended a step: the two best
    survive with 2 children each (itself, and branch 1); those whose next step is complete and live
    are the next level, scored by it, the new child numbered after every real uid; a child not yet
    decoding, a step not yet complete and a pruned path's children are not projected."""
    from runtime.search.aggregate import aggregate
    from runtime.search.paths import StepAhead
    from runtime.search.projection import FIRST_PROJECTED_UID, Candidate, project

    def lineage(*ahead):
        return SimpleNamespace(ahead=list(ahead), seq=SimpleNamespace(token_ids=list(range(20))))

    a = lineage(StepAhead(10, 1, end=15, score=0.3))
    a1 = lineage(StepAhead(10, 1, end=14, score=0.8))
    b, c = lineage(), lineage(StepAhead(10, 1))
    branches = {(id(a), 1): a1}
    strategy = make_strategy("beam", 4, 2)
    expanded = []

    def expand(candidates):
        expanded.append(sorted(cand.uid for cand in candidates))
        return strategy.expand([SimpleNamespace(uid=cand.uid, subtree=0, is_done=False, text=cand.text,
                                                score=aggregate(cand.scores, "last")) for cand in candidates])

    first = [Candidate(a, 10, [0.9], "a", 0), Candidate(b, 10, [0.5], "b", 1), Candidate(c, 10, [0.7], "c", 2)]
    projection = project(first, 0, expand, lambda step: step < 2,
                         lambda lin, at, k: lin if k == 0 else branches.get((id(lin), k)))
    assert expanded == [[0, 1, 2], [0, FIRST_PROJECTED_UID]]
    assert projection.wants_child(a, 10, 1) and not projection.wants_child(a, 10, 2)
    assert projection.wants_child(c, 10, 1) and not projection.wants_child(b, 10, 0)
    assert projection.decodes_path(a1, 1) and projection.decodes_path(c, 1) and not projection.decodes_path(b, 1)
    assert projection.wants_child(a1, 14, 1) and projection.wants_child(a, 15, 1)  # the second level
    assert len(projection.children) == 4  # c's own step is not complete: no level after it


def test_searches_running_together_speculate_into_the_slots_each_other_leaves_and_change_nothing(tiny_llama,
                                                                                               monkeypatch):
    """Three confidence searches at once on 12 rows: one's speculation pauses while another's paths
    wait for slots (its lineages parked, wanted again), and goes on once slots are idle (`refill`);
    every search's tokens, scores and answers are those of the same three searches without
    speculation."""
    from runtime.search.speculation import Speculation

    refilled = {"started": 0}
    refill = Speculation.refill

    def watch_refill(self):
        before = self.num_rows
        wanted = refill(self)
        refilled["started"] += wanted and self.num_rows > before
        return wanted

    monkeypatch.setattr(Speculation, "refill", watch_refill)
    results = {}
    for speculative in (False, True):
        engine = engine_for(tiny_llama, num_blocks=1024, max_num_seqs=12, speculative_extension=speculative)
        messages = []
        for seed in (11, 12, 13):
            request = with_seed(search_request(f"together-{seed}", strategy="beam", verifier="confidence",
                                               **dict(SEARCH, beam_width=2, max_steps=6, max_step_tokens=16)), seed)
            messages += engine.add_request(request)
        while engine.has_work:
            messages += engine.step()
            engine.check_integrity()
        assert engine.pool.num_used == 0
        results[speculative] = {seed: outcome([m for m in messages if getattr(m, "request_id", None) == f"together-{seed}"])
                                for seed in (11, 12, 13)}
    assert results[True] == results[False]
    assert refilled["started"] > 0
