"""No code outside `evalkit/kv/methods.py` asks what kind of method it holds (house style, principle 16): a
method's behaviour is an object it names (its `Evictor`, `evalkit.kv.evict`) or a hook it answers, so a new
method is one dataclass (plus, for a decode-time one, one `Evictor` subclass) and no `if` elsewhere changes.

Read from the source of evalkit/ and tasks/ (nothing imported but the method classes, for their names). An
offence is:
- the decode-time kind attribute that the evictor replaced (`.evict`, `evicting`), however it is read;
- a comparison (`==`, `!=`, `in`, `is`) with a method's name, or a decode-time kind ("refit"), as a string;
- `isinstance` / `issubclass` against a method class.
Two exceptions, each with its reason: `"full"` (the uncompressed baseline is a role every report pairs
against, not a behaviour), and `evalkit/memory/`, which models finished runs from the names they recorded,
with its own name table (`memory/sim.py: METHODS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from evalkit.kv import methods

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "evalkit/kv/methods.py"
EXEMPT = [ROOT / "evalkit/memory"]
KIND_ATTRIBUTES = {"evict", "evicting"}


def method_classes() -> list[type]:
    out, todo = [], [methods.KVMethod]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if c.__module__ == methods.__name__]


KIND_NAMES = {c.name for c in method_classes() if "name" in vars(c)} - {"full"} | {"refit"}
CLASS_NAMES = {c.__name__ for c in method_classes()} - {"KVMethod"}  # being a method at all is no kind


def _names_a_kind(node: ast.AST) -> bool:
    """A string constant naming a kind, or a literal tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in KIND_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def offences(source: str) -> list[tuple[int, str]]:
    """(line, code) of every kind test in a module's source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Attribute):
            hit = node.attr in KIND_ATTRIBUTES
        elif isinstance(node, ast.Name):
            hit = node.id in KIND_ATTRIBUTES - {"evict"}  # `evict` alone is a fine verb for a function
        elif isinstance(node, ast.Compare):
            hit = any(_names_a_kind(x) for x in [node.left, *node.comparators])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                hit = any(n.id in CLASS_NAMES for n in ast.walk(node.args[1]) if isinstance(n, ast.Name))
            elif node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2:
                hit = isinstance(node.args[1], ast.Constant) and node.args[1].value in KIND_ATTRIBUTES
        if hit:
            out.append((node.lineno, ast.unparse(node)))
    return out


def sources() -> list[Path]:
    paths = [p for package in ("evalkit", "tasks") for p in sorted((ROOT / package).rglob("*.py"))]
    return [p for p in paths if p != OWNER and not any(p.is_relative_to(e) for e in EXEMPT)]


def test_no_code_outside_the_methods_tests_a_method_kind():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in sources()
        for line, code in offences(path.read_text(encoding="utf-8"))
    ]
    assert not found, "a method kind tested outside kv/methods.py:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_test():
    """The patterns catch what the evictor replaced (these lines are from before it) and what would
    replace them, and leave alone what is no kind test."""
    caught = [
        'accumulates = method.evict == "h2o"',
        'if self.evicting == "refit" and any(layer.expanded for layer in like.layers): pass',
        "for scoring in (True, False) if method.evict else (True,): pass",
        "if kind is None: pass\nkind = p.method.evict",
        'if method.name in ("h2o", "snapkv_decode"): pass',
        'if "snapstream" != cfg.method.name: pass',
        "if isinstance(method, (SnapKV, H2O)): pass",
        'x = getattr(method, "evict", None)',
    ]
    for code in caught:
        assert offences(code), code
    fine = [
        'if method.name == "full": pass',  # the baseline's role
        'for name in ("streamingllm", "snapkv", "snapstream"): pass',  # a list of methods to build
        "pool.evictor.after_step(pool, active)",
        "def evict(x): return x",
    ]
    for code in fine:
        assert not offences(code), code
    assert {"h2o", "snapkv_decode", "snapkv", "snapstream", "streamingllm", "refit"} <= KIND_NAMES
