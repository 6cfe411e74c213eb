"""Host side of the sandbox: the per-run directory and uid, spawning the bootstrap, pumping its pipes under a
watchdog, killing and reaping. The public surface is in `evalkit.sandbox`."""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BOOT = Path(__file__).with_name("_boot.py")
# Root runs each program under its own uid: it owns no file, and RLIMIT_NPROC then counts this run only (the
# kernel never enforces NPROC for uid 0). Taken from a range no distribution allocates, 1024 per harness
# process, offset by its pid (read at each call: a forked harness gets its own range).
UID_FLOOR, SLOTS = 1_500_000_000, 1024
_free_slots = list(range(SLOTS))
_slots_lock = threading.Lock()
ENV_KEEP = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PATH": "/usr/local/bin:/usr/bin:/bin",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
REAP_GRACE_S = 3.0  # how long the bootstrap gets to kill and reap its tree before we SIGKILL its group


@dataclass
class Pumped:
    """What came out of a run: raw streams, the bootstrap's status messages and why we stopped it, if we did."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: list[dict] = field(default_factory=list)
    stopped: str | None = None  # "timeout" | "output_limit" | "stopped" (on_event asked)


def uid_range() -> range:
    """The per-run uids this process hands out."""
    base = UID_FLOOR + (os.getpid() % (1 << 19)) * SLOTS
    return range(base, base + SLOTS)


def acquire_uid() -> int | None:
    if os.geteuid() != 0:
        return None
    with _slots_lock:
        if not _free_slots:
            raise RuntimeError(f"more than {SLOTS} concurrent sandbox runs in one process")
        return uid_range()[_free_slots.pop()]


def release_uid(uid: int | None) -> None:
    if uid is not None:
        with _slots_lock:
            _free_slots.append((uid - UID_FLOOR) % SLOTS)


# The program's whole file-system view ("allowlist"): an empty tmpfs root holding, at their host paths, these
# when they exist (read-only binds; top-level symlinks such as /lib -> usr/lib copied as symlinks), the
# interpreter's prefixes and the run dir. Nothing else of the host: no checkout, results or task data, no
# home, no sockets. The loader needs ld.so.cache (else it searches slowly), datetime the local time zone.
SYSTEM = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
             ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"))  # fmt: skip

# Fallback view ("ro-root", where the allow-list cannot be built): the host's, read-only, with these
# overmounted by an empty tmpfs: secrets (/root, $HOME: tokens, keys, caches) and shared places (other users'
# and runs' files and sockets in /tmp, /var/tmp, /run).
HIDE = ("/root", "~", "/tmp", "/var/tmp", "/run")


def interpreter() -> str:
    """The executable to run programs with: sys.executable under its directory's real path, which is where the
    view binds it (a venv's python symlink itself stays, so that Python still finds its pyvenv.cfg)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


@functools.cache
def base_view() -> tuple[tuple[str, ...], ...]:
    """The run-independent steps of the allow-list view, in order, for the bootstrap: ("link", path, target)
    makes a symlink, ("ro", path) binds the host path read-only, ("blank", path) overmounts a file with
    /dev/null, ("dev", path) binds a device node."""
    links = [("link", p, os.readlink(p)) for p in SYSTEM if os.path.islink(p)]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)} | {os.path.dirname(interpreter())}
    binds = _outermost([p for p in SYSTEM if os.path.exists(p) and not os.path.islink(p)] + sorted(prefixes))
    devices = [("dev", p) for p in DEVICES if os.path.exists(p)]
    return tuple(links + [("ro", p) for p in binds] + [("blank", p) for p in startup_hooks(binds)] + devices
                 + [("link", p, t) for p, t in DEV_LINKS])  # fmt: skip


def startup_hooks(binds: list[str]) -> list[str]:
    """The .pth files in the view's site-packages that run code at every interpreter start (an `import` line).
    They serve the harness's tooling (this checkout's editable install, the lm-eval plugin), import code the
    view does not hold, and would print an error into every program's stderr; blanked, they cost nothing."""
    out = []
    for d in sorted({os.path.realpath(p) for p in site.getsitepackages()}):
        if not os.path.isdir(d) or not any(_within(d, b) for b in binds):
            continue
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if name.endswith(".pth") and os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    if any(line.startswith(("import ", "import\t")) for line in f):
                        out.append(path)
    return out


def _outermost(paths: list[str]) -> list[str]:
    paths = sorted({p for p in paths if p != "/"})
    return [p for p in paths if not any(_within(p, o) for o in paths if o != p)]


def hidden_dirs(keep: list[str]) -> list[tuple[str, list[str]]]:
    """(dir to overmount, the kept paths inside it) for each of HIDE that exists and holds no kept path
    whole; nested HIDE entries are hidden with their parent."""
    dirs = {os.path.realpath(os.path.expanduser(d)) for d in HIDE}
    dirs = {d for d in dirs if d != "/" and os.path.isdir(d) and not any(_within(d, k) for k in keep)}
    out = []
    for d in sorted(dirs):
        if any(_within(d, o) for o in dirs if o != d):
            continue
        inside = [k for k in keep if _within(k, d)]
        inside = [k for k in inside if not any(_within(k, o) for o in inside if o != k)]  # outermost only
        out.append((d, inside))
    return out


def _within(path: str, d: str) -> bool:
    return path == d or path.startswith(d + "/")


def make_config(root: str, argv: list[str], *, uid, limits: dict, mode: str, require: dict | None) -> dict:
    work = os.path.join(root, "work")
    keep = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable), root)}
    keep = sorted(k for k in keep if os.path.isdir(k))
    env = {**ENV_KEEP, "HOME": work, "TMPDIR": work}
    view = [*base_view(), ("ro", root)]  # the program's files; inside, a fresh tmpfs covers work
    return {"mode": mode, "require": require, "root": root, "work": work, "uid": uid, "argv": argv,
            "env": env, "view": view, "hide": hidden_dirs(keep), **limits}  # fmt: skip


def prepare_root(files: dict[str, str], uid: int | None) -> str:
    """A fresh run directory: the program files (read-only to the program) and an empty `work/` dir."""
    root = tempfile.mkdtemp(prefix="evalkit-sbx-")
    os.chmod(root, 0o755)  # the unprivileged program must reach its files
    for name, text in files.items():
        path = os.path.join(root, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o644)
    os.mkdir(os.path.join(root, "work"), 0o700)
    if uid is not None:  # without a mount namespace this dir is the program's cwd as is
        os.chown(os.path.join(root, "work"), uid, uid)
    return root


def spawn(cfg: dict) -> tuple[subprocess.Popen, int, int]:
    """Start the bootstrap in its own session with an empty environment; returns (proc, status_r, events_r)."""
    status_r, status_w = os.pipe()
    events_r, events_w = os.pipe()
    cfg = {**cfg, "status_fd": status_w, "events_fd": events_w}
    argv = [sys.executable, "-I", "-S", str(BOOT), json.dumps(cfg)]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={}, cwd=cfg["root"], pass_fds=(status_w, events_w),
                                start_new_session=True)  # fmt: skip
    except BaseException:
        for fd in (status_r, events_r):
            os.close(fd)
        raise
    finally:
        os.close(status_w)
        os.close(events_w)
    return proc, status_r, events_r


def pump(proc, status_r: int, events_r: int, stdin: bytes, *, timeout_s: float, output_limit: int,
         on_event: Callable[[dict], bool] | None) -> Pumped:  # fmt: skip
    """Feed stdin and read every pipe incrementally until all close or the run must stop. The deadline is
    `timeout_s` from the start, re-armed by each event on fd 3. Output beyond `output_limit` bytes stops the
    run: nothing is ever buffered past the cap."""
    out, sel = Pumped(), selectors.DefaultSelector()
    reads = {proc.stdout.fileno(): out.stdout, proc.stderr.fileno(): out.stderr,
             status_r: bytearray(), events_r: bytearray()}  # fmt: skip
    for fd in reads:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    feeder = _Feeder(proc.stdin, stdin, sel)
    deadline = time.monotonic() + timeout_s
    try:
        while sel.get_map() and out.stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                out.stopped = "timeout"
                break
            for key, _ in sel.select(min(left, 1.0)):
                if key.fd == feeder.fd:
                    feeder.write()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = reads[key.fd]
                buf += chunk
                if key.fd == status_r:
                    out.status += _lines(buf, chunk)
                elif key.fd == events_r:
                    out.stopped, progressed = _events(buf, chunk, on_event, output_limit)
                    deadline = time.monotonic() + timeout_s if progressed else deadline
                elif len(out.stdout) + len(out.stderr) > output_limit:
                    out.stopped = "output_limit"
                if out.stopped:
                    break
    finally:
        sel.close()
        os.close(status_r)
        os.close(events_r)
    return out


def _events(buf: bytearray, chunk: bytes, on_event, limit: int) -> tuple[str | None, bool]:
    """Hand complete event lines to `on_event`; returns (stop reason or None, whether any event came)."""
    if on_event is None:  # nobody listens: fd 3 is just another way to write nothing
        del buf[:]
        return None, False
    if len(buf) > limit:  # one line longer than the cap
        return "output_limit", False
    events = _lines(buf, chunk)
    for ev in events:
        if not on_event(ev):
            return "stopped", True
    return None, bool(events)


class _Feeder:
    """Writes stdin in non-blocking chunks as the program reads it (so a program that never reads cannot
    block us); a program that closes its stdin early just gets no more."""

    def __init__(self, stream, data: bytes, sel) -> None:
        self.stream, self.pending, self.sel = stream, memoryview(data), sel
        self.fd = stream.fileno()
        if self.pending:
            os.set_blocking(self.fd, False)
            sel.register(self.fd, selectors.EVENT_WRITE)
        else:
            stream.close()

    def write(self) -> None:
        try:
            self.pending = self.pending[os.write(self.fd, self.pending[: 1 << 16]) :]
        except BlockingIOError:
            return
        except BrokenPipeError:
            self.pending = self.pending[:0]
        if not self.pending:
            self.sel.unregister(self.fd)
            self.stream.close()


def _lines(buf: bytearray, chunk: bytes) -> list[dict]:
    """Pop complete JSON lines off the buffer (only when the new `chunk` ended one: a long line is not
    re-scanned per chunk); a line that is not a JSON object becomes {"garbage": ...}."""
    if b"\n" not in chunk:
        return []
    *lines, rest = bytes(buf).split(b"\n")
    del buf[: len(buf) - len(rest)]
    msgs = []
    for line in lines:
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):  # the candidate can write to this pipe too
            msg = None
        msgs.append(msg if isinstance(msg, dict) else {"garbage": line[:200].decode(errors="replace")})
    return msgs


def reap(proc: subprocess.Popen, kill: bool) -> None:
    """Kill (when asked) and reap the bootstrap; it kills and reaps its own tree. Our SIGKILL to its group is
    the fallback only, sent while it is unreaped so the group id cannot have been recycled."""
    if kill:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(REAP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream and not stream.closed:
            stream.close()


def cleanup(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
