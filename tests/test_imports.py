"""The floor plan, read from the source (no module is imported): no import cycle among evalkit's and the
tasks' modules, no task reaches a compression method (`evalkit.kv`) through what it imports, the cache
library (`evalkit.kv`) imports nothing of the run-time, and no module of evalkit keeps state behind a
`global` statement.

Every import counts: one inside a function (it runs when the function does) and one under
`if TYPE_CHECKING:` (a type named across a floor ties the floors as surely as a call). An import of a package
counts as its `__init__`; `from pkg import name` counts as `pkg.name` where that is a module, else as `pkg`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("evalkit", "tasks")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The evalkit/tasks modules `name` imports (anywhere in its body: module level, in a function, under
    `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import evalkit.kv.select` -> that module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {name: imported(name, path, known) for name, path in known.items()}
    for name in known:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parts = name.split(".")
        edges[name] |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(known) - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def reach(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from `start`, each with the module that first imports it (for the path)."""
    parent, todo = {start: ""}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v]):
            if w not in parent:
                parent[w] = v
                todo.append(w)
    return parent


def path_to(parent: dict[str, str], end: str) -> str:
    chain = [end]
    while parent[chain[-1]]:
        chain.append(parent[chain[-1]])
    return " -> ".join(reversed(chain))


def is_package_init_edge(a: str, b: str) -> bool:
    return a.startswith(b + ".")


def test_no_import_cycle():
    edges = graph()
    # a package's __init__ importing its own submodules is how packages work, not a cycle between concepts
    plain = {
        a: {b for b in bs if not is_package_init_edge(a, b) and not is_package_init_edge(b, a)}
        for a, bs in edges.items()
    }
    assert cycles(plain) == []


def test_no_task_reaches_a_compression_method():
    edges = graph()
    bad = []
    for name in sorted(n for n in edges if n.split(".")[0] == "tasks"):
        parent = reach(edges, name)
        kv = sorted(m for m in parent if m == "evalkit.kv" or m.startswith("evalkit.kv."))
        if kv:
            bad.append(path_to(parent, kv[0]))
    assert bad == []


def test_the_walk_sees_function_level_and_type_only_imports():
    """The walker itself: a lazy import inside a function is an edge (evalkit.models imports evalkit.lm in
    `make_lm`), and so is one under `if TYPE_CHECKING:` (evalkit.journal names the Team in its hints only)."""
    edges = graph()
    assert "evalkit.lm" in edges["evalkit.models"] and "evalkit.team" in edges["evalkit.journal"]
    assert "evalkit.models" not in edges["evalkit.sources"]  # sources names the fields it reads (ModelConf)


# What the cache library may import of the rest of evalkit: the error base and the conf helpers (a method's
# settings fail as a ConfigError), and, for `evalkit.kv.generate` alone, the engine it decodes through and
# what the engine runs (evalkit.turns).
KV_MAY_IMPORT = {"evalkit.errors", "evalkit.config"}
KV_GENERATE_MAY_IMPORT = {"evalkit.engine", "evalkit.turns"}


def test_the_cache_library_imports_nothing_of_the_run_time():
    """evalkit.kv knows no process, journal, runner or model loading: a cache that must agree its kept sets
    across TP ranks is handed an `agree` callable (evalkit.team), never reads module state."""
    edges = graph()
    bad = []
    for name in sorted(n for n in edges if n == "evalkit.kv" or n.startswith("evalkit.kv.")):
        allowed = KV_MAY_IMPORT | (KV_GENERATE_MAY_IMPORT if name == "evalkit.kv.generate" else set())
        outside = {m for m in edges[name] if m.split(".")[:2] != ["evalkit", "kv"] and m != "evalkit"}
        bad += [f"{name} -> {m}" for m in sorted(outside - allowed)]
    assert bad == []


def test_no_module_of_evalkit_keeps_state_behind_a_global_statement():
    """Each axis is an object handed down (style principle 16): no module rebinds its own globals for
    another to read."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}"
        for path in sorted((ROOT / "evalkit").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Global)
    ]
    assert found == []


# The sandbox's two modules (host and boot) stay whole: each is one process's program, read top to bottom.
LONG_MODULES_ALLOWED = {"evalkit/sandbox/_host.py", "evalkit/sandbox/_boot.py"}


def test_no_module_of_evalkit_is_over_450_lines():
    """A module a reader can hold: a longer one has two concepts in it (issue 30's renovation)."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "evalkit").rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert set(long) <= LONG_MODULES_ALLOWED, long
