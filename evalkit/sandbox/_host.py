"""Host side of the sandbox: the per-run directory and uid, spawning the bootstrap, pumping its pipes under a
watchdog, killing and reaping. The public surface is in `evalkit.sandbox`.

One module although long: every part serves one run's life (its uid slot, its locked run dir, its view, its
cgroup, its pipes), and each cleanup must see all of them; split, the pieces would pass that state around."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import itertools
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
ENV_KEEP = {
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
REAP_GRACE_S = 3.0  # how long the bootstrap gets to kill and reap its tree before we SIGKILL its group


@dataclass
class Pumped:
    """What came out of a run: raw streams, the bootstrap's status messages and why we stopped it, if we
    did."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: list[dict] = field(default_factory=list)
    stopped: str | None = None  # "timeout" | "output_limit" | "stopped" (on_event asked)


def uid_range(pid: int | None = None) -> range:
    """The per-run uids this process (or harness process `pid`) hands out."""
    base = UID_FLOOR + ((pid or os.getpid()) % (1 << 19)) * SLOTS
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
DEV_LINKS = (
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
)

# Fallback view ("ro-root", where the allow-list cannot be built): the host's, read-only, with these
# overmounted by an empty tmpfs: secrets (/root, $HOME: tokens, keys, caches) and shared places (other users'
# and runs' files and sockets in /tmp, /var/tmp, /run).
HIDE = ("/root", "~", "/tmp", "/var/tmp", "/run")


# The harness's own top-level packages: their install location (the checkout, or site-packages of a wheel or
# system install, which the view binds) holds its code and every task's data, expected outputs included.
HARNESS_PACKAGES = ("evalkit", "tasks")


def harness_dirs() -> list[str]:
    """Where this harness's packages live (real paths), however it was installed."""
    out = set()
    for name in HARNESS_PACKAGES:
        spec = importlib.util.find_spec(name)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            out.add(os.path.realpath(loc))
    return sorted(out)


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
    harness = [("empty", d) for d in harness_dirs() if any(_within(d, b) for b in binds)]
    return tuple(
        links
        + [("ro", p) for p in binds]
        + [("blank", p) for p in startup_hooks(binds)]
        + harness
        + devices
        + [("link", p, t) for p, t in DEV_LINKS]
    )


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


def repositories() -> list[str]:
    """The git repositories this harness runs from (its packages' and its working dir's): the checkout holds
    results, journals and data, its .git the bundled solutions in every commit. A worktree's .git is a file
    naming a dir inside the main repository's .git, which is returned too."""
    out = set()
    for start in [*harness_dirs(), os.path.realpath(os.getcwd())]:
        d = start
        while d != "/" and not os.path.lexists(os.path.join(d, ".git")):
            d = os.path.dirname(d)
        if d == "/":
            continue
        out.add(d)
        dot = os.path.join(d, ".git")
        if os.path.isfile(dot):
            with open(dot, encoding="utf-8", errors="replace") as f:
                gitdir = f.read().removeprefix("gitdir:").strip()
            common = os.path.realpath(os.path.join(d, gitdir))
            while common != "/" and os.path.basename(common) != ".git":
                common = os.path.dirname(common)
            if common != "/":
                out.add(common)
    return sorted(out)


def hidden_dirs(keep: list[str]) -> list[tuple[str, list[str]]]:
    """(dir to overmount, the kept paths inside it) for each of HIDE and each repository the harness runs
    from that exists and holds no kept path whole (nested entries are hidden with their parent), then each
    harness package dir, even inside a kept path (a wheel in the venv): last, so that no kept path bound back
    over a hidden dir re-exposes it. The bootstrap skips one that an earlier overmount already hid."""
    dirs = {os.path.realpath(os.path.expanduser(d)) for d in HIDE} | set(repositories())
    dirs = {d for d in dirs if d != "/" and os.path.isdir(d) and not any(_within(d, k) for k in keep)}
    out = []
    for d in sorted(dirs):
        if any(_within(d, o) for o in dirs if o != d):
            continue
        inside = [k for k in keep if _within(k, d)]
        inside = [k for k in inside if not any(_within(k, o) for o in inside if o != k)]  # outermost only
        out.append((d, inside))
    return out + [(d, []) for d in harness_dirs() if os.path.isdir(d)]


def _within(path: str, d: str) -> bool:
    return path == d or path.startswith(d + "/")


def make_config(
    root: str, argv: list[str], *, uid, limits: dict, mode: str, require: dict | None, no_fork: bool
) -> dict:
    work = os.path.join(root, "work")
    keep = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable), root)}
    keep = sorted(k for k in keep if os.path.isdir(k))
    env = {**ENV_KEEP, "HOME": work, "TMPDIR": work}
    view = [*base_view(), ("ro", root)]  # the program's files; inside, a fresh tmpfs covers work
    return {
        "mode": mode,
        "require": require,
        "root": root,
        "work": work,
        "uid": uid,
        "argv": argv,
        "env": env,
        "view": view,
        "hide": hidden_dirs(keep),
        "no_fork": no_fork,
        **limits,
    }


# Run dirs are named RUN_PREFIX<harness pid>-* in the temp dir and locked (flock) by the harness process for
# the run's life. A harness killed outright (SIGKILL, or SIGTERM's default action) cannot remove its own: the
# next run sweeps every unlocked one. A dir is created under another name and renamed once locked, so that a
# sweep never takes a fresh one for a leftover.
RUN_PREFIX = "evalkit-sbx-"
_run_locks: dict[str, int] = {}


def run_dirs(pid: int | None = None) -> list[str]:
    """The run dirs in the temp dir: of harness process `pid`, or of any."""
    tmp, out = tempfile.gettempdir(), []
    for name in os.listdir(tmp):
        owner = name.removeprefix(RUN_PREFIX).split("-")[0] if name.startswith(RUN_PREFIX) else ""
        if owner.isdigit() and (pid is None or owner == str(pid)):
            out.append(os.path.join(tmp, name))
    return out


def prepare_root(files: dict[str, str], uid: int | None) -> str:
    """A fresh run directory: the program files (read-only to the program) and an empty `work/` dir."""
    sweep_run_dirs()
    fresh, lock = tempfile.mkdtemp(prefix=f".{RUN_PREFIX}{os.getpid()}-"), None
    root = os.path.join(os.path.dirname(fresh), os.path.basename(fresh)[1:])
    try:
        lock = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # EMFILE with too many workers
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.rename(fresh, root)
    except BaseException:
        if lock is not None:
            os.close(lock)
        os.rmdir(fresh)
        raise
    _run_locks[root] = lock
    try:
        os.chmod(root, 0o755)  # the unprivileged program must reach its files
        for name, text in files.items():
            path = os.path.join(root, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(path, 0o644)
        os.mkdir(os.path.join(root, "work"), 0o700)
        if uid is not None:  # without a mount namespace this dir is the program's cwd as is
            os.chown(os.path.join(root, "work"), uid, uid)
    except BaseException:
        cleanup(root)
        raise
    return root


def sweep_run_dirs() -> None:
    """Remove the run dirs whose harness died (nobody holds their lock)."""
    for path in run_dirs():
        if path in _run_locks:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # locked: a live run
            pass
        finally:
            os.close(fd)


# B's and I's argv[0]: the program reads /proc/1/cmdline, which must not name host paths (Popen's `executable`
# says what runs).
BOOT_ARGV0 = "python3"


def spawn(cfg: dict, cgroup_fd: int | None = None) -> tuple[subprocess.Popen, int, int]:
    """Start the bootstrap in its own session with an empty environment; returns (proc, status_r, events_r).
    Its source and configuration travel on memfds (argv names only their numbers): the program can read
    the cmdline of its init, which must not show host paths or settings."""
    status_r, status_w = os.pipe()
    events_r, events_w = os.pipe()
    cfg = {**cfg, "status_fd": status_w, "events_fd": events_w, "cgroup_fd": cgroup_fd, "parent": os.getpid()}
    boot, conf = _memfd("evalkit-boot", BOOT.read_bytes()), _memfd("evalkit-cfg", json.dumps(cfg).encode())
    argv = [BOOT_ARGV0, "-I", "-S", f"/proc/self/fd/{boot}", str(conf), str(boot)]
    fds = (status_w, events_w, boot, conf) + ((cgroup_fd,) if cgroup_fd is not None else ())
    try:
        proc = subprocess.Popen(
            argv,
            executable=sys.executable,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd=cfg["root"],
            pass_fds=fds,
            start_new_session=True,
        )
    except BaseException:
        for fd in (status_r, events_r):
            os.close(fd)
        raise
    finally:
        for fd in (status_w, events_w, boot, conf):
            os.close(fd)
    return proc, status_r, events_r


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def pump(
    proc,
    status_r: int,
    events_r: int,
    stdin: list[bytes],
    *,
    timeout_s: float,
    output_limit: int,
    on_event: Callable[[dict], bool] | None,
    first_event_s: float | None = None,
) -> Pumped:
    """Feed stdin (the buffers in order, never joined) and read every pipe incrementally until all close or
    the run must stop. The deadline is `first_event_s` (default `timeout_s`) from the start, then `timeout_s`
    from each event on fd 3. Output beyond `output_limit` bytes stops the run: nothing is ever buffered past
    the cap."""
    out, sel = Pumped(), selectors.DefaultSelector()
    reads = {
        proc.stdout.fileno(): out.stdout,
        proc.stderr.fileno(): out.stderr,
        status_r: bytearray(),
        events_r: bytearray(),
    }
    for fd in reads:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    feeder = _Feeder(proc.stdin, stdin, sel)
    deadline = time.monotonic() + (timeout_s if first_event_s is None else first_event_s)
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
    block us), from memoryviews of the caller's buffers: no copy of the input is made here. A program that
    closes its stdin early just gets no more."""

    def __init__(self, stream, buffers: list[bytes], sel) -> None:
        self.stream, self.sel = stream, sel
        self.buffers = (memoryview(b).cast("B") for b in buffers if len(b))
        self.pending = next(self.buffers, None)
        self.fd = stream.fileno()
        if self.pending is not None:
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
            self.pending, self.buffers = None, iter(())
        if self.pending is not None and not len(self.pending):
            self.pending = next(self.buffers, None)
        if self.pending is None:
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
    """Remove a run dir (unlocked first: out of descriptors, the lock's is the one rmtree needs; one that
    cannot be removed now is swept by a later run)."""
    lock = _run_locks.pop(root, None)
    if lock is not None:
        os.close(lock)
    shutil.rmtree(root, ignore_errors=True)


# --- cgroup v2: one memory.max for the whole program ----------------------------------------------------
# RLIMIT_AS caps each process; a cgroup caps the sum (every process, thread, tmpfs page). Run cgroups are made
# in $EVALKIT_SANDBOX_CGROUP, else next to (or under) this process's own cgroup where that directory hands
# the memory controller to its children and we may write it. Elsewhere (cgroup v1 hosts, containers without
# a delegated subtree) there is none, and the sandbox forbids fork instead (see _boot.install_seccomp).
CGROUP_ENV = "EVALKIT_SANDBOX_CGROUP"
_cgroup_runs = itertools.count()


def cgroup_parent() -> str | None:
    """The cgroup v2 directory run cgroups are created in, or None. An explicit $EVALKIT_SANDBOX_CGROUP that
    cannot be used is an error, never a silent fallback."""
    explicit = os.environ.get(CGROUP_ENV)
    if explicit:
        why = cgroup_unusable(explicit)
        if why:
            raise ValueError(f"${CGROUP_ENV}={explicit}: {why}")
        return explicit
    own = own_cgroup()
    for d in [own, os.path.dirname(own)] if own else []:
        if not cgroup_unusable(d):
            return d
    return None


def cgroup_unusable(d: str) -> str:
    """Why run cgroups cannot be made in `d` ("" when they can)."""
    try:
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            controllers = f.read().split()
    except OSError as e:
        return f"not a cgroup v2 directory ({e.strerror})"
    if "memory" not in controllers:
        return "the memory controller is not enabled for its children (cgroup.subtree_control)"
    if not os.access(d, os.W_OK):
        return "not writable by this user"
    return ""


def own_cgroup() -> str | None:
    """This process's cgroup v2 directory on this machine's cgroup2 mount, if any."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields in mounts:
        if rel is not None and fields[fields.index("-") + 1] == "cgroup2":
            root, point = fields[3], fields[4]
            if _within(rel, root) or root == "/":
                return os.path.normpath(point + "/" + os.path.relpath(rel, root))
    return None


def make_cgroup(parent: str, memory_mb: int, nproc: int) -> tuple[str, int]:
    """A fresh run cgroup: memory.max (and no swap), pids.max where the pids controller is on. Returns its
    path and an open fd on its cgroup.procs, for the sandbox's init to join it."""
    path = os.path.join(parent, f"{RUN_PREFIX}{os.getpid()}-{next(_cgroup_runs)}")
    os.mkdir(path)
    try:
        for name, value in (("memory.max", memory_mb << 20), ("memory.swap.max", 0), ("pids.max", nproc)):
            if name == "memory.max" or os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))
        return path, os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    except BaseException:
        os.rmdir(path)
        raise


def sweep_cgroups(parent: str) -> None:
    """Remove the empty run cgroups of harness processes that are gone (killed outright, they could not):
    rmdir refuses a cgroup that still holds a process, and a live harness's are never touched."""
    for name in os.listdir(parent):
        owner = name.removeprefix(RUN_PREFIX).split("-")[0] if name.startswith(RUN_PREFIX) else ""
        if owner.isdigit() and not _alive(int(owner)):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_cgroup(path: str) -> bool:
    """Remove a run cgroup once its processes are gone (killing stragglers); True if its OOM killer fired."""
    oom = False
    with contextlib.suppress(OSError), open(os.path.join(path, "memory.events")) as f:
        oom = any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in f)
    for _ in range(200):
        try:
            os.rmdir(path)
            break
        except OSError:
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
            time.sleep(0.01)
    return oom
