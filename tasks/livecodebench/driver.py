"""LiveCodeBench test driver. Runs INSIDE the sandbox as the program (`evalkit.sandbox.run_program`), never
imported by evalkit: stdlib only.

Executes the candidate the way upstream `lcb_runner/evaluation/testing_util.py` (LiveCodeBench@28fef95) does
in its grading process, and reports on fd 3 (JSON lines): `ready`, then `compiled` or `compile_error`, then
one `test` event per input: a stdin program's output (`out`), a functional call's return value (`json`: its
JSON text when it is made of JSON types only; else `pickle`: base64 of its pickle, or `unpicklable`), or
the exception (`error`). The grader stops this process at the first failure and times each step (upstream's
per-test `signal.alarm`).

No expected output ever enters this process: the candidate shares it (and could read the driver's stream or
write to its event pipe). The grader compares outside: stdin outputs and JSON values on the host, other
values (a Fraction, a Decimal, numpy) by upstream's `prediction == json.loads(expected)` in a fresh
sandboxed process (`compare.py`) that unpickles only stdlib and numpy types.

stdin carries one JSON header line {"code", "fn_name", "sizes"} and then the tests' inputs as raw UTF-8,
back to back (`sizes[i]` bytes each). Each input is read when its test starts and decoded once: a 150 MB
input is never held twice as text.
"""

import ast
import base64
import collections
import contextlib
import importlib.util
import json
import os
import pickle
import sys
from io import BytesIO, StringIO
from types import ModuleType
from unittest.mock import mock_open, patch

# Upstream's prelude (testing_util.import_string), prepended to every candidate.
PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random "
    "import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator "
    "import *\nfrom io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing "
    "import *\nimport string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport "
    "bisect\nimport copy\nimport math\nimport random\nimport statistics\nimport itertools\nimport "
    "functools\nimport operator\nimport io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)
# Upstream grades in processes forked from the documented command (README; PR #71 for the R1 models), whose
# argv they inherit: `fileinput.input()` opens each argument (through the mocked open) and sys.argv shows
# them.
ARGV = [
    "lcb_runner/runner/main.py",
    "--model",
    "deepseek-ai/DeepSeek-R1",
    "--scenario",
    "codegeneration",
    "--evaluate",
]
# What upstream's `reliability_guard()` disables before it compiles the candidate (set to None).
GUARD = {
    "builtins": ("quit", "help"),
    "os": ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
           "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod",
           "chown", "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen",),
}  # fmt: skip
GUARD_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")

_events = None  # fd 3, opened by main()


def emit(**event) -> None:
    _events.write(json.dumps(event) + "\n")
    _events.flush()


# --- the grading process, as upstream's ---------------------------------------------------------------------


def as_upstream_process() -> None:
    """The process state upstream's candidates meet. Its grader is a multiprocessing child, whose stdin is
    /dev/null (`multiprocessing.util._close_stdin`); its stdout and stderr are not read (here they go to
    /dev/null, so a chatty program cannot fill the sandbox's output cap); argv is the runner's."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - as multiprocessing leaves it
    sys.argv = list(ARGV)
    sys.set_int_max_str_digits(50000)  # upstream sets it in the grading process


# What upstream's grading process had imported before its guard ran (testing_util.py and
# compute_code_generation_metrics.py import these): there a candidate's `import numpy` finds it loaded.
# Imported after the guard they fail (numpy's import calls os.putenv, multiprocessing's os.getcwd).
PRELOAD = ("numpy", "multiprocessing", "concurrent.futures")


def preload() -> None:
    """Import PRELOAD; one that is installed must load (a failure, e.g. too little memory, is the harness's:
    the driver then never reports ready), one that is not is skipped, as it would be missing upstream too."""
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            __import__(name)


def reliability_guard() -> None:
    """Upstream's `reliability_guard()` (no memory limit: upstream never passes one): the same functions
    become None, the same modules unimportable. The sandbox is the security; this is for equal outcomes."""
    import builtins
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"  # before os.putenv is gone, as upstream
    modules = {"builtins": builtins, "os": os, "shutil": shutil, "subprocess": subprocess}
    for module, names in GUARD.items():
        for name in names:
            setattr(modules[module], name, None)
    for name in GUARD_MODULES:
        sys.modules[name] = None


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


class _Lines:
    """`iter(text.split("\\n"))` without the list: the same strings (no newlines), then StopIteration."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.pos < 0:
            raise StopIteration
        end = self.text.find("\n", self.pos)
        line = self.text[self.pos :] if end < 0 else self.text[self.pos : end]
        self.pos = -1 if end < 0 else end + 1
        return line


class _Buffer:
    """Upstream's `MockBuffer`: `read()` is the whole input as bytes, `readline()` always its first line."""

    def __init__(self, data: bytes) -> None:
        self.inputs = data

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        end = self.inputs.find(b"\n")
        return (self.inputs if end < 0 else self.inputs[:end]) + b"\n"


class _Stdin:
    """Upstream's `MockStdinWithBuffer` (the `sys.stdin` a program sees): `read()` the whole input,
    `readline()` the next line with its newline ("" at the end), `readlines()` split on \\n without newlines,
    `.buffer`, anything else from a StringIO of the input. Like upstream it is not iterable. The StringIO
    (4 bytes per character) is only made when something beyond a plain `readline()` needs it, at the same
    position."""

    def __init__(self, text: str, data: bytes | None) -> None:
        self.inputs, self._pos, self._io = text, 0, None
        self.buffer = _Buffer(text.encode("utf-8") if data is None else data)  # upstream encodes: may raise

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        if args or self._io is not None:
            return self.__getattr__("readline")(*args)
        end = self.inputs.find("\n", self._pos)
        end = len(self.inputs) if end < 0 else end + 1
        line, self._pos = self.inputs[self._pos : end], end
        return line

    def readlines(self, *args):
        return self.inputs.split("\n")

    def __getattr__(self, name):
        if self._io is None:
            self._io = StringIO(self.inputs)
            self._io.seek(self._pos)
        return getattr(self._io, name)


def _lazy_mock_open(text: str):
    """`mock_open(read_data=text)`, made on the first call only: it copies the input into a StringIO, and
    candidates rarely reach it (the prelude's `from builtins import *` binds the real open first)."""
    made = []

    def opener(*args, **kwargs):
        if not made:
            made.append(mock_open(read_data=text))
        return made[0](*args, **kwargs)

    return opener


def run_stdin_test(fn, text: str, data: bytes | None) -> str:
    """One call of the wrapped program under upstream's stacked patches (`call_method`), entered in its
    order: `read`, `readlines`, `readline` patched on the real `sys.stdin` object (so a program that bound
    it before, `from sys import stdin`, still reads the input; its `readline` returns lines without their
    newline and raises StopIteration at the end), then `sys.stdin` swapped for the mock, then
    `builtins.open`. Returns what it printed; SystemExit ends the program normally (upstream swallows it)."""
    captured, real_stdout = StringIO(), sys.stdout
    captured.close = lambda x: 1  # upstream's Capturing does this (so a bare close() raises TypeError there)
    lines = _Lines(text)
    sys.stdout = captured
    try:
        with (
            patch("sys.stdin.read", lambda *args: text),
            patch("sys.stdin.readlines", lambda *args: text.split("\n")),
            patch("sys.stdin.readline", lambda *args: next(lines)),
            patch("sys.stdin", _Stdin(text, data)),
            patch("builtins.open", _lazy_mock_open(text)),
            contextlib.suppress(SystemExit),
        ):
            fn()
    finally:
        sys.stdout = real_stdout
    return captured.getvalue()


# --- functional (LeetCode) programs ---------------------------------------------------------------------


JSON_DEPTH = 100  # deeper values go to the comparator, whose recursion limit is upstream's 50000
SCALARS = frozenset({str, int, float, bool, type(None)})


def plain(value, depth: int = 0) -> bool:
    """Whether `value` is made of JSON types only (exactly: no subclasses, str keys), checked without running
    any of the candidate's code. Its JSON text then decodes to an equal value, and upstream's `==` on such
    values is the host's `==` on the decoded ones."""
    kind = type(value)
    if kind in SCALARS:
        return True
    if depth >= JSON_DEPTH:
        return False
    if kind is list:
        return all(type(v) in SCALARS or plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) is str and (type(v) in SCALARS or plain(v, depth + 1)) for k, v in value.items())
    return False


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is collections.defaultdict:  # its factory (often a lambda) plays no part in `==`
            return collections.defaultdict, (), None, None, iter(obj.items())
        return NotImplemented


def report_call(prediction) -> dict:
    """The call's return value for the grader, tuples made lists first (upstream): its JSON text, else its
    pickle (protocol 4), else why it cannot be pickled (a class of the program's own: graded wrong)."""
    if isinstance(prediction, tuple):
        prediction = list(prediction)
    if plain(prediction):
        try:
            return {"json": json.dumps(prediction)}
        except ValueError:  # an int beyond upstream's 50000 digits: pickled instead
            pass
    buf = BytesIO()
    try:
        _Pickler(buf, protocol=4).dump(prediction)
    except BaseException as e:  # noqa: BLE001 - the candidate's __reduce__ may raise anything
        return {"unpicklable": repr(e)[:1000]}
    return {"pickle": base64.b64encode(buf.getvalue()).decode()}


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


def read_input(job, size: int) -> tuple[str, bytes | None]:
    """The next test's input: (text, its UTF-8 bytes), or bytes None when the text holds lone surrogates
    (JSON allows them; upstream's MockBuffer then fails to encode it, and so does ours)."""
    data = job.read(size)
    if len(data) != size:
        raise EOFError(f"test input truncated: {len(data)} of {size} bytes")
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogatepass"), None


def run_tests(fn, job, header: dict) -> None:
    for i, size in enumerate(header["sizes"]):
        try:
            text, data = read_input(job, size)
            if header["fn_name"] is None:
                event = {"out": run_stdin_test(fn, text, data)}
            else:
                event = report_call(fn(*[json.loads(line) for line in text.split("\n")]))
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt of a functional call too
            emit(ev="test", i=i, error=repr(e)[:1000])
            return
        emit(ev="test", i=i, **event)


def main() -> None:
    global _events
    _events = open(3, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
    job = open(os.dup(0), "rb")  # noqa: SIM115 - the host's stream, off fd 0 (which becomes /dev/null)
    header = json.loads(job.readline())
    preload()  # while stderr still reaches the host: a failure here is reported there
    as_upstream_process()
    emit(ev="ready")
    reliability_guard()
    try:
        fn = compile_candidate(header["code"], header["fn_name"])
    except BaseException as e:  # noqa: BLE001 - the candidate's failure is the result
        emit(ev="compile_error", error=repr(e)[:1000])
        return
    emit(ev="compiled")
    run_tests(fn, job, header)


if __name__ == "__main__":
    main()
