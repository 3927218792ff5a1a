"""The product's import graph, read from the source with `ast`: every import counts, those under
`if TYPE_CHECKING:` and inside functions too. No module imports another that imports it back, by any
path, and each room imports only the rooms below it (STYLE.md, "Where the layout goes next"; the
import-linter contracts in pyproject.toml say the same of runtime imports)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "runtime", "scheduler", "storage")

# Each room's rank: a module may import only rooms of a lower rank. Rooms of one rank are
# independent of each other (requests | search | verify, kernels | wire).
RANKS = {
    "server": 13,
    "runtime": 12,  # the package itself: nothing but its docstring
    "runtime.process": 11,
    "runtime.preflight": 10,
    "runtime.bootstrap": 9,
    "runtime.engine": 8,
    "runtime.steps": 7,  # what rides on the step: searches, scorers, rewards requests
    "runtime.requests": 6, "runtime.search": 6, "runtime.verify": 6,
    "runtime.kv": 5,
    "runtime.model": 4, "runtime.grammar": 4,
    "runtime.kernels": 3, "runtime.wire": 3,
    "runtime.startup_cache": 2,  # the ground of runtime/: kernels and model keep what they build in it
    "scheduler": 1,
    "storage": 0,
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Each product module -> the product modules it imports (the nearest module a dotted name names)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                parent = package.split(".")[:len(package.split(".")) + 1 - node.level] if node.level else []
                base = ".".join(parent + ([node.module] if node.module else []))
                names += [f"{base}.{alias.name}" for alias in node.names]  # a module, or a name in `base`
        graph[module] = {target for name in names if (target := owner(name)) is not None} - {module}
    return graph


def room(module: str) -> str:
    for length in (2, 1):
        name = ".".join(module.split(".")[:length])
        if name in RANKS:
            return name
    raise AssertionError(f"{module} is in no room: give its room a rank in tests/test_layout.py")


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "runtime.kv.residency" in graph["runtime.engine"]  # at the top of the module
    assert "runtime.kv.headwise" in graph["runtime.requests.admission"]  # under TYPE_CHECKING and in a function
    assert "runtime.startup_cache" in graph["runtime.kernels.cpu_kernels"]  # in a function
    assert "runtime.wire.protocol" in graph["server.app"]


def test_no_module_imports_itself_back():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:  # Tarjan: each strongly connected part of more than one module is a cycle
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            part = []
            while not part or part[-1] != module:
                part.append(stack.pop())
            if len(part) > 1:
                cycles.append(sorted(part))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert cycles == []


def test_each_room_imports_only_the_rooms_below_it():
    upward = [f"{module} -> {target}" for module, targets in sorted(import_graph().items())
              for target in sorted(targets)
              if room(module) != room(target) and RANKS[room(module)] <= RANKS[room(target)]]
    assert upward == []


def test_the_server_reaches_the_runtime_only_through_the_wire():
    assert [f"{module} -> {target}" for module, targets in sorted(import_graph().items()) if room(module) == "server"
            for target in sorted(targets) if room(target) not in ("server", "runtime.wire")] == []


def test_each_runtime_room_says_what_it_owns_and_the_top_level_stays_small():
    runtime = ROOT / "runtime"
    for folder in [runtime, *sorted(p for p in runtime.iterdir() if (p / "__init__.py").is_file())]:
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert len(docstring.splitlines()) == 2, f"{folder.relative_to(ROOT)}/__init__.py: a two-line docstring"
    assert len(list(runtime.glob("*.py"))) <= 8
