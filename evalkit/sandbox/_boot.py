"""Sandbox bootstrap, run as `python -I -S /proc/self/fd/BOOT_FD CONFIG_FD BOOT_FD` by `evalkit.sandbox`
(stdlib only, no imports from evalkit: it runs before and outside the package). Its source and its JSON
configuration come on inherited file descriptors (memfds), so /proc/<pid>/cmdline of B and I shows neither
host paths nor settings.

Three processes: this bootstrap (B) enters new namespaces and builds the file-system view, forks the init (I,
PID 1 of a new PID namespace), which joins the run's cgroup (if any) and forks the program (P). P drops to an
unprivileged uid with rlimits, no_new_privs and a seccomp filter, and execs the interpreter. When P exits, I
exits and the kernel kills everything left in the PID namespace. B reports on the status pipe (JSON lines):
the isolation it achieved, P's wait status, or an error.
B answers SIGTERM by killing I's process group; B is a subreaper, and after I it kills and reaps every orphan
that came to it, so no process outlives the run and no zombie is left to PID 1.

One file although long: it is executed from a memfd inside the new namespaces, where no sibling module can be
imported, so everything the bootstrap does must travel in this one source.
"""

import contextlib
import ctypes
import errno
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
MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
# The same flags as statvfs() reports them (ST_RELATIME differs from MS_RELATIME).
ST_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: 1024,
    os.ST_NODIRATIME: 2048,
    os.ST_RELATIME: 1 << 21,
}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
MNT_DETACH = 2
# glibc has no pivot_root wrapper; on other machines the allow-list view is not built (ro-root is).
PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYS_PIVOT_ROOT = PIVOT_ROOT_NR.get(os.uname().machine)
# Where pivot_root parks the host's root until I has mounted its /proc (see _allowlist).
HOST_ROOT = "/.host"

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


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _status(fd: int, **msg) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


# --- namespaces and the file-system view (B) -------------------------------------------------------------
# Each step is tried; in "probe" mode a failure is recorded, in "run" mode a step the probe achieved must
# succeed again (no silent downgrade between the probe and a run).


def _user_ns(cfg) -> None:
    """Not root: a user namespace maps our own uid to 0 inside, which lets us create the others."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        _write(f"self/{name}", text, cfg["proc_fd"])  # the host's /proc: P's view may have none


def _hide(cfg) -> None:
    """Overmount private or shared dirs (/root, $HOME, /tmp, /run, the harness's checkout, ...) with an empty
    tmpfs, then re-expose only what the program needs inside them (interpreter, venv, its run dir). A kept
    dir is held open by an O_PATH fd across the overmount and bound back from /proc/self/fd: its path no
    longer leads to it. A dir already gone from view (inside one hidden before) needs nothing."""
    for hidden, keep in cfg["hide"]:
        if not keep and not os.path.isdir(hidden):
            continue
        try:
            fds = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path in keep]
            _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
            for fd, path in fds:
                os.makedirs(path, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                os.close(fd)
        except OSError as e:
            raise OSError(e.errno, f"ro-root view: hiding {hidden} (keeping {keep}): {e.strerror}") from None


def _mountinfo() -> list[tuple[str, int]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            out.append((point, sum(MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))))
    return out


def _filesystem(cfg, want: str | None) -> str:
    """A private mount namespace and the allow-list view, or the read-only host view where the allow-list
    cannot be built (never when `want`, the probe's result, is the allow-list)."""
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates back to the host
    if want in (None, "allowlist"):
        try:
            _allowlist(cfg)
            return "allowlist"
        except OSError:
            if want == "allowlist":
                raise
    _ro_root(cfg)
    return "ro-root"


def _allowlist(cfg) -> None:
    """Build the program's root from nothing: a tmpfs holding only cfg["view"], the working dir and /dev/shm,
    then pivot into it. The tmpfs is mounted on the run's work dir (any empty dir would do; inside, work is
    overmounted again). The host's root stays at HOST_ROOT until I has mounted /proc (in a user namespace
    the kernel mounts a proc only while one is visible), then I detaches it for good."""
    new = cfg["work"]
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    umask = os.umask(0o022)  # the program's uid must traverse every dir made here
    try:
        for kind, path, *target in cfg["view"]:
            _place(new, kind, path, *target)
        for d in ("/proc", "/dev/shm", HOST_ROOT):
            os.makedirs(new + d, exist_ok=True)
        _scratch(cfg, new)
        _pivot_root(new, new + HOST_ROOT)
        os.chdir("/")
    except OSError:
        libc.umount2(new.encode(), MNT_DETACH)
        raise
    finally:
        os.umask(umask)


def _pivot_root(new: str, old: str) -> None:
    if SYS_PIVOT_ROOT is None:
        raise OSError(errno.ENOSYS, f"pivot_root: syscall number unknown on {os.uname().machine}")
    _c(libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), new.encode(), old.encode()), "pivot_root")


def _place(new: str, kind: str, path: str, target: str | None = None) -> None:
    """One step of the view (see `_host.base_view`) under the new root `new`, at the host path."""
    dst = new + path
    if kind == "blank":  # a file inside a dir bound before
        _mount("/dev/null", dst, None, MS_BIND)
        return
    if kind == "empty":  # a dir inside one bound before (the harness's own packages: code, task data)
        _mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
        return
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if kind == "link":
        os.symlink(target, dst)
        return
    if os.path.isdir(path):
        os.makedirs(dst, exist_ok=True)
    else:
        os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(path, dst, None, MS_BIND)  # not MS_REC: mounts below a bound dir stay out of the view
    if kind == "ro":  # flags the source mount has must be repeated (in a user namespace they are locked)
        flags = os.statvfs(dst).f_flag
        kept = sum(ms for st, ms in ST_TO_MS.items() if flags & st)
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def _ro_root(cfg) -> None:
    """Everything read-only except a fresh size-capped tmpfs as the working dir and a fresh /dev/shm."""
    _hide(cfg)
    for point, flags in _mountinfo():
        if os.path.exists(point):  # mounts under a hidden dir are gone from view
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    _scratch(cfg, "")


def _scratch(cfg, new: str) -> None:
    """The writable places under the root `new`: the working dir and /dev/shm (multiprocessing's semaphores
    need it), two dirs of one tmpfs of `disk_mb`: every file the program writes counts against that one
    size (in no-fork mode its memory bound is address space plus these files)."""
    work, uid = new + cfg["work"], cfg["uid"]
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=0700")
    for name, mode in ((".shm", 0o1777), (".work", 0o700)):
        os.mkdir(f"{work}/{name}")
        os.chmod(f"{work}/{name}", mode)  # past the umask
    if uid is not None:
        os.chown(f"{work}/.work", uid, uid)
    if os.path.isdir(new + "/dev/shm"):
        _mount(f"{work}/.shm", new + "/dev/shm", None, MS_BIND)
    _mount(f"{work}/.work", work, None, MS_BIND)  # covers the tmpfs's root: only .work shows there


def setup(cfg) -> dict:
    """Enter the namespaces and build the view; returns what was achieved."""
    strict, want = cfg["mode"] == "run", cfg.get("require") or {}

    def step(name, fn, failed=False):
        try:
            done = fn(cfg)
            return True if done is None else done
        except OSError:
            if strict and want.get(name) not in (None, False, "cwd-only"):  # the probe achieved it
                raise
            return failed

    got = {"user": "uid-drop" if os.geteuid() == 0 else None}
    got["seccomp"] = want.get("seccomp", False) if strict else _seccomp_works()
    if os.geteuid() != 0:
        got["user"] = "userns" if step("user", _user_ns) else None
    got["network"] = "netns" if step("network", lambda c: _unshare(CLONE_NEWNET)) else None
    got["ipc"] = step("ipc", lambda c: _unshare(CLONE_NEWIPC | CLONE_NEWUTS))
    got["filesystem"] = step("filesystem", lambda c: _filesystem(c, want.get("filesystem")), "cwd-only")
    got["pid"] = step("pid", lambda c: _unshare(CLONE_NEWPID))  # last: our next child is its PID 1
    return got


def _seccomp_works() -> bool:
    """Whether this kernel and architecture take our filter: a throwaway child installs it."""
    if os.uname().machine not in SYSCALLS:
        return False
    pid = os.fork()
    if pid == 0:
        try:
            _c(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            install_seccomp(no_fork=True)
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


# --- seccomp (P) ------------------------------------------------------------------------------------------
# A classic BPF filter, built here because Python has no seccomp module. It always refuses new namespaces
# (unshare, setns, clone with a CLONE_NEW* flag): a nested user namespace would give the program capabilities
# (mounts, more namespaces) over its own view; and the kernel keyrings (add_key, request_key, keyctl): a
# user's keyrings outlive its processes, and per-run uids are reused, so a key would pass from one run to the
# next. With `no_fork` it also refuses new processes (fork, vfork, clone without CLONE_THREAD), so RLIMIT_AS
# bounds the whole program (threads share the one address space), and the memory that is no address space
# and can grow without a bound other than the descriptors: memfds (and secret ones), SysV shared memory and
# message queues, io_uring's rings, pipes grown past their default size (fcntl F_SETPIPE_SZ), and pages lent
# to a pipe by vmsplice. What stays: files on its one tmpfs (disk_mb) and socket and default-size pipe
# buffers (a few tens of MB with 256 descriptors). clone3 passes its flags in memory a filter cannot read:
# ENOSYS, and glibc falls back to clone.

SECCOMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_* of the native ABI
SYSCALLS = {  # the clone/namespace calls, the dedicated fork calls (aarch64 has none), keyrings, memory
    "x86_64": {
        "unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "fork": 57, "vfork": 58,
        "add_key": 248, "request_key": 249, "keyctl": 250,
        "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "io_uring_setup": 425,
        "vmsplice": 278, "fcntl": 72,
    },
    "aarch64": {
        "unshare": 97, "setns": 268, "clone": 220, "clone3": 435,
        "add_key": 217, "request_key": 218, "keyctl": 219,
        "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "io_uring_setup": 425,
        "vmsplice": 75, "fcntl": 25,
    },
}  # fmt: skip
ALWAYS_DENIED = ("unshare", "setns", "add_key", "request_key", "keyctl")
NOFORK_DENIED = (
    "fork",
    "vfork",
    "memfd_create",
    "memfd_secret",
    "shmget",
    "msgget",
    "io_uring_setup",
    "vmsplice",
)
F_SETPIPE_SZ = 1031
X32_BIT = 0x40000000  # x86_64's x32 ABI numbers: refused wholesale (same calls, other numbers)
CLONE_THREAD, CLONE_NEW_ANY = 0x00010000, 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF opcodes (class | size/op | source)


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def seccomp_program(machine: str, no_fork: bool) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions. seccomp_data: nr at offset 0, arch at 4, the low 32
    bits of args[0] (clone's flags) at 16, of args[1] (fcntl's command) at 24. Jumps are relative; `deny`
    and `allow` are the last two."""
    nr = SYSCALLS[machine]
    deny_nr = [nr[name] for name in ALWAYS_DENIED + (NOFORK_DENIED if no_fork else ()) if name in nr]
    head = [(LD_W_ABS, 0, 0, 4), (JEQ, 1, 0, SECCOMP_ARCH[machine]), ("deny",), (LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":
        head.append((JGE, "deny", 0, X32_BIT))
    head += [(JEQ, "deny", 0, n) for n in deny_nr]
    if no_fork:  # fcntl: refuse F_SETPIPE_SZ only (the two instructions after the test read its command)
        head += [(JEQ, 0, 2, nr["fcntl"]), (LD_W_ABS, 0, 0, 24), (JEQ, "deny", "allow", F_SETPIPE_SZ)]
    head += [
        (JEQ, "nosys", 0, nr["clone3"]),
        (JEQ, 0, "allow", nr["clone"]),
        (LD_W_ABS, 0, 0, 16),
        (JSET, "deny", 0, CLONE_NEW_ANY),
    ]
    if no_fork:
        head.append((JSET, "allow", "deny", CLONE_THREAD))
    tail = {
        "allow": (RET, 0, 0, RET_ALLOW),
        "deny": (RET, 0, 0, RET_ERRNO | errno.EPERM),
        "nosys": (RET, 0, 0, RET_ERRNO | errno.ENOSYS),
    }
    return _resolve(head, tail)


def _resolve(head: list, tail: dict) -> list[tuple[int, int, int, int]]:
    """Turn the symbolic targets of `head` ("deny", "allow", "nosys") into relative jumps to `tail`."""
    body = [(RET, 0, 0, tail["deny"][3]) if ins == ("deny",) else ins for ins in head]
    at = {name: len(body) + i for i, name in enumerate(tail)}
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        jt, jf = (at[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        out.append((code, jt, jf, k))
    return out + list(tail.values())


def install_seccomp(no_fork: bool) -> None:
    """Load the filter into this process (inherited by everything it execs or starts). Needs no_new_privs."""
    insns = seccomp_program(os.uname().machine, no_fork)
    array = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    prog = _Prog(len(insns), array)
    _c(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


# --- the program (P) and the init (I) -------------------------------------------------------------------


def _limits(cfg) -> None:
    mem = cfg["memory_mb"] << 20
    cpu = int(cfg["cpu_s"]) + 1
    for res, value in (
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (cfg["disk_mb"] << 20,) * 2),
        (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
        (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
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
            # B made itself (so us) non-dumpable, which makes our /proc files root's: we could not write maps
            _c(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
            _user_ns(cfg)
        for fd in (cfg["proc_fd"], cfg["cgroup_fd"]):  # no handle on the host's /proc or cgroups reaches it
            if fd is not None:
                os.close(fd)
        # the uid change cleared it: should I die (B or the harness killed), P dies too, even without a PID ns
        _c(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        _c(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # setuid binaries stay unprivileged
        if got["seccomp"]:
            step = "seccomp"
            install_seccomp(no_fork=cfg["no_fork"])
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
        if got["filesystem"] == "allowlist":
            _leave_host(got)
        elif got["pid"] and got["filesystem"] == "ro-root":
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # shows only this namespace
        _join_cgroup(cfg)
        pid = os.fork()
        if pid == 0:
            try:
                _program(cfg, got)
            finally:
                os._exit(127)  # a forked child must never fall through into its parent's code
        if cfg["proc_fd"] is not None:  # P's copy is all it needs
            os.close(cfg["proc_fd"])
        while True:
            done, status = os.waitpid(-1, 0)
            if done == pid:
                _status(cfg["status_fd"], wait_status=status)
                break
    except BaseException as e:  # noqa: BLE001
        _status(cfg["status_fd"], error=f"init: {e!r}")
    os._exit(0)


def _join_cgroup(cfg) -> None:
    """Move I (so P and everything P starts) into the run's cgroup, whose memory.max caps the whole program.
    The host opened its cgroup.procs for us ("0" names the writer). A probe that cannot join says so and
    falls back to forbidding fork; a run that was promised the cgroup fails instead."""
    fd = cfg.pop("cgroup_fd", None)
    cfg["cgroup_fd"] = None
    if fd is None:
        return
    try:
        os.write(fd, b"0")
        _status(cfg["status_fd"], cgroup=True)
    except OSError as e:
        if cfg["mode"] == "run":
            raise
        _status(cfg["status_fd"], cgroup=False, cgroup_error=str(e))
        cfg["no_fork"] = True
    finally:
        os.close(fd)


def _leave_host(got) -> None:
    """In I, allow-list view: mount this PID namespace's /proc (without one, /proc stays empty: the host's
    would show the harness), detach the host's root for good and make the root read-only."""
    if got["pid"]:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _c(libc.umount2(HOST_ROOT.encode(), MNT_DETACH), "umount host root")
    os.rmdir(HOST_ROOT)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def main() -> None:
    with open(int(sys.argv[1]), encoding="utf-8") as f:  # the host's memfd; closed once read
        cfg = json.load(f)
    if len(sys.argv) > 2:  # the memfd this script was read from: the program must not inherit it
        os.close(int(sys.argv[2]))
    # Nothing outlives the harness: killed outright (SIGKILL, or SIGTERM's default action) it cannot stop us,
    # so the kernel does (I and P follow B: each has the same signal on its parent's death, and the PID
    # namespace dies with I). A harness gone before this line is caught by the parent check.
    _c(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if os.getppid() != cfg["parent"]:
        sys.exit(1)
    # Orphans left after I exits come to B to be reaped: the machine's PID 1 may never reap them (and a
    # zombie still counts towards its uid's NPROC).
    _c(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    signals = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # handled synchronously below, never mid-step
    proc = cfg["proc_fd"] = _open_proc()
    try:
        got = setup(cfg)
    except OSError as e:
        _status(cfg["status_fd"], error=f"isolation: {e}")
        sys.exit(1)
    # In a user namespace the program shares B's and I's kuid: non-dumpable, they can be neither ptraced by
    # it (I holds the capabilities over the mounts) nor read through /proc/PID (fds, memory, environ).
    _c(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    _status(cfg["status_fd"], isolation=got)
    init = os.fork()
    if init == 0:
        try:
            _init(cfg, got)
        finally:
            os._exit(0)
    if cfg["cgroup_fd"] is not None:  # I's copy is the one that joins
        os.close(cfg["cgroup_fd"])
    # Wait for I without reaping (WNOWAIT keeps its pid, hence its process group, reserved), kill what is
    # left in its group, then reap: the kill can never reach a recycled pid.
    while os.waitid(os.P_PID, init, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        info = signal.sigtimedwait(signals, 1.0)
        if info is not None and info.si_signo == signal.SIGTERM:
            _kill(init)
    _kill(init)
    if not got["pid"] and cfg["uid"] is not None:
        _kill_uid(cfg["uid"])
    _kill_orphans(proc)


def _open_proc() -> int | None:
    """The host's /proc, held from the start: the user-namespace maps are written through it after the view
    hid it, and B lists its children in it at the end. Above fd 3, which P overwrites with the events fd."""
    try:
        fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)


def _kill_orphans(proc: int | None, patience_s: float = 2.0) -> None:
    """Reap I, then kill and reap every process that came to us. Without a PID namespace a program can leave
    I's process group (setsid) but not our subreaper reach: once its parent dies it is our child. Each round
    kills our live children (only unreaped ones: a recycled pid is never hit), whose children come to us
    for the next. Gives up on a survivor after `patience_s` (stuck in the kernel, or no /proc to list)."""
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        for pid in _children(proc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        signal.sigtimedwait({signal.SIGCHLD}, 0.05)  # blocked since the start: a child ended, or a pause


def _children(proc: int | None) -> list[int]:
    """Our children (zombies included), read from the host's /proc."""
    if proc is None:
        return []
    try:
        fd = os.open("thread-self/children", os.O_RDONLY, dir_fd=proc)
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: scan every process
        return [int(p) for p in os.listdir(proc) if p.isdigit() and _ppid(proc, p) == os.getpid()]
    try:
        return [int(p) for p in os.read(fd, 1 << 20).split()]
    finally:
        os.close(fd)


def _ppid(proc: int, pid: str) -> int | None:
    try:
        fd = os.open(f"{pid}/stat", os.O_RDONLY, dir_fd=proc)
    except OSError:
        return None
    try:
        return int(os.read(fd, 4096).rsplit(b")", 1)[1].split()[1])
    finally:
        os.close(fd)


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
