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


class OutputError(EvalkitError):
    """An output that cannot be written (a read-only or full location): names the file and the reason."""

    @classmethod
    def of(cls, e: OSError) -> OutputError:
        name = e.filename2 or e.filename  # os.replace: filename is the temp file, filename2 the output
        where = f"{name}: " if name else ""
        return cls(f"cannot write {where}{e.strerror or e} (give a writable results_dir, or free space)")


def exit_with(program: str, error: EvalkitError) -> None:
    """The one way a command line reports an EvalkitError: one line on stderr, exit status 2."""
    print(f"{program}: error: {error}", file=sys.stderr)
    sys.exit(2)
