"""No room of runtime/ writes another room's fields, read from the source with `ast`.

The rule (docs/design.md, "How a room asks another for a change"): a module assigns an attribute on
`self`, or on a record of its own room (`path.step_end = ...` in runtime/search/, whose SearchPath is
the search's record, made and filled there); another room's object changes only through its methods
(`seq.own(path)`, `kv.fork_prompt(...)`, a plan's actions). A field counts as the room's when a class
of the room declares it: a class-level annotation (a dataclass field) or an assignment on `self` in
one of its methods. `x.a = v`, `x.a += v` and `x.a[k] = v` all count as writing `a`.

The exceptions (none now) would name an owner outside the rooms this rule governs, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"

# (module, attribute): why it is written there.
EXCEPTIONS: dict[tuple[str, str], str] = {}  # none left: every write found goes through its owner's methods
# model/ and kernels/ set up third-party objects (torch modules and their parameters, transformers
# configs, os.environ): the rule is about the objects of our own rooms.
OUTSIDE = ("runtime/model/", "runtime/kernels/")


def room_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:2])  # runtime.search, runtime.engine, ...


def declared(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        for node in ast.walk(cls):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    names.add(target.attr)
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment writes: its targets, a tuple's elements one by one."""
    if isinstance(node, ast.Assign):
        found, todo = [], list(node.targets)
        while todo:
            target = todo.pop(0)
            if isinstance(target, (ast.Tuple, ast.List)):
                todo[:0] = target.elts
            else:
                found.append(target.value if isinstance(target, ast.Starred) else target)
        return found
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _written(target: ast.expr) -> ast.Attribute | None:
    """The attribute a target writes (`x.a`, `x.a[k]`, `x.a.b[k]`: the first attribute off the name)."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if not isinstance(target, ast.Attribute):
        return None
    while isinstance(target.value, ast.Attribute):
        target = target.value
    return target if isinstance(target.value, ast.Name) else None


def foreign_writes() -> list[str]:
    modules = {path: ast.parse(path.read_text(), str(path)) for path in sorted(RUNTIME.rglob("*.py"))
               if not str(path.relative_to(ROOT)).startswith(OUTSIDE)}
    fields: dict[str, set[str]] = {}
    for path, tree in modules.items():
        fields.setdefault(room_of(path), set()).update(declared(tree))
    found = []
    for path, tree in modules.items():
        module = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            for target in _targets(node):
                written = _written(target)
                if written is None or written.value.id in ("self", "cls"):
                    continue
                if written.attr in fields[room_of(path)] or (module, written.attr) in EXCEPTIONS:
                    continue
                found.append(f"{module}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_room_writes_another_rooms_fields():
    assert foreign_writes() == []


def test_the_rule_sees_a_foreign_write():
    """A write of a field no class of the room declares is found (the check can fail)."""
    tree = ast.parse("class Path:\n    step_end: int = 0\n\ndef f(seq, path):\n    path.step_end = 1\n"
                     "    seq.num_computed_tokens += 1\n    seq.block_table[0] = 2\n")
    fields = declared(tree)
    writes = [_written(t) for n in ast.walk(tree) for t in _targets(n)]
    assert [w.attr for w in writes if w is not None and w.attr not in fields] == ["num_computed_tokens", "block_table"]


# The rooms that ask the engine for changes: each sequence change goes through the one port every
# room uses (runtime.kv.sequence_host); only block counts are read off the engine's KV manager.
ASKERS = ("runtime/requests/", "runtime/search/", "runtime/verify/", "runtime/steps/")
KV_READS = {"num_blocks_for"}


def reaches_past_the_port(tree: ast.AST) -> list[str]:
    """Calls of a method of a scheduler or KV manager held by another object (`host.scheduler.add(...)`,
    `self.host.kv.fork(...)`); a room's own (`self.kv`, a verifier store's pool) is its own to change."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            held = node.func.value
            if isinstance(held, ast.Attribute) and held.attr in ("scheduler", "kv") \
                    and not (isinstance(held.value, ast.Name) and held.value.id == "self") \
                    and not (held.attr == "kv" and node.func.attr in KV_READS):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_every_room_changes_sequences_through_the_one_port():
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sorted(RUNTIME.rglob("*.py"))
             if str(path.relative_to(ROOT)).startswith(ASKERS)
             for hit in reaches_past_the_port(ast.parse(path.read_text(), str(path)))]
    assert found == []


def test_the_rule_sees_a_call_past_the_port():
    tree = ast.parse("def f(self, seq, host):\n    self.host.scheduler.finish(seq)\n    host.kv.fork(seq, seq)\n"
                     "    self.host.kv.num_blocks_for(3)\n    self.kv.free(seq)\n    self.host.release_sequence(seq)\n")
    assert reaches_past_the_port(tree) == ["2: self.host.scheduler.finish", "3: host.kv.fork"]
