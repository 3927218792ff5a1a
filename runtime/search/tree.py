"""A search's tree as it grows, sent as per-step deltas (`runtime.wire.protocol.SearchTree`).

The controller adds a node when a path starts a step and changes it when the step is settled; the
recorder collects what changed and `flush` sends it as one message, so a step of n paths costs one
message of n nodes, never the whole tree again. Disabled (the request did not ask), it records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from runtime.wire.protocol import NodeChange, SearchTree, TreeNode

ROOT = 0


class TreeRecorder:
    def __init__(self, request_id: str, emit: Callable[[SearchTree], None], enabled: bool) -> None:
        self.request_id = request_id
        self.emit = emit
        self.enabled = enabled
        self.parents: dict[int, int | None] = {}  # node -> parent, for walking a selected answer's line
        self.added: list[TreeNode] = []
        self.changed: dict[int, NodeChange] = {}  # node -> its latest change since the last flush

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def add(self, parent: int | None, step: int) -> int:
        """A new running node under `parent`; returns its id (ids count up from the root's 0)."""
        node = len(self.parents)
        self.parents[node] = parent
        if self.enabled:
            self.added.append(TreeNode(node, parent, step))
        return node

    def change(self, node: int, status: str, text: str | None = None, score: float | None = None) -> None:
        if not self.enabled:
            return
        before = self.changed.get(node)
        if before is not None:  # a later change of the same flush keeps what the earlier one knew
            text = before.text if text is None else text
            score = before.score if score is None else score
        self.changed[node] = NodeChange(node, status, text, score)

    def select(self, leaves: Iterable[int]) -> None:
        """Mark the nodes from each leaf up to the root as selected."""
        for leaf in leaves:
            node: int | None = leaf
            while node is not None:
                self.change(node, "selected")
                node = self.parents[node]

    def flush(self, done: bool = False) -> None:
        if not self.enabled or not (self.added or self.changed or done):
            return
        self.emit(SearchTree(request_id=self.request_id, added=tuple(self.added),
                             changed=tuple(self.changed.values()), done=done))
        self.added, self.changed = [], {}
