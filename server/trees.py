"""The last `ui.max_trees` search trees, running and recent, and their live subscribers.

The runtime's `SearchTree` deltas are applied here as they arrive and handed to each subscriber
(one per open page stream) through its own bounded queue, never awaited: a subscriber whose queue is
full is dropped and its stream ends (the page reconnects and starts again from a fresh snapshot), so
no page, however slow or gone, can hold up a search or grow memory. The store itself is bounded:
past `max_trees`, the oldest ended tree is evicted (the oldest tree if every one is running).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict

from runtime.wire.protocol import GenerateRequest, SearchTree

RUNNING, FINISHED, CANCELLED, FAILED = "running", "finished", "cancelled", "failed"
MAX_TEXT = 2000  # characters of a step's text kept per node
MAX_QUESTION = 300


class Subscriber:
    """One stream's queue of events: (event name, payload), then None when the stream must end."""

    def __init__(self, tree: "Tree", max_events: int) -> None:
        self.tree = tree
        self.queue: asyncio.Queue[tuple[str, dict] | None] = asyncio.Queue(max_events)
        self.is_closed = False

    def offer(self, event: str, payload: dict) -> None:
        if self.is_closed:
            return
        try:
            self.queue.put_nowait((event, payload))
        except asyncio.QueueFull:
            self.close()  # too slow: it starts again from a snapshot rather than hold events

    def finish(self) -> None:
        """End the stream after what it has not read yet (the tree ended)."""
        if self.is_closed:
            return
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            self.close()
            return
        self.is_closed = True
        self.tree.subscribers.discard(self)

    def close(self) -> None:
        """End the stream now: what it had not read is dropped, and the end marker always fits."""
        self.is_closed = True
        self.tree.subscribers.discard(self)
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


def _question(request: GenerateRequest) -> str:
    if request.messages is not None:
        users = [m.get("content", "") for m in request.messages if m.get("role") == "user"]
        text = users[-1] if users else ""
    else:
        text = request.prompt if request.prompt is not None else f"({len(request.prompt_token_ids or ())} token ids)"
    return text[:MAX_QUESTION]


class Tree:
    def __init__(self, request: GenerateRequest) -> None:
        search = request.search
        self.id = request.request_id
        self.info = {"strategy": search.strategy, "n": search.n, "beam_width": search.beam_width,
                     "verifier": search.verifier, "question": _question(request)}
        self.created = time.time()
        self.state = RUNNING
        self.nodes: dict[int, dict] = {}
        self.subscribers: set[Subscriber] = set()

    def summary(self) -> dict:
        steps = max((n["step"] for n in self.nodes.values()), default=0)
        return {"id": self.id, "state": self.state, "created": self.created, "num_nodes": len(self.nodes),
                "steps": steps, **self.info}

    def snapshot(self) -> dict:
        return {**self.summary(), "nodes": [dict(node) for node in self.nodes.values()]}

    def apply(self, message: SearchTree) -> dict:
        """Apply a delta; returns it as the page reads it (new nodes, then changed fields)."""
        added = []
        for node in message.added:
            entry = {"id": node.id, "parent": node.parent, "step": node.step, "status": "running", "text": "",
                     "score": None}
            self.nodes[node.id] = entry
            added.append(dict(entry))
        changed = []
        for change in message.changed:
            entry = self.nodes.get(change.id)
            if entry is None:
                continue
            update = {"id": change.id, "status": change.status}
            if change.text is not None:
                update["text"] = change.text[:MAX_TEXT]
            if change.score is not None:
                update["score"] = change.score
            entry.update(update)
            changed.append(update)
        return {"added": added, "changed": changed}

    def publish(self, event: str, payload: dict) -> None:
        for subscriber in list(self.subscribers):
            subscriber.offer(event, payload)


class SearchTrees:
    def __init__(self, max_trees: int, max_events: int = 256) -> None:
        self.max_trees = max_trees
        self.max_events = max_events  # per subscriber: a stream this far behind is dropped
        self.trees: OrderedDict[str, Tree] = OrderedDict()  # oldest first

    @property
    def is_enabled(self) -> bool:
        return self.max_trees > 0

    def start(self, request: GenerateRequest) -> None:
        if not self.is_enabled or request.search is None:
            return
        self.trees[request.request_id] = Tree(request)
        while len(self.trees) > self.max_trees:
            ended = next((t for t in self.trees.values() if t.state != RUNNING), None)
            self._evict(ended if ended is not None else next(iter(self.trees.values())))

    def _evict(self, tree: Tree) -> None:
        del self.trees[tree.id]
        for subscriber in list(tree.subscribers):
            subscriber.close()

    def forget(self, request_id: str) -> None:
        tree = self.trees.get(request_id)
        if tree is not None:
            self._evict(tree)

    def apply(self, message: SearchTree) -> None:
        tree = self.trees.get(message.request_id)
        if tree is None or tree.state != RUNNING:
            return
        tree.publish("delta", tree.apply(message))
        if message.done:
            self.end(tree.id, FINISHED)

    def end(self, request_id: str, state: str) -> None:
        """The request is over; a tree the runtime did not finish keeps its nodes as they were."""
        tree = self.trees.get(request_id)
        if tree is None or tree.state != RUNNING:
            return
        tree.state = state
        tree.publish("state", {"state": state})
        for subscriber in list(tree.subscribers):
            subscriber.finish()

    def get(self, tree_id: str) -> Tree | None:
        return self.trees.get(tree_id)

    def summaries(self) -> list[dict]:
        """Newest first."""
        return [tree.summary() for tree in reversed(self.trees.values())]

    def subscribe(self, tree: Tree) -> Subscriber:
        """A queue that starts with the tree as it is now; every later delta follows."""
        subscriber = Subscriber(tree, self.max_events)
        subscriber.offer("tree", tree.snapshot())
        tree.subscribers.add(subscriber)
        if tree.state != RUNNING:
            subscriber.finish()  # nothing will change: the snapshot is all
        return subscriber

    @staticmethod
    def unsubscribe(subscriber: Subscriber) -> None:
        with contextlib.suppress(Exception):
            subscriber.tree.subscribers.discard(subscriber)
