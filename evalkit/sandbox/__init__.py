"""Run untrusted (model-generated) Python programs isolated by the operating system.

Each program runs in a fresh process tree, in its own session, with an empty environment (HOME and TMPDIR
point into its own size-capped tmpfs working dir), stdin from a pipe and its output read incrementally and
cut at a cap. Where the machine allows (`isolation()` reports what it does): new network namespace (no
network at all), new PID namespace (all descendants die with the program), new IPC/UTS namespaces, a mount
namespace whose root is built from an empty tmpfs holding only what the interpreter needs, read-only (/usr,
/lib*, the interpreter's prefixes, ld.so.cache, a few device nodes, the run's own dir, the PID namespace's
/proc) and nothing else of the host (no checkout, results or task data, home, sockets; evalkit's own package
dirs, where a wheel or system install put them inside a bound prefix, are mounted empty) - or, where that
cannot be built, the host's file system read-only with /root, $HOME, /tmp, /var/tmp, /run and the harness's
checkout emptied (refused unless `allow_unisolated`: other repositories and data stay readable) - and a
per-run unprivileged uid without supplementary groups (as root) or a user namespace (otherwise); a seccomp
filter that refuses new namespaces (no nested user namespace) and the kernel keyrings (nothing passes from
one run to the next); the program's total memory capped by a cgroup v2 `memory.max` where one is delegated
to us, else by refusing fork (seccomp) so that RLIMIT_AS covers its one process, with the memory that is no
address space refused or capped (see _boot's seccomp section). Always: setrlimit AS/CPU/FSIZE/NPROC/NOFILE/
CORE and no_new_privs. The bootstrap's source and settings come on memfds, never on a command line the
program could read. `run_program` refuses a machine that gives no network namespace, no allow-list view,
neither a PID namespace nor the uid drop, or no bound on total memory (see `missing_isolation`). A timeout,
a cap breach or the caller's `on_event` stop kills the whole tree; no descendant outlives a run, and every
process is reaped, by the sandbox itself (the machine's PID 1 need not reap). Nothing outlives the harness
either: the bootstrap, its init and the program die with it (parent-death signals), and a run dir it could
not remove is swept by the next run. Upstream LiveCodeBench's `reliability_guard` is not a sandbox; this
replaces it. Implementation: `_host.py` (this side), `_boot.py` (the bootstrap inside).

Programs may report progress as JSON lines on fd 3: `run_program(..., on_event=f)` calls `f(event)` for
each (return False to stop the run), and each event re-arms the `timeout_s` watchdog (the first may get
longer: `first_event_s`, for start-up). A grader thus runs a
driver that executes many tests in one process and stops it at the first failure.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from evalkit.errors import EvalkitError
from evalkit.sandbox import _host

OUTPUT_LIMIT = 32 << 20  # bytes of stdout+stderr (and per event line) before the run is cut
STATUSES = ("ok", "runtime_error", "memory", "timeout", "output_limit", "killed", "stopped", "sandbox_error")


class SandboxError(EvalkitError, RuntimeError):
    """The sandbox itself failed or refused to run; never a property of the program."""


@dataclass
class RunResult:
    status: str  # one of STATUSES
    stdout: str
    stderr: str
    returncode: int | None  # exit code, -signal when killed by one, None when we stopped the run
    wall_s: float
    error: str = ""  # the sandbox's own message when status == "sandbox_error"


_probe_lock = threading.Lock()
_probed: dict = {}  # this machine's isolation, probed once per process (a fact of the host, not of a run)


def isolation() -> dict:
    """What this machine allows, probed once per process by running an empty program:
    {"network": "netns"|None, "filesystem": "allowlist"|"ro-root"|"cwd-only", "pid": bool, "ipc": bool,
    "user": "uid-drop"|"userns"|None, "seccomp": bool (no new namespaces), "memory": "cgroup"|"nofork"|None
    (what bounds the whole program's memory: a cgroup's memory.max, or RLIMIT_AS on the one process it
    may have)}. Later runs require exactly this (no silent downgrade)."""
    with _probe_lock:
        if not _probed:
            try:
                parent = _host.cgroup_parent()
            except ValueError as e:
                raise SandboxError(str(e)) from None
            if parent is not None:
                _host.sweep_cgroups(parent)
            res, msgs = _run(
                "pass", "", mode="probe", require=None, timeout_s=30, memory_mb=1024, cgroup_parent=parent
            )
            got = next((m["isolation"] for m in msgs if "isolation" in m), None)
            if res.status != "ok" or got is None:
                raise SandboxError(f"sandbox probe failed ({res.status}): {res.error or res.stderr[-2000:]}")
            joined = any(m.get("cgroup") for m in msgs)
            got["memory"] = "cgroup" if joined else "nofork" if got["seccomp"] else None
            got["cgroup"] = parent if joined else None
            _probed.update(got)
        return dict(_probed)


def missing_isolation(iso: dict) -> str:
    """Why `iso` is not enough to run untrusted code ("" when it is): no network namespace, no allow-list
    view (the read-only host view still shows what no list can name: other checkouts and their .git,
    results and journals of other runs, data caches), nothing that keeps the program's processes from
    signalling the harness and outliving the run (a PID namespace, or its own uid: in a user namespace
    alone it runs as the harness's user), or nothing that bounds the memory of the whole program (one
    process could fork its way past any per-process limit)."""
    if iso["network"] is None:
        return "no network isolation"
    if iso["filesystem"] != "allowlist":
        return (
            f"no allow-list file-system view (only {iso['filesystem']!r}: the host's other files, such as "
            "other checkouts, results and data caches, stay readable)"
        )
    if not iso["pid"] and iso["user"] != "uid-drop":
        return "no process containment (neither a PID namespace nor a uid of its own)"
    if iso["memory"] is None:
        return "no bound on the program's total memory (neither a cgroup nor seccomp to forbid fork)"
    return ""


def run_program(
    code: str,
    stdin: str | bytes | Sequence[bytes] = "",
    *,
    timeout_s: float,
    memory_mb: int,
    cpu_s: float | None = None,
    first_event_s: float | None = None,
    disk_mb: int = 64,
    nproc: int = 64,
    output_limit: int = OUTPUT_LIMIT,
    on_event: Callable[[dict], bool] | None = None,
    allow_unisolated: bool = False,
) -> RunResult:
    """Run `code` with `python -I` in the sandbox and return how it ended. `stdin` is text, bytes, or byte
    buffers fed in order without being joined. `timeout_s` is wall time from the start (or from
    `first_event_s`, the time allowed until the first fd-3 event), re-armed by each event; `cpu_s` (default
    `timeout_s`) is the RLIMIT_CPU backstop; `memory_mb` caps each process (RLIMIT_AS) and, with a cgroup,
    all of them together; `disk_mb` caps the working dir and each file. Refuses (SandboxError) where
    `missing_isolation` says why, unless `allow_unisolated`."""
    iso = isolation()
    missing = missing_isolation(iso)
    if missing and not allow_unisolated:
        raise SandboxError(f"{missing} here ({iso}); pass allow_unisolated=True to override")
    res, _ = _run(
        code,
        stdin,
        mode="run",
        require=iso,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        cpu_s=cpu_s or timeout_s,
        disk_mb=disk_mb,
        nproc=nproc,
        output_limit=output_limit,
        on_event=on_event,
        first_event_s=first_event_s,
        cgroup_parent=iso.get("cgroup"),
    )
    return res


FDS_PER_RUN = 16  # the harness's descriptors per run in flight (pipes, run-dir lock; more while spawning)


def max_parallel() -> int:
    """How many runs this process can have in flight at once: its descriptor limit (RLIMIT_NOFILE, less a
    margin for everything else) and, as root, the per-run uids it hands out."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    most = (nofile - 256) // FDS_PER_RUN if nofile != resource.RLIM_INFINITY else _host.SLOTS
    return max(1, min(most, _host.SLOTS if os.geteuid() == 0 else most))


def map_parallel(fn: Callable, items: Iterable, workers: int | None = None) -> list:
    """`[fn(x) for x in items]` on `workers` threads (default: os.cpu_count()); each call typically runs one
    sandboxed program, so a thread per core keeps the cores busy. Results keep the input order."""
    items = list(items)
    workers = min(workers or os.cpu_count() or 1, max(len(items), 1))
    if workers == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(fn, items))


def _run(
    code: str,
    stdin,
    *,
    mode: str,
    require: dict | None,
    timeout_s: float,
    memory_mb: int,
    cpu_s: float = 30,
    disk_mb: int = 64,
    nproc: int = 64,
    nofile: int = 256,
    output_limit: int = OUTPUT_LIMIT,
    on_event=None,
    first_event_s: float | None = None,
    cgroup_parent: str | None = None,
    no_fork: bool | None = None,
) -> tuple[RunResult, list[dict]]:
    """One run. `no_fork` (default: when there is no cgroup) makes seccomp refuse new processes; the hostile
    tests turn it off to exercise the process containment that cgroup-mode runs rely on."""
    uid, root, cgroup = _host.acquire_uid(), None, None
    try:
        root = _host.prepare_root({"prog.py": code}, uid)
        cgroup, cgroup_fd = _cgroup(cgroup_parent, memory_mb, nproc)
        limits = dict(memory_mb=memory_mb, cpu_s=cpu_s, disk_mb=disk_mb, nproc=nproc, nofile=nofile)
        argv = [_host.interpreter(), "-I", os.path.join(root, "prog.py")]
        cfg = _host.make_config(
            root,
            argv,
            uid=uid,
            limits=limits,
            mode=mode,
            require=require,
            no_fork=cgroup is None if no_fork is None else no_fork,
        )
        start = time.monotonic()
        try:
            proc, status_r, events_r = _host.spawn(cfg, cgroup_fd)
        finally:
            if cgroup_fd is not None:
                os.close(cgroup_fd)
        pumped = None
        try:
            pumped = _host.pump(
                proc,
                status_r,
                events_r,
                _buffers(stdin),
                timeout_s=timeout_s,
                output_limit=output_limit,
                on_event=on_event,
                first_event_s=first_event_s,
            )
        finally:
            _host.reap(proc, kill=pumped is None or pumped.stopped is not None)
        oom, cgroup = cgroup is not None and _host.remove_cgroup(cgroup), None
        return _classify(pumped, proc.returncode, time.monotonic() - start, oom), pumped.status
    finally:
        if cgroup is not None:
            _host.remove_cgroup(cgroup)
        if root is not None:
            _host.cleanup(root)
        _host.release_uid(uid)


def _cgroup(parent: str | None, memory_mb: int, nproc: int) -> tuple[str | None, int | None]:
    if parent is None:
        return None, None
    try:
        return _host.make_cgroup(parent, memory_mb, nproc)
    except OSError as e:
        raise SandboxError(f"cannot make a run cgroup in {parent}: {e}") from None


def _buffers(stdin) -> list:
    if isinstance(stdin, str):
        return [stdin.encode()]
    return [stdin] if isinstance(stdin, bytes | bytearray | memoryview) else list(stdin)


def _classify(p: _host.Pumped, boot_rc: int | None, wall_s: float, oom: bool = False) -> RunResult:
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    error = next((m["error"] for m in p.status if "error" in m), "")
    ws = next((m["wait_status"] for m in p.status if "wait_status" in m), None)
    rc = None
    if p.stopped:
        status = p.stopped
    elif oom:  # the cgroup's OOM killer ended a process of the program (SIGKILL, whatever it was doing)
        status = "memory"
        rc = -os.WTERMSIG(ws) if ws is not None and os.WIFSIGNALED(ws) else None
    elif error:
        status = "sandbox_error"
    elif ws is None:  # P's end unknown: the bootstrap was killed (by the program) or failed (our bug)
        status, rc = ("killed", boot_rc) if (boot_rc or 0) < 0 else ("sandbox_error", boot_rc)
        error = f"bootstrap exited {boot_rc} without a status: {err[-2000:]}"
    elif os.WIFEXITED(ws):
        rc = os.WEXITSTATUS(ws)
        last = err.rstrip().rsplit("\n", 1)[-1]
        status = "ok" if rc == 0 else "memory" if last.startswith("MemoryError") else "runtime_error"
    else:
        rc = -os.WTERMSIG(ws)
        status = "timeout" if -rc == signal.SIGXCPU else "killed"
    return RunResult(status, out, err, rc, wall_s, error)
