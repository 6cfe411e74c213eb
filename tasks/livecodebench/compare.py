"""LiveCodeBench comparator for functional answers that are not JSON values. Runs INSIDE the sandbox as the
program (`evalkit.sandbox.run_program`), in a fresh process with no candidate code loaded: stdlib only
(numpy is imported only when the answer is a numpy value).

Upstream (`grade_call_based` in testing_util.py, LiveCodeBench@28fef95) judges a call by the answer's own
`prediction == json.loads(expected)`, so a Fraction, a Decimal or a numpy array decides it by its type's
`==`. The candidate's process never sees the expected output: its driver pickles the answer, and this process
unpickles it and compares. The pickle is the candidate's bytes (it can write anything to the driver's event
pipe), so unpickling admits only the stdlib and numpy types in ALLOWED, whose construction runs no code of
the candidate's: anything else (a class of the program, `eval`, `os.system`) is refused, and graded a wrong
answer by the host.

stdin: one JSON header line {"sizes": [pickle bytes, expected bytes]}, then the pickle, then the expected
output's UTF-8 text. fd 3 (JSON lines): `ready` once the input is read, then one `verdict`: `passed`
(bool), `error` (the comparison raised: upstream's runtime error) or `refused` (the pickle was not admitted).
"""

import json
import os
import pickle
import sys
from io import BytesIO

# What may be unpickled: stdlib and numpy types an answer can hold, whose `==` with a JSON value can hold or
# raise, and the builtins their pickles name. Nothing that calls, imports or evaluates anything else.
ALLOWED = {
    "builtins": {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                 "object", "range", "set", "slice", "str", "tuple"},
    "collections": {"Counter", "OrderedDict", "UserDict", "UserList", "UserString", "defaultdict", "deque"},
    "decimal": {"Decimal"},
    "fractions": {"Fraction"},
    "numpy": {"dtype", "ndarray"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},  # numpy 1
    "numpy._core.multiarray": {"_reconstruct", "scalar"},  # numpy 2
}  # fmt: skip


class Refused(Exception):
    """The pickle names something outside ALLOWED, or is not a pickle."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name not in ALLOWED.get(module, ()):
            raise Refused(f"{module}.{name} is not admitted")
        return super().find_class(module, name)


def unpickle(data: bytes):
    try:
        return _Unpickler(BytesIO(data)).load()
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - malformed bytes: the candidate's, never a verdict
        raise Refused(repr(e)[:1000]) from None


def call_passed(prediction, expected) -> bool:
    """Upstream's functional verdict (`grade_call_based`): tuples become lists, then
    `tmp_result = prediction == gt_out; if not tmp_result: <wrong answer>`. Whatever that raises (a numpy
    array of several elements has no truth value; a signalling Decimal NaN cannot be compared) is the test's
    error, as upstream's `except Exception` makes it a runtime error (-4)."""
    if isinstance(prediction, tuple):
        prediction = list(prediction)
    return bool(prediction == expected)


def main() -> None:
    events = open(3, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process

    def emit(**event) -> None:
        events.write(json.dumps(event) + "\n")
        events.flush()

    job = open(os.dup(0), "rb")  # noqa: SIM115
    sizes = json.loads(job.readline())["sizes"]
    data, expected = job.read(sizes[0]), job.read(sizes[1]).decode("utf-8", "surrogatepass")
    # The state of upstream's grading process: the prelude's recursion limit, the metrics module's int limit.
    sys.setrecursionlimit(50000)
    sys.set_int_max_str_digits(50000)
    emit(ev="ready")
    try:
        prediction = unpickle(data)
    except Refused as e:
        emit(ev="verdict", refused=str(e))
        return
    try:
        emit(ev="verdict", passed=call_passed(prediction, json.loads(expected)))
    except Exception as e:  # noqa: BLE001 - upstream's `except Exception`: a runtime error
        emit(ev="verdict", error=repr(e)[:1000])


if __name__ == "__main__":
    main()
