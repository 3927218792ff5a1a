"""The judge's questions in the engine: one sequence per distinct question of a verification."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.runtime.engine_helpers import engine_for


@dataclass(eq=False)
class Path:
    units: list[str]

    def scoring_units(self) -> list[str]:
        return self.units


@dataclass(eq=False)
class Controller:
    question: str = "w1 w2 w3"
    request_id: str = "judge"
    pending_scores: int = 0
    scores: list = field(default_factory=list)  # (path, score, prefilled, cached)
    done: int = 0

    is_finished: bool = False

    def expect_scores(self):
        self.pending_scores += 1

    def lookahead_unit(self, path):
        return None

    def on_score(self, path, score, prefilled=0, cached=0):
        self.scores.append((path, score, prefilled, cached))

    def score_done(self):
        self.pending_scores -= 1
        self.done += 1


def verify(engine, paths, controller=None):
    """Submit one verification and run it; (sequences asked, the controller's scores)."""
    controller = controller or Controller()
    before = len(engine.scoring.get(controller.request_id, []))
    engine.scorers["judge"].submit(controller, paths)
    asked = len(engine.scoring[controller.request_id]) - before
    scores_before = len(controller.scores)
    while engine.has_work:
        engine.step()
    assert controller.pending_scores == 0
    return asked, controller.scores[scores_before:]


def finish(engine, controller):
    """What the engine does when the search ends: every question still kept is released."""
    for seq in engine.scoring.pop(controller.request_id):
        engine.release_sequence(seq)
    assert engine.pool.num_used == 0
    engine.check_integrity()


def test_paths_asking_the_same_question_share_one_sequence_and_its_score(tiny_llama):
    same_a, same_b = Path(["w4 w5", "w6"]), Path(["w4 w5", "w6"])
    other = Path(["w4 w5", "w7 w8"])
    engine = engine_for(tiny_llama, enable_prefix_cache=False)
    controller = Controller()
    asked, scores = verify(engine, [same_a, other, same_b], controller)
    assert asked == 2
    by_path = {id(path): (score, prefilled, cached) for path, score, prefilled, cached in scores}
    assert len(scores) == 3 and by_path.keys() == {id(same_a), id(same_b), id(other)}
    question = len(engine.scorers["judge"].judge.build_inputs("w1 w2 w3", same_a.units)[-1].token_ids)
    assert by_path[id(same_a)][1:] == (question, 0)
    assert by_path[id(same_b)] == (by_path[id(same_a)][0], 0, question)
    # each score is the one its question gets asked alone, to the bit
    for path in (same_a, other):
        alone = verify(engine_for(tiny_llama, enable_prefix_cache=False), [path])
        assert alone[0] == 1 and alone[1][0][1] == by_path[id(path)][0]
    assert len(engine.scorers["judge"].kept[controller]) == 2  # parked for the next verification
    finish(engine, controller)


def test_the_next_question_about_a_path_is_forked_from_its_previous_one(tiny_llama):
    judge_of = lambda engine: engine.scorers["judge"].judge  # noqa: E731
    engine = engine_for(tiny_llama, enable_prefix_cache=False)  # only the fork can share anything
    controller = Controller()
    first, second = Path(["w4 w5 w6 w7 w8 w9"]), Path(["w4 w5 w6 w7 w8 w9", "w10 w11"])
    verify(engine, [first], controller)
    (kept,) = engine.scorers["judge"].kept[controller]
    question = judge_of(engine).build_input("w1 w2 w3", second.units, 2).token_ids
    shared = 0
    while kept.token_ids[shared] == question[shared]:
        shared += 1
    asked, [(path, score, prefilled, cached)] = verify(engine, [second], controller)
    assert asked == 1 and path is second
    # the KV of every shared token but the last came with the fork, partial block included
    assert (prefilled, cached) == (len(question) - (shared - 1), shared - 1)
    assert kept.is_finished  # the previous question goes once the next is forked from it
    # the score of the question asked from scratch, to the bit
    fresh = engine_for(tiny_llama, enable_prefix_cache=False)
    _, [(_, fresh_score, fresh_prefilled, _)] = verify(fresh, [second])
    assert fresh_prefilled == len(question) and fresh_score == score
    finish(engine, controller)
