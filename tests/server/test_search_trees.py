"""The server's store of search trees: deltas applied, bounded size, bounded subscribers, the wire."""

import base64

from runtime.wire.params import SearchParams
from runtime.wire.protocol import GenerateRequest, NodeChange, SearchTree, TreeNode, decode_from_runtime, encode
from server.trees import CANCELLED, FINISHED, RUNNING, SearchTrees
from server.ui import _presented_key


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=({"role": "user", "content": "2+2?"},),
                           search=SearchParams(strategy="beam", n=2, beam_width=2))


STEP_1 = SearchTree(request_id="a", added=(TreeNode(0, None, 0), TreeNode(1, 0, 1), TreeNode(2, 0, 1)),
                    changed=(NodeChange(0, "kept", "2+2?"),))
STEP_2 = SearchTree(request_id="a", added=(TreeNode(3, 1, 2), TreeNode(4, 1, 2)),
                    changed=(NodeChange(1, "kept", "Add.", 0.75), NodeChange(2, "pruned", "Guess.", 0.25)))
DONE = SearchTree(request_id="a", changed=(NodeChange(3, "selected", "4", 0.5), NodeChange(4, "finished", "5", 0.125),
                                           NodeChange(1, "selected"), NodeChange(0, "selected")), done=True)


def drain(subscriber) -> list:
    items = []
    while not subscriber.queue.empty():
        items.append(subscriber.queue.get_nowait())
    return items


def test_tree_messages_cross_the_wire_unchanged():
    for message in (STEP_1, STEP_2, DONE):
        assert decode_from_runtime(encode(message)) == message


def test_deltas_build_the_tree_and_a_subscriber_gets_snapshot_then_deltas_then_the_end():
    trees = SearchTrees(4)
    trees.start(request("a"))
    trees.apply(STEP_1)
    sub = trees.subscribe(trees.get("a"))
    trees.apply(STEP_2)
    trees.apply(DONE)
    events = drain(sub)
    assert [e[0] for e in events[:-1]] == ["tree", "delta", "delta", "state"] and events[-1] is None
    snapshot = events[0][1]
    assert snapshot["state"] == RUNNING and snapshot["strategy"] == "beam" and snapshot["question"] == "2+2?"
    assert [n["id"] for n in snapshot["nodes"]] == [0, 1, 2] and snapshot["nodes"][1]["status"] == "running"
    assert events[1][1] == {"added": [{"id": 3, "parent": 1, "step": 2, "status": "running", "text": "", "score": None},
                                      {"id": 4, "parent": 1, "step": 2, "status": "running", "text": "", "score": None}],
                            "changed": [{"id": 1, "status": "kept", "text": "Add.", "score": 0.75},
                                        {"id": 2, "status": "pruned", "text": "Guess.", "score": 0.25}]}
    assert events[3][1] == {"state": FINISHED}
    tree = trees.get("a").snapshot()
    assert tree["state"] == FINISHED and tree["num_nodes"] == 5 and tree["steps"] == 2
    assert {n["id"]: (n["parent"], n["status"], n["score"]) for n in tree["nodes"]} == {
        0: (None, "selected", None), 1: (0, "selected", 0.75), 2: (0, "pruned", 0.25), 3: (1, "selected", 0.5),
        4: (1, "finished", 0.125)}
    assert not trees.get("a").subscribers
    late = trees.subscribe(trees.get("a"))  # an ended tree: its snapshot, then the end
    assert [e[0] for e in drain(late)[:-1]] == ["tree"]


def test_end_marks_an_unfinished_tree_and_later_deltas_are_ignored():
    trees = SearchTrees(4)
    trees.start(request("a"))
    trees.apply(STEP_1)
    trees.end("a", CANCELLED)
    trees.apply(STEP_2)
    trees.end("a", FINISHED)
    assert trees.get("a").summary()["state"] == CANCELLED and trees.get("a").summary()["num_nodes"] == 3


def test_the_store_evicts_the_oldest_ended_tree_then_the_oldest_running_one():
    trees = SearchTrees(2)
    for rid in "abc":
        trees.start(request(rid))
    assert [s["id"] for s in trees.summaries()] == ["c", "b"]  # all running: the oldest went
    trees.end("c", FINISHED)
    watcher = trees.subscribe(trees.get("c"))
    trees.start(request("d"))
    assert [s["id"] for s in trees.summaries()] == ["d", "b"]  # c had ended: it went before the older b
    trees.end("d", FINISHED)
    sub_b = trees.subscribe(trees.get("b"))
    trees.start(request("e"))
    assert [s["id"] for s in trees.summaries()] == ["e", "b"] and trees.get("d") is None
    trees.start(request("f"))  # b and e run: b, the oldest, goes, and its stream ends
    assert [s["id"] for s in trees.summaries()] == ["f", "e"]
    assert drain(sub_b) == [None] and drain(watcher)[-1] is None
    off = SearchTrees(0)
    off.start(request("a"))
    assert not off.is_enabled and off.summaries() == []


def test_a_slow_subscriber_is_dropped_and_never_holds_the_search():
    trees = SearchTrees(4, max_events=2)
    trees.start(request("a"))
    slow = trees.subscribe(trees.get("a"))  # the snapshot takes one place
    fast = trees.subscribe(trees.get("a"))
    trees.apply(STEP_1)  # fills slow's queue
    drain(fast)
    trees.apply(STEP_2)  # slow is full: dropped, its unread events discarded
    assert drain(slow) == [None] and slow.is_closed and trees.get("a").subscribers == {fast}
    assert [e[0] for e in drain(fast)] == ["delta"]
    trees.apply(DONE)
    assert trees.get("a").summary()["state"] == FINISHED


def test_rejected_requests_are_forgotten():
    trees = SearchTrees(4)
    trees.start(request("a"))
    trees.forget("a")
    trees.forget("nope")
    assert trees.summaries() == []


def test_the_page_takes_the_key_as_bearer_or_as_basic_password():
    basic = base64.b64encode(b"anyone:s3cret:x").decode()
    assert _presented_key("Bearer s3cret") == b"s3cret"
    assert _presented_key(f"Basic {basic}") == b"s3cret:x"
    assert _presented_key("Basic !!!") is None and _presented_key("Token s3cret") is None and _presented_key("") is None
