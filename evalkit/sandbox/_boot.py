"""Sandbox bootstrap, run as `python -I -S _boot.py CONFIG_JSON` by `evalkit.sandbox` (stdlib only, no imports
from evalkit: it runs before and outside the package).

Three processes: this bootstrap (B) enters new namespaces and builds the file-system view, forks the init (I,
PID 1 of a new PID namespace), which forks the program (P). P drops to an unprivileged uid with rlimits and
no_new_privs and execs the interpreter. When P exits, I exits and the kernel kills everything left in the PID
namespace. B reports on the status pipe (JSON lines): the isolation it achieved, P's wait status, or an error.
B answers SIGTERM by killing I's process group; B always reaps I itself, so no zombie is left to PID 1.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 1 << 14, 1 << 18
# Per-mount flags a read-only remount must repeat (in a user namespace they are locked and EPERM otherwise).
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
               "nodiratime": 2048, "relatime": 1 << 21}  # fmt: skip
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

libc = ctypes.CDLL(None, use_errno=True)


def _c(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = [None if x is None else x.encode() for x in (src, target, fstype, data)]
    _c(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _unshare(flags: int) -> None:
    _c(libc.unshare(flags), f"unshare {flags:#x}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _status(fd: int, **msg) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


# --- namespaces and the file-system view (B) -------------------------------------------------------------
# Each step is tried; in "probe" mode a failure is recorded, in "run" mode a step the probe achieved must
# succeed again (no silent downgrade between the probe and a run).


def _user_ns(cfg) -> None:
    """Not root: a user namespace maps our own uid to 0 inside, which lets us create the others."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _hide(cfg) -> None:
    """Overmount private or shared dirs (/root, $HOME, /tmp, /run, ...) with an empty tmpfs, then re-expose
    only what the program needs inside them (interpreter, venv, its run dir). A kept dir is held open by an
    O_PATH fd across the overmount and bound back from /proc/self/fd: its path no longer leads to it."""
    for hidden, keep in cfg["hide"]:
        fds = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path in keep]
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for fd, path in fds:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)


def _mountinfo() -> list[tuple[str, int]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            out.append((point, sum(MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))))
    return out


def _filesystem(cfg) -> None:
    """Everything read-only except a fresh size-capped tmpfs as the working dir and a fresh /dev/shm."""
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates back to the host
    _hide(cfg)
    for point, flags in _mountinfo():
        if os.path.exists(point):  # mounts under a hidden dir are gone from view
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    ids = f"uid={cfg['uid']},gid={cfg['uid']}," if cfg["uid"] is not None else ""
    _mount("tmpfs", cfg["work"], "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=0700,{ids}")
    if os.path.isdir("/dev/shm"):  # multiprocessing's semaphores need it
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=1777")


def setup(cfg) -> dict:
    """Enter the namespaces and build the view; returns what was achieved."""
    strict, want = cfg["mode"] == "run", cfg.get("require") or {}

    def step(name, fn) -> bool:
        try:
            fn(cfg)
            return True
        except OSError:
            if strict and want.get(name) not in (None, False, "cwd-only"):  # the probe achieved it
                raise
            return False

    got = {"user": "uid-drop" if os.geteuid() == 0 else None}
    if os.geteuid() != 0:
        got["user"] = "userns" if step("user", _user_ns) else None
    got["network"] = "netns" if step("network", lambda c: _unshare(CLONE_NEWNET)) else None
    got["ipc"] = step("ipc", lambda c: _unshare(CLONE_NEWIPC | CLONE_NEWUTS))
    got["filesystem"] = "ro-root" if step("filesystem", _filesystem) else "cwd-only"
    got["pid"] = step("pid", lambda c: _unshare(CLONE_NEWPID))
    return got


# --- the program (P) and the init (I) -------------------------------------------------------------------


def _limits(cfg) -> None:
    mem = cfg["memory_mb"] << 20
    cpu = int(cfg["cpu_s"]) + 1
    for res, value in ((resource.RLIMIT_AS, (mem, mem)), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_FSIZE, (cfg["disk_mb"] << 20,) * 2),
                       (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
                       (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2), (resource.RLIMIT_CORE, (0, 0))):  # fmt: skip
        resource.setrlimit(res, value)


def _program(cfg, got) -> None:
    """Runs in P: never returns (exec, or _exit after reporting why it could not)."""
    status = fcntl.fcntl(cfg["status_fd"], fcntl.F_DUPFD_CLOEXEC, 10)  # open until exec, to report failures
    step = "setup"
    try:
        os.dup2(cfg["events_fd"], 3)  # the program's optional progress channel is always fd 3
        for fd in {cfg["events_fd"], cfg["status_fd"]} - {3}:
            os.close(fd)
        os.chdir(cfg["work"])
        _limits(cfg)
        if cfg["uid"] is not None:  # root: a per-run uid owns nothing, and NPROC counts only this run
            os.setgroups([])
            os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        elif got["user"] == "userns":  # uid 0 of our user namespace could undo the mounts: nest one more
            _user_ns(cfg)
        _c(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # setuid binaries stay unprivileged
        step = f"exec {cfg['argv'][0]} as uid {os.getuid()}"  # EACCES: the interpreter is not reachable
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - anything here is a sandbox failure, reported, never raised
        _status(status, error=f"program {step}: {e!r}")
    os._exit(127)


def _init(cfg, got) -> None:
    """Runs in I (PID 1 when a PID namespace exists): mount /proc, start P, reap until P exits."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    try:
        _c(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # B gone -> all gone
        _c(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")  # orphans come to us, not to PID 1
        os.setpgid(0, 0)  # B's SIGTERM handler kills this group (without a PID namespace that is the tree)
        if got["pid"] and got["filesystem"] == "ro-root":
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # shows only this namespace
        pid = os.fork()
        if pid == 0:
            try:
                _program(cfg, got)
            finally:
                os._exit(127)  # a forked child must never fall through into its parent's code
        while True:
            done, status = os.waitpid(-1, 0)
            if done == pid:
                _status(cfg["status_fd"], wait_status=status)
                break
    except BaseException as e:  # noqa: BLE001
        _status(cfg["status_fd"], error=f"init: {e!r}")
    os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # Orphans left after I exits come to B to be reaped: the machine's PID 1 may never reap them (and a
    # zombie still counts towards its uid's NPROC).
    _c(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    signals = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # handled synchronously below, never mid-step
    try:
        got = setup(cfg)
    except OSError as e:
        _status(cfg["status_fd"], error=f"isolation: {e}")
        sys.exit(1)
    _status(cfg["status_fd"], isolation=got)
    init = os.fork()
    if init == 0:
        try:
            _init(cfg, got)
        finally:
            os._exit(0)
    # Wait for I without reaping (WNOWAIT keeps its pid, hence its process group, reserved), kill what is
    # left in its group, then reap: the kill can never reach a recycled pid.
    while os.waitid(os.P_PID, init, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        info = signal.sigtimedwait(signals, 1.0)
        if info is not None and info.si_signo == signal.SIGTERM:
            _kill(init)
    _kill(init)
    if not got["pid"] and cfg["uid"] is not None:
        _kill_uid(cfg["uid"])
    _reap_all()


def _reap_all(patience_s: float = 2.0) -> None:
    """Reap I and every orphan that came to us; stop waiting for a survivor after `patience_s` (only a
    program that escaped its group without PID namespace or own uid can be one)."""
    end = time.monotonic() + patience_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > end:
                return
            time.sleep(0.005)


def _kill_uid(uid: int) -> None:
    """Without a PID namespace a program can leave its process group (setsid); its per-run uid still marks
    it. A child that becomes that uid and calls kill(-1) reaches exactly those processes."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _kill(init: int) -> None:
    """SIGKILL I's process group, or I alone if it has not made its group yet (then P does not exist)."""
    try:
        os.killpg(init, signal.SIGKILL)
    except ProcessLookupError:
        os.kill(init, signal.SIGKILL)  # I is unreaped, so its pid cannot have been recycled


if __name__ == "__main__":
    main()
