"""LiveCodeBench test driver. Runs INSIDE the sandbox as the program (`evalkit.sandbox.run_program`), never
imported by evalkit: stdlib only.

Reads {"code", "fn_name", "inputs"} as JSON on stdin, executes the candidate the way upstream
`lcb_runner/evaluation/testing_util.py` does, and reports on fd 3 (JSON lines): `ready`, then `compiled` or
`compile_error`, then one `test` event per input with the program's output (`out`) or its exception
(`error`). The expected outputs never enter the sandbox: the grader compares outside and stops this process
at the first failure, and times each step (upstream's per-test `signal.alarm`).
"""

import ast
import contextlib
import json
import os
import sys
from io import StringIO
from types import ModuleType
from unittest.mock import mock_open, patch

# Upstream's prelude (testing_util.import_string), prepended to every candidate.
PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
    "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
    "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
    "import string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\n"
    "import math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)

_events = None  # fd 3, opened by main()


def emit(**event) -> None:
    _events.write(json.dumps(event) + "\n")
    _events.flush()


# --- stdin programs -----------------------------------------------------------------------------------------


def unwrap_main(code: str) -> str:
    """A final `if __name__ == '__main__':` block becomes top-level code (its else branch is dropped)."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            return ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:  # noqa: BLE001 - upstream leaves unparsable code as is; exec reports it
        pass
    return code


def wrap_function(code: str) -> str:
    """Upstream `make_function`: prelude + the top-level imports + everything else inside
    `def wrapped_function():`, so each test re-runs the program body."""
    try:
        tree = ast.parse(code)
    except Exception:  # noqa: BLE001 - upstream returns the code as is; exec then raises the error
        return code
    imports = [s for s in tree.body if isinstance(s, ast.Import | ast.ImportFrom)]
    body = [s for s in tree.body if not isinstance(s, ast.Import | ast.ImportFrom)]
    no_args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    fn = ast.FunctionDef(name="wrapped_function", args=no_args, body=body, decorator_list=[], lineno=-1)
    return PRELUDE + "\n" + ast.unparse(imports) + "\n" + ast.unparse(fn)


class _Buffer:
    """Upstream's `MockBuffer`: `read()` is the whole input, `readline()` always its first line."""

    def __init__(self, text: str) -> None:
        self.data = text.encode("utf-8")

    def read(self, *args):
        return self.data

    def readline(self, *args):
        return self.data.split(b"\n")[0] + b"\n"


class _Stdin:
    """Upstream's `MockStdinWithBuffer`: `read`, `readline` (with its newline, "" at the end), `readlines`
    (split on \\n, no newlines), `.buffer`, anything else from a StringIO. Like upstream it is not iterable:
    `for line in sys.stdin` raises TypeError, a runtime error, and scores stay comparable."""

    def __init__(self, text: str) -> None:
        self.text, self._io, self.buffer = text, StringIO(text), _Buffer(text)

    def read(self, *args):
        return self.text

    def readline(self, *args):
        return self._io.readline(*args)

    def readlines(self, *args):
        return self.text.split("\n")

    def __getattr__(self, name):
        return getattr(self._io, name)


def run_stdin_test(fn, text: str) -> str:
    """One call of the wrapped program with stdin and `open()` mocked; returns what it printed. SystemExit
    ends the program normally (upstream swallows it)."""
    captured, real_stdout = StringIO(), sys.stdout
    # upstream's Capturing does this too (so a bare close() raises TypeError there as well)
    captured.close = lambda x: 1
    sys.stdout = captured
    try:
        with (
            patch("builtins.open", mock_open(read_data=text)),
            patch("sys.stdin", _Stdin(text)),
            contextlib.suppress(SystemExit),
        ):
            fn()
    finally:
        sys.stdout = real_stdout
    return captured.getvalue()


# --- functional (LeetCode) programs ---------------------------------------------------------------------


def to_json(value) -> str | None:
    """The call's result as JSON text for the grader, or None when JSON cannot carry it faithfully (then it
    cannot equal the JSON-decoded expected value either, and upstream's `==` would fail too). Tuples become
    lists first (upstream), numpy scalars plain numbers (numpy's `==` with a number holds)."""
    if isinstance(value, tuple):
        value = list(value)

    def scalar(o):
        if type(o).__module__ == "numpy" and getattr(o, "ndim", None) == 0:
            return o.item()
        raise TypeError(type(o).__name__)

    try:
        text = json.dumps(value, default=scalar)
        return text if json.loads(text) == value else None
    except (TypeError, ValueError, RecursionError):
        return None


# --- main -----------------------------------------------------------------------------------------------


def compile_candidate(code: str, fn_name: str | None):
    """exec the program as upstream does; returns the callable to test."""
    module = ModuleType("tmp_sol", "")
    source = wrap_function(unwrap_main(code)) if fn_name is None else PRELUDE + "\n\n" + code
    exec(source, module.__dict__)
    if fn_name is None:
        return module.wrapped_function
    holder = module.Solution() if "class Solution" in source else module  # upstream's textual test
    return getattr(holder, fn_name)


def main() -> None:
    global _events
    _events = open(3, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.set_int_max_str_digits(50000)  # upstream sets it in the grading process
    job = json.loads(sys.stdin.read())
    functional = job["fn_name"] is not None
    if functional:  # its prints are never graded, and must not fill the output cap
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    emit(ev="ready")
    try:
        fn = compile_candidate(job["code"], job["fn_name"])
    except BaseException as e:  # noqa: BLE001 - the candidate's failure is the result
        emit(ev="compile_error", error=repr(e)[:1000])
        return
    emit(ev="compiled")
    for i, text in enumerate(job["inputs"]):
        try:
            if functional:
                out = to_json(fn(*[json.loads(line) for line in text.split("\n")]))
            else:
                out = run_stdin_test(fn, text)
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt of a functional call too
            emit(ev="test", i=i, error=repr(e)[:1000])
            return
        emit(ev="test", i=i, out=out)


if __name__ == "__main__":
    main()
