"""Hostile programs against evalkit.sandbox: each must end with the right status while the harness survives
and the machine is left as it was (no leftover process, zombie, run directory or file outside the run).

On a machine without namespaces (e.g. a CI runner that forbids unprivileged user namespaces) the runs use
`allow_unisolated` and the cases that need a given isolation are skipped, saying which; with
EVALKIT_REQUIRE_ISOLATION=1 (set by .ci/run) such a skip is a failure instead. No test depends on an absolute
wall-clock threshold: time bounds are scaled by this machine's own time for an empty sandboxed program."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from evalkit import sandbox
from evalkit.sandbox import _boot, _host

REPO = Path(__file__).resolve().parents[2]


def run(code: str, stdin: str = "", timeout_s: float = 2.0, memory_mb: int = 512, **kw) -> sandbox.RunResult:
    return sandbox.run_program(
        code, stdin, timeout_s=timeout_s, memory_mb=memory_mb, allow_unisolated=True, **kw
    )


def run_forking(code: str, timeout_s: float = 2.0, memory_mb: int = 512) -> sandbox.RunResult:
    """`run` with fork allowed, as in a cgroup-mode run: the process containment those runs rely on, tested
    on any machine (without a cgroup, real runs forbid fork instead)."""
    iso = sandbox.isolation()
    res, _ = sandbox._run(
        code,
        "",
        mode="run",
        require=iso,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        cpu_s=timeout_s,
        cgroup_parent=iso["cgroup"],
        no_fork=False,
    )
    return res


REQUIRE = os.environ.get("EVALKIT_REQUIRE_ISOLATION") == "1"


def needs(**want):
    """Skip unless isolation() reports these values (a tuple: any of them); under EVALKIT_REQUIRE_ISOLATION=1
    the machine must give them: fail."""
    iso = sandbox.isolation()
    missing = {k: v for k, v in want.items() if iso[k] not in (v if isinstance(v, tuple) else (v,))}
    if missing:
        (pytest.fail if REQUIRE else pytest.skip)(f"needs {missing}; this machine gives {iso}")


@functools.cache
def baseline_s() -> float:
    """This machine's wall time for an empty sandboxed program now (median of 3)."""
    return sorted(run("pass").wall_s for _ in range(3))[1]


def contained() -> bool:
    """Killing -1 or a whole group, forking without bound or reading other processes' /proc only harms or
    reaches the program itself when it has its own PID namespace or its own uid."""
    iso = sandbox.isolation()
    return iso["user"] == "uid-drop" or iso["pid"]


def needs_containment():
    if not contained():
        needs(pid=True)


def sandbox_processes() -> list[psutil.Process]:
    """Processes running under any per-run sandbox uid of this harness process."""
    uids = _host.uid_range()
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids]


@pytest.fixture(autouse=True)
def machine_unchanged():
    """After each test: no children (zombie or not) of this process, no sandbox-uid process anywhere, and no
    run directory of this process left behind (other processes on the machine may be grading meanwhile)."""
    dirs = set(_host.run_dirs(os.getpid()))
    children = set(psutil.Process().children(recursive=True))  # e.g. worker pools of other test modules
    yield
    assert set(psutil.Process().children(recursive=True)) <= children
    assert sandbox_processes() == []
    assert set(_host.run_dirs(os.getpid())) <= dirs


def test_isolation_detected():
    iso = sandbox.isolation()
    assert set(iso) == {"user", "network", "ipc", "filesystem", "pid", "seccomp", "memory", "cgroup"}
    assert iso["network"] in ("netns", None) and iso["filesystem"] in ("allowlist", "ro-root", "cwd-only")
    assert iso["user"] in ("uid-drop", "userns", None) and isinstance(iso["pid"], bool)
    assert isinstance(iso["ipc"], bool) and isinstance(iso["seccomp"], bool)
    assert iso["memory"] in ("cgroup", "nofork", None) and (iso["cgroup"] is None) == (
        iso["memory"] != "cgroup"
    )


def test_this_machine_is_fully_isolated_under_ci():
    """What CI (EVALKIT_REQUIRE_ISOLATION=1) demands: nothing run_program would refuse, and the strongest
    view, process containment and namespace ban; the whole-program memory bound may be either kind."""
    if not REQUIRE:
        pytest.skip("EVALKIT_REQUIRE_ISOLATION is not set")
    iso = sandbox.isolation()
    assert sandbox.missing_isolation(iso) == "" and iso["filesystem"] == "allowlist" and iso["pid"]
    assert iso["seccomp"] and iso["memory"] in ("cgroup", "nofork") and iso["ipc"]


def test_plain_program_stdin_and_exit_codes():
    r = run("import sys; print(sys.stdin.read().upper())", "abc")
    assert (r.status, r.stdout, r.stderr) == ("ok", "ABC\n", "")  # no start-up hook fails in the view
    r = run("import sys; sys.exit(3)")
    assert (r.status, r.returncode) == ("runtime_error", 3)
    r = run("import os; print('x', flush=True); os._exit(0)")
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "x\n")
    assert run("raise ValueError('boom')").status == "runtime_error"


def test_infinite_loop_times_out_on_time():
    r = run("while True: pass", timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 1.0 + 5 * baseline_s()


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def test_fork_bomb_is_contained_and_reaped():
    needs_containment()
    r = run_forking(FORK_BOMB, timeout_s=1.5)
    assert r.status == "timeout"  # NPROC stops the forks; the watchdog ends the spinning survivors
    # the autouse fixture checks that no process, zombie or orphan is left


def test_escaping_children_die_with_the_program():
    """A daemonized grandchild (new session, ignores SIGHUP, sleeps for ever) neither outlives the run nor
    holds it open: the run ends "ok" (else the 5 s watchdog would end it as a timeout)."""
    needs_containment()
    code = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "    time.sleep(10**6)\n"
        "print('parent done')\n"
    )
    r = run_forking(code, timeout_s=5)
    assert (r.status, r.stdout) == ("ok", "parent done\n")


# --- the whole program's memory (15.9) ----------------------------------------------------------------------
# 20 children of 90 MB each under memory_mb=128: per-process RLIMIT_AS alone let them hold 1.58 GB.
SPREAD = """
import os, time
kids = 0
for _ in range(20):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        b = bytearray(90 << 20)
        b[::4096] = b"x" * len(b[::4096])  # touch every page
        print("child holds 90 MB", flush=True)
        time.sleep(3)
        os._exit(0)
    kids += 1
held = []
try:
    for _ in range(20):
        held.append(bytearray(90 << 20))
except MemoryError:
    pass
time.sleep(0.5)
print("parent", kids, len(held), flush=True)
"""


def test_memory_limit_caps_the_whole_program():
    needs(memory=("cgroup", "nofork"))
    r = run(SPREAD, memory_mb=128, timeout_s=20)
    if sandbox.isolation()["memory"] == "nofork":  # no process to spread into; threads share the one limit
        assert (r.status, r.stdout) == ("ok", "parent 0 1\n"), (r.stdout, r.stderr)
    else:  # the cgroup's OOM killer ends the program once the sum passes 128 MB
        assert r.status == "memory" and r.stdout.count("child holds") * 90 <= 128, r.stdout


def test_nofork_allows_threads_only():
    needs(memory="nofork")
    code = (
        "import os, subprocess, threading\n"
        "for name, f in [('fork', os.fork), ('spawn', lambda: subprocess.run(['true']))]:\n"
        "    try:\n        f()\n        print(name, 'ALLOWED')\n"
        "    except OSError as e:\n        print(name, 'refused', e.errno)\n"
        "out = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in ts]\n[t.join() for t in ts]\nprint('threads', sorted(out))\n"
    )
    r = run(code)
    assert r.stdout == "fork refused 1\nspawn refused 1\nthreads [0, 1, 2, 3, 4, 5, 6, 7]\n", r.stderr


# --- memory that is no address space ----------------------------------------------------------------------
# RLIMIT_AS (the no-fork bound) does not count memory held in kernel objects. Each path below is tried by a
# program that keeps going after each refusal (a new file, segment or pipe; descriptors parked in flight on a
# socket once it runs out) until it holds 512 MB or nothing more is handed out, under memory_mb=256 and
# disk_mb=64. The old sandbox let it hold 512 MB in memfds or SysV shared memory, 500 MB in message queues,
# 128 MB in the working dir plus /dev/shm and 67 MB in grown pipes.
HOARD = r"""
import array, ctypes, fcntl, os, socket
MB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, kept = 0, []
parking = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # descriptors sent here stay alive in flight
parking[0].setblocking(False)


def park(fds):  # free the descriptor slots: what they hold stays
    for fd in fds:
        try:
            parking[0].sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            os.close(fd)
        except OSError:
            kept.append(fd)


def check(ret, what):
    if ret == -1 or ret is None:
        raise OSError(ctypes.get_errno(), what)
    return ret


def fill(fd):  # write until the kernel refuses more (a full buffer, or a size cap)
    global held
    os.set_blocking(fd, False)
    chunk = b"x" * (1 << 16)
    try:
        while held < 512 * MB:
            held += os.write(fd, chunk)
    except OSError:  # full (EAGAIN), or this file at a cap (EFBIG, ENOSPC): the next one, then
        pass


def hold_one(i):
    global held
    if KIND == "memfd":
        fd = os.memfd_create("hold")
        fill(fd)
        return [fd]
    if KIND == "tmpfs":  # the working dir and /dev/shm in turn
        fd = os.open(f"{('.', '/dev/shm')[i % 2]}/hold{i}", os.O_CREAT | os.O_WRONLY)
        fill(fd)
        return [fd]
    if KIND == "sysv_shm":
        seg = check(libc.shmget(0, 16 * MB, 0o1600), "shmget")
        at = check(libc.shmat(seg, None, 0), "shmat")
        ctypes.memset(at, 1, 16 * MB)
        libc.shmdt(ctypes.c_void_p(at))
        held += 16 * MB
        return []
    if KIND == "sysv_msg":
        queue, msg = check(libc.msgget(0, 0o1600), "msgget"), ctypes.create_string_buffer(b"\1" + bytes(8199))
        while held < 512 * MB and libc.msgsnd(queue, msg, 8192, 0o4000) == 0:
            held += 8192
        return []
    if KIND == "pipe":
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MB instead of 64 KB
        except OSError:
            pass
        fill(w)
        os.close(w)
        return [r]
    a, b = socket.socketpair()
    sender, receiver = a.detach(), b.detach()
    fill(sender)
    return [sender, receiver]


error = None
try:
    for i in range(2000):
        if held >= 512 * MB:
            break
        park(hold_one(i))
except OSError as e:
    error = e.errno
print(held >> 20, error)
"""

# What each path may still hold (MB): refused outright; the one tmpfs behind the working dir and /dev/shm
# (disk_mb); default-size pipe and socket buffers, bounded by the descriptors (open and in flight).
HOARD_BOUND_MB = {"memfd": 0, "sysv_shm": 0, "sysv_msg": 0, "tmpfs": 64, "pipe": 40, "socket": 64}


@pytest.mark.parametrize("kind", sorted(HOARD_BOUND_MB))
def test_memory_outside_the_address_space_is_bounded(view, kind):
    """With a cgroup all of it is charged to memory.max (the OOM killer ends the program); without one, each
    path is refused or capped (seccomp, one size-capped tmpfs, pipes kept at their default size)."""
    needs(memory=("cgroup", "nofork"))
    r = run(f"KIND = {kind!r}\n" + HOARD, memory_mb=256, timeout_s=60)
    if sandbox.isolation()["memory"] == "cgroup" and r.status == "memory":
        return
    assert r.status == "ok", r.stderr
    held_mb = int(r.stdout.split()[0])
    assert held_mb <= HOARD_BOUND_MB[kind], r.stdout


# A candidate that holds its memory through each path, as graded: the way a plain overrun is (an exception in
# the program: upstream's runtime error), never as a pass.
GRADED_HOARDS = {
    "plain": "b = bytearray(1 << 40)",
    "memfd": "import os\nfor _ in range(16):\n    os.pwrite(os.memfd_create('x'), b'x' * (32 << 20), 0)",
    "tmpfs": "for i in range(16):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (32 << 20))",
    "sysv_shm": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = "
    "ctypes.c_void_p\nseg = libc.shmget(0, 512 << 20, 0o1600)\nif seg < 0:\n    raise "
    "OSError(ctypes.get_errno(), 'shmget')\nctypes.memset(libc.shmat(seg, None, 0), 1, 512 << 20)",
    "pipe": "import fcntl, os\nfor _ in range(100):\n    fcntl.fcntl(os.pipe()[1], 1031, 1 << 20)",
}


def test_memory_hoarding_is_graded_as_a_memory_overrun():
    needs(memory=("cgroup", "nofork"))
    from tasks.livecodebench import grade
    from tasks.livecodebench.grade import Cases

    settings = grade.Settings(workers=1, timeout_s=10, memory_mb=256, allow_unisolated=True)
    tests = Cases(["1\n"], ["1\n"], None)
    outcomes = {
        k: grade.grade(c + "\nprint(input())", tests, settings).outcome for k, c in GRADED_HOARDS.items()
    }
    assert outcomes == dict.fromkeys(GRADED_HOARDS, "runtime_error"), outcomes


# --- no nested namespaces, no configuration in view (15.10) -------------------------------------------------
NAMESPACES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flags in [("user", 0x10000000), ("mount", 0x20000), ("net", 0x40000000), ("pid", 0x20000000)]:
    rc = libc.unshare(flags)
    print("unshare", name, "ALLOWED" if rc == 0 else ctypes.get_errno())
    if rc == 0 and name == "user":
        libc.unshare(0x20000)
        rc = libc.mount(b"none", b"/tmp" if os.path.isdir("/tmp") else b"/", b"tmpfs", 0, None)
        print("tmpfs mount", "ALLOWED" if rc == 0 else ctypes.get_errno())
print("setns", "ALLOWED" if libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0) == 0 else ctypes.get_errno())
"""  # noqa: E501 (the program's own lines)


def test_no_nested_namespaces():
    """unshare(CLONE_NEWUSER) would hand the program every capability over a namespace of its own (mounts,
    more namespaces): refused (EPERM), like every other new namespace and setns."""
    needs(seccomp=True)
    r = run(NAMESPACES)
    assert r.status == "ok" and "ALLOWED" not in r.stdout, r.stdout
    assert r.stdout.count(" 1\n") == 5, r.stdout


def test_init_cmdline_shows_no_configuration():
    """The bootstrap's settings (host paths of the view, the run dir, uid, limits) come on a memfd, not argv:
    /proc/1/cmdline (its init) names only the interpreter and two fd numbers."""
    needs(pid=True)
    r = run("import os\nprint(os.getuid())\nprint(open('/proc/1/cmdline').read())")
    uid, cmdline = r.stdout.split("\n", 1)
    argv = cmdline.rstrip("\n").split("\0")[:-1]
    assert argv[1:4] == ["-I", "-S", f"/proc/self/fd/{argv[5]}"] and argv[4].isdigit() and len(argv) == 6, (
        argv
    )
    assert uid not in cmdline and "evalkit" not in cmdline and "{" not in cmdline, cmdline


@pytest.mark.parametrize("code", ["x = bytearray(8 << 30)", "l = []\nwhile True:\n    l.append(' ' * 10**7)"])
def test_memory_bomb(code):
    assert run(code, memory_mb=256, timeout_s=10).status == "memory"


def test_ten_gigabytes_of_output_are_cut():
    code = "import sys\nb = 'x' * (1 << 20)\nfor _ in range(10240):\n    sys.stdout.write(b)\n"
    r = run(code, timeout_s=20, output_limit=8 << 20)
    assert r.status == "output_limit" and len(r.stdout) <= (8 << 20) + (1 << 16)


def test_files_outside_the_run_are_untouched(tmp_path):
    needs(filesystem=("allowlist", "ro-root"))
    canary = tmp_path / "canary.txt"
    canary.write_text("keep me")
    code = f"""
import os, shutil
for attempt in (lambda: os.remove({str(canary)!r}), lambda: open({str(canary)!r}, "w").write("gone"),
                lambda: open({str(tmp_path / "new.txt")!r}, "w").write("x"), lambda: shutil.rmtree({str(tmp_path)!r}),
                lambda: open("/tmp/evalkit-sandbox-evil", "w"), lambda: os.mkdir("/var/tmp/evalkit-sandbox-evil")):
    try:
        attempt()
        print("ALLOWED")
    except OSError as e:
        print("denied", e.errno)
open("inside.txt", "w").write("fine")  # its own working dir is writable
print(open("inside.txt").read())
"""  # noqa: E501 (the program's own lines)
    r = run(code)
    assert r.status == "ok" and "ALLOWED" not in r.stdout and r.stdout.endswith("fine\n"), r.stdout
    assert canary.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["canary.txt"]
    assert not any(os.path.exists(f"{d}/evalkit-sandbox-evil") for d in ("/tmp", "/var/tmp"))


def test_environment_secrets_do_not_leak(monkeypatch):
    """Not in its environment, nor in any /proc environ it can reach: its own, its init's, its parent's, the
    harness's (visible without a PID namespace), or a harness-side process's that holds the secret in its
    initial environment (which /proc shows; a variable set later, like the one planted here, it does not)."""
    monkeypatch.setenv("HF_TOKEN", "secret-hf-token-1234")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "HF_TOKEN": "secret-hf-token-5678"},
    )
    try:
        code = (
            "import os\nprint(dict(os.environ))\n"
            f"for pid in ['self', 1, os.getppid(), {os.getpid()}, {holder.pid}]:\n"
            "    p = f'/proc/{pid}/environ'\n"
            "    try:\n        print(p, open(p, 'rb').read())\n    except OSError as e:\n        print(p, "
            "'denied', e)\n"
        )
        r = run(code)
    finally:
        holder.kill()
        holder.wait()
    assert r.status == "ok" and "secret-hf-token" not in r.stdout + r.stderr, r.stdout
    if contained():  # else it shares the harness's uid and /proc (run_program refuses that by default)
        for pid in (os.getpid(), holder.pid):
            assert f"/proc/{pid}/environ denied" in r.stdout, r.stdout


def test_host_files_are_not_in_view(tmp_path):
    """Only the allow-list is there: not the test's own files, the checkout, its task data (expected outputs),
    results, or home, even by absolute path."""
    needs(filesystem="allowlist")
    canary = tmp_path / "canary.txt"
    canary.write_text("canary-secret")
    sample = REPO / "tasks" / "livecodebench" / "data" / "sample.jsonl"
    assert sample.is_file()
    paths = [canary, sample, REPO / "results", REPO / "tests", Path.home() / ".bashrc", Path("/etc/passwd")]
    code = (
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    try:\n        print(p, 'FOUND', open(p).read(200))\n"
        "    except OSError as e:\n        print(p, 'missing', e.errno)\n"
    )
    r = run(code)
    assert r.status == "ok" and "FOUND" not in r.stdout and "canary-secret" not in r.stdout, r.stdout
    assert r.stdout.count("missing 2\n") == len(paths), r.stdout  # ENOENT: not there at all


def test_root_holds_only_the_allow_list():
    needs(filesystem="allowlist")
    prefixes = [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix)]
    allowed = {"usr", "bin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
    allowed |= {p.parts[1] for p in prefixes} | {Path(tempfile.gettempdir()).parts[1]}
    dirs = ["/", "/etc", "/dev", str(REPO)]
    code = (
        f"import json, os\nprint(json.dumps({{d: sorted(os.listdir(d)) for d in {dirs!r} if "
        "os.path.isdir(d)}))"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    seen = json.loads(r.stdout)
    assert set(seen["/"]) <= allowed and "home" not in seen["/"], seen
    assert set(seen["/etc"]) <= {"ld.so.cache", "localtime"}, seen
    devices = {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}
    assert set(seen["/dev"]) <= devices, seen
    # of the checkout only the path down to the venv, when the venv lives in it
    venv = {p.relative_to(REPO).parts[0] for p in prefixes if p.is_relative_to(REPO)}
    assert set(seen.get(str(REPO), [])) <= venv, seen


def test_installed_packages_still_import():
    """The view holds the interpreter's site-packages: compiled extensions and their bundled libs load."""
    pytest.importorskip("numpy")
    r = run("import numpy\nprint(int(numpy.arange(5).sum()))", timeout_s=20, memory_mb=1024)
    assert (r.status, r.stdout) == ("ok", "10\n"), r.stderr


def test_sandbox_processes_are_opaque():
    """Its init (PID 1 of its namespace) holds capabilities over the mounts and pipes to the harness: the
    program may neither read its fds nor trace it, also where it runs under the same uid (user namespace)."""
    needs(pid=True)
    code = (
        "import os\ntry:\n    print(os.listdir('/proc/1/fd'))\nexcept OSError as e:\n    print('denied', "
        "e.errno)\n"
    )
    r = run(code)
    assert (r.status, r.stdout) == ("ok", "denied 13\n"), r.stdout


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_host_unix_sockets_cannot_be_reached(tmp_path, kind):
    """A read-only mount does not stop connect(): a pathname socket must be out of view (allow-list), an
    abstract one in another network namespace."""
    needs(**({"filesystem": "allowlist"} if kind == "path" else {"network": "netns"}))
    address = str(tmp_path / "s.sock") if kind == "path" else f"\0evalkit-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(address)
        server.listen()
        server.setblocking(False)
        code = (
            "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({address!r})\n    print('CONNECTED')\nexcept OSError as e:\n    "
            "print('failed', e)\n"
        )
        r = run(code)
        assert r.status == "ok" and r.stdout.startswith("failed"), r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()


def test_no_network():
    needs(network="netns")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    "
            "print('CONNECTED')\nexcept OSError as e:\n    print('failed', e)\n"
        )
        r = run(code)
        assert r.status == "ok" and r.stdout.startswith("failed"), r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()


@pytest.mark.parametrize(
    "code",
    [
        "import os; os.kill(os.getppid(), 9); print('alive')",
        "import os; os.kill(-1, 9)",
        "import os; os.killpg(0, 9)",
    ],
)
def test_killing_its_parents_harms_only_itself(code):
    """Its parent (the sandbox's init or the harness), `kill(-1)` (every process it may signal) and its own
    process group: a harness-side bystander in its own session must survive, and so must this process."""
    needs_containment()
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        r = run(code)
        assert r.status in {"ok", "runtime_error", "killed"}
        assert bystander.poll() is None, "a harness-side process was killed"
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("import sys\nsys.setrecursionlimit(50000)\ndef f(n):\n    return f(n + 1)\nf(0)\n", "runtime_error"),
        # recursion through a C function grows the C stack until SIGSEGV
        (
            "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return max(map(f, [n + 1]))\nf(0)\n",
            "killed",
        ),
    ],
)
def test_deep_recursion(code, status):
    assert run(code, timeout_s=10).status == status


def test_fd3_is_ignored_without_a_listener():
    r = run("import os\nos.write(3, b'not json\\n' * 1000)\nprint('done')")
    assert (r.status, r.stdout) == ("ok", "done\n")


def test_events_rearm_the_watchdog_and_stop_the_run():
    code = (
        "import os, time\nfor i in range(5):\n    time.sleep(0.3)\n    os.write(3, b'{\"i\": %d}\\n' % "
        "i)\ntime.sleep(60)\n"
    )
    seen = []
    r = run(code, timeout_s=0.8, on_event=lambda ev: seen.append(ev["i"]) or ev["i"] < 3)
    assert r.status == "stopped" and seen == [0, 1, 2, 3]  # 5 x 0.3 s > 0.8 s: each event re-armed it
    r = run(code, timeout_s=0.8, on_event=lambda ev: True)
    assert r.status == "timeout" and r.wall_s < 5 * 0.3 + 0.8 + 5 * baseline_s()


def test_first_event_deadline_is_separate():
    """`first_event_s` covers start-up; from the first event on, `timeout_s` applies."""
    code = "import os, time\ntime.sleep(0.5)\nos.write(3, b'{}\\n')\ntime.sleep(60)\n"
    seen = []
    r = run(code, timeout_s=0.2, first_event_s=30, on_event=lambda ev: seen.append(ev) or True)
    assert (r.status, seen) == ("timeout", [{}]) and r.wall_s < 0.5 + 0.2 + 5 * baseline_s()
    seen.clear()
    r = run(code, timeout_s=0.2, on_event=lambda ev: seen.append(ev) or True)
    assert (r.status, seen) == ("timeout", [])  # without it, 0.2 s from the start: before the event


@pytest.mark.parametrize(
    "lacking",
    [
        {"network": None},
        {"pid": False, "user": "userns"},
        {"pid": False, "user": None},
        {"filesystem": "ro-root"},
        {"filesystem": "cwd-only"},
    ],
)
def test_refuses_without_isolation(monkeypatch, lacking):
    """No network namespace, nothing keeping the program's processes from the harness's (a user namespace
    alone runs it as the harness's user, able to kill() it or leave daemons), or no allow-list view (the
    read-only host shows other checkouts, other runs' results, data caches)."""
    monkeypatch.setattr(sandbox, "_probed", {**sandbox.isolation(), **lacking})
    with pytest.raises(sandbox.SandboxError, match="allow_unisolated"):
        sandbox.run_program("print(1)", timeout_s=2, memory_mb=512)


def test_parallel_runs_keep_order():
    out = sandbox.map_parallel(lambda i: run(f"print({i})").stdout, range(6), workers=2)
    assert out == [f"{i}\n" for i in range(6)]


def test_stdin_buffers_are_streamed_in_order():
    chunks = [b"ab", b"", memoryview(b"cd\n"), bytearray(b"x" * 200_000)]
    r = run("import sys\nd = sys.stdin.buffer.read()\nprint(d[:5], len(d))", chunks)
    assert r.stdout == "b'abcd\\n' 200005\n"


def test_malicious_pickled_tests_are_refused():
    """A private_test_cases payload that would run code when unpickled: refused by the loader, the row
    reported as Skipped by id, and the code never runs."""
    import base64
    import pickle
    import zlib
    from datetime import datetime

    from tasks.livecodebench import livecodebench as lcb

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/evalkit-pwned",))

    payload = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(pickle.UnpicklingError, match="refused to load"):
        lcb.decode_tests(payload)
    row = {
        "question_id": "evil_1",
        "contest_date": "2024-01-01T00:00:00",
        "difficulty": "easy",
        "question_content": "q",
        "starter_code": "",
        "platform": "atcoder",
        "metadata": "{}",
        "public_test_cases": "[]",
        "private_test_cases": payload,
    }
    item = lcb._parse(row, 0, datetime.fromisoformat(row["contest_date"]), 2000)
    assert item.id == "evil_1" and "refused to load posix.system" in item.reason
    assert not os.path.exists("/tmp/evalkit-pwned")


# --- no task data in view, however evalkit is installed (15.2) ----------------------------------------------
# A wheel or system install puts evalkit's packages, task data (expected outputs) included, in a site-packages
# dir the view binds for the interpreter: the sandbox mounts an empty dir over each harness package there.
DATA = sorted(str(p) for p in (REPO / "tasks").glob("*/data/*") if p.is_file())
REAL_HARNESS_DIRS = _host.harness_dirs


def listing(paths: list[str]) -> dict:
    code = (
        "import json, os\nout = {}\n"
        f"for p in {paths!r}:\n"
        "    out[p] = sorted(os.listdir(p)) if os.path.isdir(p) else os.path.exists(p)\n"
        "print(json.dumps(out))\n"
    )
    r = run(code)
    assert r.status == "ok", r.stderr
    return json.loads(r.stdout)


@pytest.fixture(params=["allowlist", "ro-root"])
def view(request, monkeypatch):
    """Each file-system view: the allow-list, and the read-only host (the fallback where pivot_root is not
    possible), forced by what the probe is taken to have found."""
    needs(filesystem="allowlist")  # a machine that builds the allow-list can build the fallback too
    monkeypatch.setattr(sandbox, "_probed", {**sandbox.isolation(), "filesystem": request.param})
    return request.param


def test_harness_packages_and_data_are_not_in_view(view):
    """Wherever evalkit's packages live (here: the checkout), neither they nor any task data file is there."""
    assert DATA and _host.harness_dirs()
    seen = listing(_host.harness_dirs() + DATA)
    assert all(v in (False, []) for v in seen.values()), seen


def test_a_harness_package_inside_the_bound_prefix_is_empty(view, monkeypatch):
    """The wheel layout without building a wheel: a package dir inside the interpreter's bound prefix (pip's,
    standing in for an installed `tasks`) is mounted empty once it is a harness dir, and only then."""
    pip_dir = os.path.dirname(os.path.realpath(importlib.util.find_spec("pip").origin))
    assert pip_dir.startswith(os.path.realpath(sys.prefix)) and os.listdir(pip_dir)
    assert listing([pip_dir])[pip_dir]  # visible as an ordinary package
    monkeypatch.setattr(_host, "harness_dirs", lambda: [pip_dir])
    _host.base_view.cache_clear()
    try:
        assert listing([pip_dir]) == {pip_dir: []}
    finally:
        monkeypatch.setattr(_host, "harness_dirs", REAL_HARNESS_DIRS)
        _host.base_view.cache_clear()  # no view with the stand-in survives this test


WHEEL_CHECK = """
import hashlib, json, os, sys
from pathlib import Path
import tasks.livecodebench.livecodebench as lcb
from tasks.livecodebench import grade
from evalkit import sandbox
data = sorted(Path(lcb.__file__).parent.glob("data/*"))
assert data and str(data[0]).startswith(sys.prefix), (data, sys.prefix)  # the wheel's copy, not the checkout
grade.configure(workers=2, timeout_s=6, memory_mb=1024)
sols = json.loads((Path(lcb.__file__).parent / "data" / "solutions.json").read_text())
items = [(["```python\\n" + sols[s.id]["reference"] + "\\n```"], s) for s in lcb.load().samples]
print("pass@1", [m["pass@1"] for m in lcb.score_many(items)])
sizes = {p.stat().st_size: hashlib.sha256(p.read_bytes()).hexdigest() for p in data}
hunt = '''
import hashlib, os, sys
sizes = %r
found = []
for d, dirs, files in os.walk("/"):
    if d in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    for f in files:
        p = os.path.join(d, f)
        try:
            if os.path.getsize(p) in sizes and hashlib.sha256(open(p, "rb").read()).hexdigest() == sizes[os.path.getsize(p)]:
                found.append(p)
        except OSError:
            pass
    found += [os.path.join(d, x) for x in dirs + files if x in ("livecodebench", "sample.jsonl", "solutions.json")]
print(found)
''' % (sizes,)
r = sandbox.run_program(hunt, timeout_s=600, memory_mb=1024)
print("found", r.status, r.stdout.strip())
"""  # noqa: E501 (the program's own lines)


@pytest.mark.slow
def test_wheel_install_shows_no_task_data(tmp_path):
    """`pip install` of a built wheel into a fresh venv (site-packages then holds tasks/*/data): the bundled
    LiveCodeBench sample grades with the sandbox, and a program that searches the whole view for the data
    files (by content) or the task packages finds nothing."""
    src, wheels, venv = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv"
    src.mkdir()  # a copy of the sources: a build writes build/ and *.egg-info beside them
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    for part in ("evalkit", "tasks"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [
            *pip,
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            *map(str, wheels.glob("*.whl")),
        ],
        check=True,
    )
    # dependencies from this venv, appended after the new venv's own site-packages (its .pth files unread)
    site = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "evalkit-test-deps.pth").write_text("\n".join(deps) + "\n")
    out = subprocess.run([str(py), "-I", "-c", WHEEL_CHECK], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pass@1 [100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0]" in out.stdout
    assert "found ok []" in out.stdout, out.stdout


def test_cgroup_choice(monkeypatch, tmp_path):
    """Run cgroups go where the memory controller is handed to children and we may write; an explicit
    $EVALKIT_SANDBOX_CGROUP that cannot serve is an error at the probe, never a silent fallback."""
    control = tmp_path / "cgroup.subtree_control"
    assert "not a cgroup v2 directory" in _host.cgroup_unusable(str(tmp_path))
    control.write_text("cpu pids\n")
    assert "memory controller" in _host.cgroup_unusable(str(tmp_path))
    control.write_text("cpu memory pids\n")
    assert _host.cgroup_unusable(str(tmp_path)) == ""
    monkeypatch.setenv(_host.CGROUP_ENV, str(tmp_path / "nope"))
    monkeypatch.setattr(sandbox, "_probed", {})
    with pytest.raises(sandbox.SandboxError, match="EVALKIT_SANDBOX_CGROUP.*not a cgroup v2 directory"):
        sandbox.isolation()


# --- the read-only host view, where it is allowed (allow_unisolated) ----------------------------------------
def test_checkout_and_its_git_are_not_in_view(view):
    """The checkout (its results, journals, task data) and its .git (every bundled solution in every commit),
    the main repository's .git too where the checkout is a worktree: in neither view. The fallback also
    hides what it can name, though it is refused unless allow_unisolated (other repositories, data caches)."""
    repos = _host.repositories()
    assert str(REPO) in repos and all(os.listdir(r) for r in repos)
    seen = listing([*repos, str(REPO / ".git"), str(REPO / "results"), *DATA])
    prefixes = [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix)]
    venv = sorted({p.relative_to(REPO).parts[0] for p in prefixes if p.is_relative_to(REPO)})  # stays, inside
    assert seen.pop(str(REPO)) in (False, [], venv), seen
    assert all(v in (False, []) for v in seen.values()), seen


def test_runs_with_the_checkout_under_home(view, monkeypatch):
    """A checkout under $HOME (or /root, /tmp: the dirs the fallback empties) gets its package dirs hidden
    with the dir around it; the view still builds (it used to fail: mount ...: No such file or directory)."""
    monkeypatch.setenv("HOME", str(REPO.parent))
    r = run("import os\nprint(os.path.exists(" + repr(str(REPO / "evalkit")) + "))")
    assert (r.status, r.stdout, r.error) == ("ok", "False\n", "")


# --- nothing outlives a killed harness ----------------------------------------------------------------------
GRADER = """
import sys
from evalkit import sandbox
sandbox._probed = {**sandbox.isolation(), "filesystem": sys.argv[1]}
sandbox.run_program("import time\\ntime.sleep(600)", timeout_s=600, memory_mb=256, allow_unisolated=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_nothing_outlives_a_killed_harness(view, sig):
    """A grading process killed outright while its program sleeps: the bootstrap, the init and the program
    die with it (not at their 600 s timeout), and its run dir goes at the next run (here: ours)."""
    grader = subprocess.Popen(
        [sys.executable, "-c", GRADER, view], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    tree = []
    try:
        for _ in range(600):  # B, I and P (no fork) started: the program is asleep, or about to be
            tree = psutil.Process(grader.pid).children(recursive=True)
            if len(tree) >= 3:
                break
            psutil.wait_procs([], timeout=0.05)
        assert len(tree) >= 3, tree
        psutil.wait_procs([], timeout=0.3)
        grader.send_signal(sig)
        assert grader.wait() == -sig
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert alive == []
    finally:
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        grader.kill()
        grader.wait()
    assert [
        p for p in psutil.process_iter(["uids"]) if p.info["uids"].real in _host.uid_range(grader.pid)
    ] == []
    assert len(_host.run_dirs(grader.pid)) == 1  # it could not remove its own
    assert run("pass").status == "ok"  # sweeps the dead harness's run dir
    assert _host.run_dirs(grader.pid) == []


# --- nothing passes from one run to the next ----------------------------------------------------------------
KEYRING = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, REQUEST_KEY, KEYCTL = {calls}
if {add}:
    rc = libc.syscall(ADD_KEY, b"user", b"evalkit-canary", b"expected-output", 15, -4)  # the user keyring
    print("add", rc if rc < 0 else "ok", ctypes.get_errno())
else:
    key, buf = libc.syscall(REQUEST_KEY, b"user", b"evalkit-canary", None, 0), ctypes.create_string_buffer(64)
    print("read", key, ctypes.get_errno(), libc.syscall(KEYCTL, 11, key, buf, 64) if key >= 0 else "", buf.value)
"""  # noqa: E501 (the program's own lines)


def test_keyrings_do_not_carry_data_between_runs(view):
    """Keyrings belong to the uid and outlive its processes, and per-run uids are reused: run A stores a key,
    run B (the same uid) must not find it. The calls are refused (seccomp)."""
    needs(seccomp=True)
    nr = _boot.SYSCALLS[os.uname().machine]
    calls = (nr["add_key"], nr["request_key"], nr["keyctl"])
    a = run(KEYRING.format(calls=calls, add=True))
    b = run(KEYRING.format(calls=calls, add=False))
    assert (a.status, b.status) == ("ok", "ok") and "expected-output" not in b.stdout, (a.stdout, b.stdout)
    assert (a.stdout, b.stdout) == ("add -1 1\n", "read -1 1  b''\n")


def test_init_cmdline_names_no_host_path(view):
    """/proc/1/cmdline (the sandbox's init, readable by the program) shows no host interpreter path."""
    needs(pid=True)
    r = run("print(open('/proc/1/cmdline').read())")
    argv0 = r.stdout.split("\0")[0]
    assert argv0 == "python3" and sys.executable not in r.stdout and sys.prefix not in r.stdout, r.stdout


# --- settings the host cannot run, refused at configuration -------------------------------------------------
def test_more_workers_than_the_host_can_run_are_refused(monkeypatch):
    """Every worker holds descriptors (pipes, the run dir's lock) and, as root, a per-run uid: more than the
    process's open-file limit or its uid slots allow failed only at grading, after the whole generation."""
    from tasks.livecodebench import grade

    monkeypatch.setattr(grade, "_settings", grade._settings)  # restored after the accepted call below
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert sandbox.max_parallel() == (512 - 256) // sandbox.FDS_PER_RUN == 16
        with pytest.raises(
            ValueError, match=r"^workers=17 is more sandboxes than this process can run at once \(16"
        ):
            grade.configure(workers=17, memory_mb=1024, allow_unisolated=True)
        assert grade.configure(workers=16, memory_mb=1024, allow_unisolated=True)["workers"] == 16
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    n = sandbox.max_parallel()
    assert n <= _host.SLOTS or os.geteuid() != 0
    with pytest.raises(ValueError, match=f"workers={n + 1} is more sandboxes.*at most {n}$"):
        grade.configure(workers=n + 1, allow_unisolated=True)
    monkeypatch.setattr(os, "cpu_count", lambda: n + 7)  # the default, one per CPU, on a bigger machine
    with pytest.raises(ValueError, match=rf"workers=null \(one per CPU: {n + 7}\) is more sandboxes"):
        grade.configure(allow_unisolated=True)


def test_configure_reports_a_sandbox_failure_as_such(monkeypatch):
    """A sandbox that cannot start the grader is not a memory setting: the error says what failed."""
    from tasks.livecodebench import grade

    failed = sandbox.RunResult(
        "sandbox_error", "", "", 1, 0.1, "isolation: mount /x: No such file or directory"
    )
    monkeypatch.setattr(sandbox, "run_program", lambda *a, **kw: failed)
    with pytest.raises(
        sandbox.SandboxError, match="^the sandbox cannot start the grader: isolation: mount /x"
    ) as e:
        grade.configure(workers=1, allow_unisolated=True)
    assert "memory_mb" not in str(e.value)


def test_run_cgroups_of_a_dead_harness_are_swept(tmp_path):
    """A harness killed outright leaves its (empty) run cgroups: the next probe removes those of processes
    that are gone, never a live harness's, nor one that still holds a process (rmdir refuses it)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for name in (f"evalkit-sbx-{gone.pid}-0", f"evalkit-sbx-{os.getpid()}-0", "unrelated"):
        (tmp_path / name).mkdir()
    (tmp_path / f"evalkit-sbx-{gone.pid}-1").mkdir()
    (tmp_path / f"evalkit-sbx-{gone.pid}-1" / "cgroup.procs").write_text("")  # not empty: stays
    _host.sweep_cgroups(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"evalkit-sbx-{gone.pid}-1", f"evalkit-sbx-{os.getpid()}-0", "unrelated"]
    )
