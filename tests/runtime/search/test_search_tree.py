"""The search tree the runtime sends: one node per step of each path, parents, statuses, per-step deltas."""

import pytest

from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, GenerateRequest, NodeChange, SearchTree, TreeNode
from runtime.search.tree import TreeRecorder
from tests.runtime.engine_helpers import engine_for

N, BEAM_WIDTH, STEPS = 4, 2, 3


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


def run_tree(engine, request_id, strategy, **search):
    params = dict(strategy=strategy, n=N, beam_width=BEAM_WIDTH, max_steps=STEPS, max_step_tokens=4,
                  verifier="confidence", include_tree=True, greedy_anchor=False)
    params.update(search)
    request = GenerateRequest(request_id=request_id, endpoint="chat",
                              messages=({"role": "user", "content": "w1 w2 w3"},),
                              sampling=SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True),
                              search=SearchParams(**params))
    engine.add_request(request)
    messages = []
    while engine.has_work:
        messages += engine.step()
        engine.check_integrity()
    trees = [m for m in messages if isinstance(m, SearchTree)]
    nodes: dict[int, dict] = {}
    for tree in trees:
        for node in tree.added:
            assert node.id not in nodes  # deltas: a node is sent once
            nodes[node.id] = {"parent": node.parent, "step": node.step, "status": "running", "text": None,
                              "score": None}
        for change in tree.changed:
            nodes[change.id]["status"] = change.status
            nodes[change.id].update({k: v for k, v in (("text", change.text), ("score", change.score))
                                     if v is not None})
    answer = next(m for m in messages if isinstance(m, Delta) and m.search is not None)
    return trees, nodes, answer


def children(nodes, parent):
    return sorted(i for i, n in nodes.items() if n["parent"] == parent)


def selected_line(nodes):
    line = sorted((i for i, n in nodes.items() if n["status"] == "selected"), key=lambda i: nodes[i]["step"])
    assert [nodes[i]["step"] for i in line] == list(range(STEPS + 1))
    assert all(nodes[child]["parent"] == parent for parent, child in zip(line, line[1:]))
    return line


def test_best_of_n_tree_is_n_independent_lines_and_one_is_selected(engine):
    trees, nodes, answer = run_tree(engine, "bon", "best_of_n")
    assert len(nodes) == 1 + N * STEPS == 13
    assert [len(t.added) for t in trees] == [1 + N, N, N, 0] and [t.done for t in trees] == [False] * 3 + [True]
    assert nodes[0] == {"parent": None, "step": 0, "status": "selected", "text": "w1 w2 w3", "score": None}
    assert children(nodes, 0) == [1, 2, 3, 4]
    for i, node in nodes.items():
        if i:
            assert len(children(nodes, i)) == (1 if node["step"] < STEPS else 0)
            assert nodes[node["parent"]]["step"] == node["step"] - 1 and node["text"] and node["score"] is not None
    line = selected_line(nodes)
    statuses = {i: n["status"] for i, n in nodes.items() if i not in line}
    assert sorted(statuses.values()) == ["finished"] * (N - 1) + ["kept"] * (N - 1) * (STEPS - 1)
    assert tuple(nodes[i]["score"] for i in line[1:]) == pytest.approx(answer.search.step_scores)


def test_the_greedy_anchor_is_one_more_line_under_the_root(engine):
    _, plain, _ = run_tree(engine, "bon-plain", "best_of_n")
    _, nodes, _ = run_tree(engine, "bon-anchor", "best_of_n", greedy_anchor=True)
    assert len(nodes) == len(plain) + STEPS and len(children(nodes, 0)) == N + 1
    line = selected_line(nodes)  # greedy is the most confident: its line is the one selected
    assert line[1] == max(children(nodes, 0))  # forked from the prompt after the strategy's paths


def test_beam_tree_keeps_n_over_beam_width_per_step_and_forks_them(engine):
    trees, nodes, answer = run_tree(engine, "beam", "beam")
    assert len(nodes) == 1 + N * STEPS == 13
    assert [len(t.added) for t in trees] == [1 + N, N, N, 0]
    for step in range(1, STEPS):
        at_step = [i for i, n in nodes.items() if n["step"] == step]
        survivors = [i for i in at_step if nodes[i]["status"] in ("kept", "selected")]
        assert len(at_step) == N and len(survivors) == N // BEAM_WIDTH
        assert sorted(nodes[i]["status"] for i in at_step if i not in survivors) == ["pruned"] * (N - N // BEAM_WIDTH)
        assert all(len(children(nodes, i)) == BEAM_WIDTH for i in survivors)
        assert all(not children(nodes, i) for i in at_step if i not in survivors)
        best = max(at_step, key=lambda i: nodes[i]["score"])
        assert best in survivors  # (last-score aggregation: the best step score always survives)
    last = [n["status"] for n in nodes.values() if n["step"] == STEPS]
    assert sorted(last) == ["finished"] * (N - 1) + ["selected"]
    line = selected_line(nodes)
    assert tuple(nodes[i]["score"] for i in line[1:]) == pytest.approx(answer.search.step_scores)


def test_unverified_steps_have_no_score_and_no_tree_unless_asked(engine):
    _, nodes, _ = run_tree(engine, "g2", "beam", granularity=2)
    assert {n["step"] for n in nodes.values() if n["score"] is None} == {0, 1}  # steps 2 and 3 are verified
    trees, _, _ = run_tree(engine, "quiet", "beam", include_tree=False)
    assert trees == []


def test_recorder_merges_changes_of_one_flush_and_selects_up_to_the_root():
    sent = []
    tree = TreeRecorder("r", sent.append, enabled=True)
    root = tree.add(None, 0)
    a, b = tree.add(root, 1), tree.add(root, 1)
    c = tree.add(a, 2)
    tree.change(a, "running", "step a", 0.5)
    tree.change(a, "kept")
    tree.flush()
    tree.select([c])
    tree.flush(done=True)
    tree.flush()  # nothing new: nothing sent
    assert sent == [
        SearchTree(request_id="r", added=(TreeNode(0, None, 0), TreeNode(1, 0, 1), TreeNode(2, 0, 1),
                                          TreeNode(3, 1, 2)), changed=(NodeChange(1, "kept", "step a", 0.5),)),
        SearchTree(request_id="r", changed=(NodeChange(3, "selected"), NodeChange(1, "selected"),
                                            NodeChange(0, "selected")), done=True)]
    assert b == 2 and tree.num_nodes == 4
    off = TreeRecorder("r", sent.append, enabled=False)
    off.change(off.add(None, 0), "kept")
    off.flush(done=True)
    assert len(sent) == 2
