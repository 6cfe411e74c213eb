"""The one base of every error a user can fix: bad configuration, data, run folders, models, servers, report
inputs. Each message says what is wrong and how to fix it; each command line (`python -m evalkit`, the
leaderboard, the report, the memory report, the demo, the bench) catches `EvalkitError` once, prints
`<program>: error: <message>` and exits with status 2, instead of a traceback. Any other exception is a bug.

Each subclass also keeps the builtin base its callers catch (a ConfigError is a ValueError, a ModelLoadError a
RuntimeError, ...).
"""

from __future__ import annotations

import sys


class EvalkitError(Exception):
    """Bad input or state the user can fix; the message names the fix."""


def exit_with(program: str, error: EvalkitError) -> None:
    """The one way a command line reports an EvalkitError: one line on stderr, exit status 2."""
    print(f"{program}: error: {error}", file=sys.stderr)
    sys.exit(2)
