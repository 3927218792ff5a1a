"""The judge's questions in the engine: one sequence per distinct question of a verification."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.runtime.engine_helpers import engine_for


@dataclass(eq=False)
class Path:
    units: list[str]

    def scoring_units(self) -> list[str]:
        return self.units


@dataclass
class Controller:
    question: str = "w1 w2 w3"
    request_id: str = "judge"
    pending_scores: int = 0
    scores: list = field(default_factory=list)  # (path, score, prefilled, cached)
    done: int = 0

    def on_score(self, path, score, prefilled=0, cached=0):
        self.scores.append((path, score, prefilled, cached))

    def score_done(self):
        self.pending_scores -= 1
        self.done += 1


def verify(engine, paths):
    controller = Controller()
    engine.scorers["judge"].submit(controller, paths)
    asked = len(engine.scoring[controller.request_id])
    while engine.has_work:
        engine.step()
    engine.scoring.pop(controller.request_id)
    assert controller.done == 1 and controller.pending_scores == 0
    return asked, controller.scores


def test_paths_asking_the_same_question_share_one_sequence_and_its_score(tiny_llama):
    same_a, same_b = Path(["w4 w5", "w6"]), Path(["w4 w5", "w6"])
    other = Path(["w4 w5", "w7 w8"])
    engine = engine_for(tiny_llama, enable_prefix_cache=False)
    asked, scores = verify(engine, [same_a, other, same_b])
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
    assert engine.pool.num_used == 0
