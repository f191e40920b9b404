"""Sandboxed executor for generated code (docs/security.md has the full account).

A completion produced by a model under test is hostile until proven otherwise: it may loop, eat
memory, fork, fill the disk, read secrets, or try to reach the network. Scoring it must never
disturb the test session or show it anything of the host, so every program runs in a fresh
interpreter inside a *jail* built from kernel barriers, probed once per process strongest first:

jail (bubblewrap, ``bwrap``; as root without it, the same view built with util-linux: a tmpfs
root of read-only bind mounts in fresh namespaces, entered with ``chroot``)
    - a new root holding only read-only binds of ``/usr`` and the ``/lib*``, ``/bin`` links, the
      interpreter binary, its shared library and its standard library, ``/proc`` and a minimal
      ``/dev`` of its own, and a private size-capped ``/tmp`` holding the working directory:
      ``/root``, ``/home``, ``/etc``, the project checkout and every other process's files are
      not there at all; no installed package shows either (empty read-only directories hide
      ``site-packages``/``dist-packages``, the other Python trees under ``/usr`` such as Debian's
      ``/usr/lib/python3``, and ``/usr/local`` unless the interpreter lives there);
    - its own pid, network (no route anywhere, not even to the host's loopback), IPC, UTS and
      cgroup namespaces; killed with its parent;
    - as a real unprivileged user (uid 65534 via ``setpriv``, when the parent is root: no user
      namespace, so the kernel's own permission checks and RLIMIT_NPROC apply), no capabilities,
      ``no_new_privs``.
kernel barriers inside (also without a jail)
    - a seccomp filter (:mod:`pytest_dflash.sandbox.seccomp`): no new process, no exec, no ptrace or
      namespace calls, no io_uring/bpf/userfaultfd/keyring;
    - resource limits: address space, CPU seconds, processes, file size, no core dumps;
    - a wall timeout that kills the whole group.
courtesy layer (Python-level, *not* a barrier: a program can undo it, e.g. by re-importing
``posix``)
    - spawning, sockets, writes outside the working directory, ``chdir`` raise PermissionError
      early with a readable message; a scrubbed environment, umask 077.

Without either jail there is no file-system barrier: the host's files would be readable. Then
:func:`run_untrusted` refuses (:class:`SandboxUnavailable`) unless the caller opts in
(``allow_unjailed=True``; pytest option ``--dflash-allow-unjailed``, environment
``DFLASH_ALLOW_UNJAILED=1``), and the opt-in is named in every result's isolation line. The
unjailed path keeps what util-linux offers: an empty network namespace, read-only host file
systems except the working directory (mount namespace), the ``nobody`` user.

The interpreter runs with ``-s -S -P -B`` (no user or system site-packages, no unsafe path entry,
no bytecode writes): the programs get the standard library only. ``-I`` is not used because it
also implies ``-E``, which would ignore PYTHONHASHSEED; the environment is built from scratch
here, so no other PYTHON* variable can reach the child anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import pwd
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

from pytest_dflash.sandbox import seccomp

Status = Literal["passed", "failed", "timeout", "killed", "error"]

#: exit status the bootstrap uses when the sandbox itself could not be set up
SETUP_FAILED = 120
#: exit status the bootstrap uses when the program raised SystemExit (even with code 0)
PROGRAM_EXITED = 121

#: environment variable that opts in to running generated code without a file-system jail
ALLOW_UNJAILED_ENV = "DFLASH_ALLOW_UNJAILED"
_UNPRIVILEGED_FALLBACK_UID = 65534
#: the working directory inside the jail (on the private, size-capped /tmp)
JAIL_WORKDIR = "/tmp/work"


class SandboxUnavailable(RuntimeError):
    """No file-system jail can be built here and the caller did not opt in to running without."""


# The bootstrap runs inside the child before the program: limits, seccomp, guards, then the
# program. It reads its configuration from argv[1] as JSON; the exit statuses and the seccomp
# installer are pasted in here.
_BOOTSTRAP_TEMPLATE = r"""
import sys
@SECCOMP_INSTALL@
_real_exit = __import__("os")._exit
try:
    import builtins, io, json, os, posix, resource, socket, subprocess, _io
    cfg = json.loads(sys.argv[1])
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if cfg["seccomp"]:
        _install_seccomp(cfg["seccomp"])
    os.umask(0o077)
    os.chdir(cfg["workdir"])
    WORKDIR = os.path.realpath(cfg["workdir"])
    with open(cfg["program"], encoding="utf-8") as fh:
        source = fh.read()

    def _deny(what):
        def denied(*args, **kwargs):
            raise PermissionError(f"sandbox: {what} is not allowed")
        denied.__name__ = what.rsplit(".", 1)[-1]
        return denied

    def _resolve(path, dir_fd=None):
        path = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def _require_inside(path, dir_fd=None, what="write"):
        if isinstance(path, int):
            return
        resolved = _resolve(path, dir_fd)
        if resolved != WORKDIR and not resolved.startswith(WORKDIR + os.sep):
            raise PermissionError(f"sandbox: {what} outside the working directory: {resolved}")

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    _real_os_open = os.open
    def _guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & _WRITE_FLAGS:
            _require_inside(path, dir_fd)
        return _real_os_open(path, flags, mode, dir_fd=dir_fd)

    _real_open = builtins.open
    def _guarded_open(file, mode="r", *args, **kwargs):
        if any(ch in mode for ch in "wax+"):
            _require_inside(file)
        return _real_open(file, mode, *args, **kwargs)

    class _GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", closefd=True, opener=None):
            if any(ch in mode for ch in "wax+"):
                _require_inside(file)
            super().__init__(file, mode, closefd, opener)

    def _inside_only(name, npaths):
        real = getattr(os, name)
        def guarded(*args, **kwargs):
            keys = ("src_dir_fd", "dst_dir_fd") if npaths == 2 else ("dir_fd",)
            for path, key in zip(args[:npaths], keys):
                _require_inside(path, kwargs.get(key), what=f"os.{name}")
            return real(*args, **kwargs)
        guarded.__name__ = name
        return guarded

    _INSIDE_ONLY = {
        "remove": 1, "unlink": 1, "rmdir": 1, "mkdir": 1, "chmod": 1, "lchmod": 1, "chown": 1,
        "lchown": 1, "truncate": 1, "utime": 1, "mkfifo": 1, "mknod": 1, "setxattr": 1,
        "removexattr": 1, "rename": 2, "replace": 2, "link": 2, "symlink": 2,
    }
    _DENIED = [
        "fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
        "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
        "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg",
        "setsid", "setpgid", "setpgrp", "setuid", "setgid", "seteuid", "setegid", "setreuid",
        "setregid", "setresuid", "setresgid", "setgroups", "chdir", "fchdir", "chroot", "fchmod",
        "fchown", "chflags", "lchflags", "_exit", "pidfd_open",
    ]
    patches = {name: _inside_only(name, n) for name, n in _INSIDE_ONLY.items() if hasattr(os, name)}
    patches.update({name: _deny(f"os.{name}") for name in _DENIED if hasattr(os, name)})
    patches["open"] = _guarded_os_open
    for module in (os, posix):
        for name, fn in patches.items():
            if hasattr(module, name):
                setattr(module, name, fn)

    builtins.open = io.open = _io.open = _guarded_open
    io.FileIO = _io.FileIO = _GuardedFileIO
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                 "getstatusoutput"):
        setattr(subprocess, name, _deny(f"subprocess.{name}"))
    for name in ("socket", "SocketType", "create_connection", "create_server", "socketpair",
                 "fromfd", "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        if hasattr(socket, name):
            setattr(socket, name, _deny(f"socket.{name}"))
    for name in ("_posixsubprocess", "_socket", "ctypes", "_ctypes", "multiprocessing",
                 "_multiprocessing", "pty", "_posixshmem"):
        sys.modules[name] = None
    subprocess.__dict__.pop("_posixsubprocess", None)
    socket.__dict__.pop("_socket", None)
    sys.argv = [cfg["program"]]
except BaseException as exc:
    sys.stderr.write(f"dflash-sandbox: setup failed: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    _real_exit(@SETUP_FAILED@)

_status = 0
try:
    code = compile(source, cfg["program"], "exec")
    exec(code, {"__name__": "__main__", "__builtins__": builtins})
except SystemExit as exc:
    sys.stderr.write(f"dflash-sandbox: the program raised SystemExit({exc.code!r}); scored as a "
                     "failure because its tests may not have run\n")
    _status = @PROGRAM_EXITED@
except BaseException:
    import traceback
    traceback.print_exc()
    _status = 1
try:
    sys.stdout.flush()
    sys.stderr.flush()
except BaseException:
    _status = _status or 1
_real_exit(_status)
"""
_BOOTSTRAP = (
    _BOOTSTRAP_TEMPLATE.replace("@SETUP_FAILED@", str(SETUP_FAILED))
    .replace("@PROGRAM_EXITED@", str(PROGRAM_EXITED))
    .replace("@SECCOMP_INSTALL@", seccomp.INSTALL_SOURCE)
)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one untrusted program.

    ``status``: ``passed`` (exit 0), ``failed`` (non-zero exit: assertion, exception, SystemExit,
    refused operation), ``timeout`` (wall limit hit, group killed), ``killed`` (ended by a signal,
    e.g. SIGXCPU from the CPU limit), ``error`` (the sandbox itself could not start the program).
    ``isolation`` names every barrier that held (``files: bubblewrap jail ...`` first).
    """

    passed: bool
    status: Status
    returncode: int | None
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    isolation: tuple[str, ...] = ()


# Unjailed path only: runs as root inside the new mount namespace (unshare makes its propagation
# private, so nothing here reaches the host): every file system read-only except the work dir.
_MOUNT_SCRIPT = r"""
set -e
work="$1"; shift
mount -o remount,bind,ro /
for m in /dev/shm /run/lock /var/tmp /tmp; do
  if mountpoint -q "$m"; then mount -o remount,bind,ro "$m"; fi
done
mount --bind "$work" "$work"
mount -o remount,bind,rw "$work"
cd "$work"  # the inherited cwd still points into the read-only mount under the bind
exec "$@"
"""

_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def _interpreter() -> Path:
    """The base interpreter binary: a virtual environment adds nothing the programs may use."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix) / "bin" / version
    return base if base.is_file() else Path(os.path.realpath(sys.executable))


def _interpreter_files() -> list[Path]:
    """The paths to bind read-only so the interpreter starts in the jail."""
    stdlib = Path(os.path.realpath(os.path.dirname(os.__file__)))
    binds = [Path(os.path.realpath(_interpreter())), stdlib]
    dynload = sysconfig.get_config_var("DESTSHARED")
    if dynload and Path(dynload).is_dir():
        binds.append(Path(os.path.realpath(dynload)))
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        if libdir and soname and (Path(libdir) / soname).exists():
            binds.append(Path(os.path.realpath(Path(libdir) / soname)))
    return [b for i, b in enumerate(binds) if not any(b == o or o in b.parents for o in binds[:i])]


#: Where installed Python code lives beside the standard library: the jail hides every one that
#: its binds would show (``/usr`` shows Debian's ``/usr/lib/python3/dist-packages``, pip's
#: wheels, other interpreters' trees), except a directory that holds the interpreter's own files,
#: whose ``site-packages``/``dist-packages`` are hidden instead.
_PACKAGE_NAMES = ("site-packages", "dist-packages")
_PACKAGE_GLOBS = ("/usr/local", "/usr/lib*/python*", "/usr/local/lib*/python*",
                  "/usr/share/python*", "/usr/share/pyshared")


def _installed_packages() -> list[str]:
    """Every directory where packages are installed for the base interpreter, as the interpreter
    itself names them (Debian's adds ``dist-packages`` under ``/usr/local`` and ``/usr/lib``)."""
    bases = [sys.base_prefix, sys.base_exec_prefix]
    scheme = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    return [*site.getsitepackages(bases), scheme["purelib"], scheme["platlib"]]


def _hidden(binds: list[Path], shown: list[Path]) -> list[Path]:
    """The directories of host Python code that the jail's binds (``shown``: the system
    directories and ``binds``) would expose, outermost first; none holds one of ``binds``."""
    def holds(d: Path) -> bool:
        return any(d == b or d in b.parents for b in binds)

    candidates = [Path(p) for pattern in _PACKAGE_GLOBS for p in sorted(glob.glob(pattern))]
    candidates += [Path(p) for p in _installed_packages()]
    candidates += [b / name for b in binds for name in _PACKAGE_NAMES]
    hidden: list[Path] = []
    for candidate in candidates:
        path = Path(os.path.realpath(candidate))
        if not path.is_dir() or not any(s == path or s in path.parents for s in shown):
            continue
        if holds(path):
            hidden += [path / name for name in _PACKAGE_NAMES
                       if (path / name).is_dir() and not holds(path / name)]
        else:
            hidden.append(path)
    hidden = sorted(set(hidden), key=lambda p: (len(p.parts), p))
    return [h for i, h in enumerate(hidden) if not any(o in h.parents for o in hidden[:i])]


@dataclasses.dataclass(frozen=True)
class _Launcher:
    """The command chain that wraps the interpreter, as probed on this machine."""

    jail: str  # the file-system jail that holds: "bwrap", "chroot", or "" for none
    prefix: tuple[str, ...]  # bwrap and its fixed arguments; (unshare, chroot, *view); or unshare
    drop: tuple[str, ...]  # e.g. ("/usr/bin/setpriv", "--reuid=65534", ..., "--")
    uid: int | None  # the unprivileged user the child runs as; None when it keeps the parent's
    mount_ns: bool = False  # unjailed path: read-only host file systems via a mount namespace
    seccomp: str | None = None  # the filter (hex) the bootstrap installs
    isolation: tuple[str, ...] = ()

    def argv(self, root: Path, disk_bytes: int) -> tuple[list[str], Path]:
        """(command before the interpreter, working directory as the program sees it); the
        chroot jail's mount point is made under ``root`` here."""
        if self.jail == "bwrap":
            jail = [*self.prefix, "--size", str(disk_bytes), "--perms", "1777", "--tmpfs", "/tmp",
                    "--perms", "0777", "--dir", JAIL_WORKDIR,
                    "--ro-bind", str(root / "program.py"), f"{JAIL_WORKDIR}/program.py",
                    "--chdir", JAIL_WORKDIR, "--"]
            return jail + list(self.drop), Path(JAIL_WORKDIR)
        if self.jail == "chroot":
            (root / "jail").mkdir(mode=0o700)
            unshare, chroot, *specs = self.prefix
            jail = [unshare, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
                    "--kill-child", "--", "/bin/sh", "-c", _CHROOT_SCRIPT, "dflash-jail",
                    str(root / "jail"), str(root / "program.py"), str(disk_bytes), chroot,
                    JAIL_WORKDIR, *specs, "--"]
            return jail + list(self.drop), Path(JAIL_WORKDIR)
        work = root / "work"
        chain = list(self.prefix)
        if self.mount_ns:
            chain += ["/bin/sh", "-c", _MOUNT_SCRIPT, "dflash-sandbox", str(work)]
        return chain + list(self.drop), work


def _jail_view() -> list[tuple[str, str, str]]:
    """What a jail shows, as (op, path, target): ``link`` a system-directory symlink, ``dir`` an
    empty traversable parent, ``bind`` a read-only bind, ``hide`` an empty directory on top."""
    view: list[tuple[str, str, str]] = []
    for name in _SYSTEM_DIRS:
        path = Path(name)
        if path.is_symlink():
            view.append(("link", name, os.readlink(path)))
        elif path.is_dir():
            view.append(("bind", name, ""))
    binds = _interpreter_files()
    shown = [Path(name) for op, name, _ in view if op == "bind"] + binds
    hidden = _hidden(binds, shown)
    # Parents of the binds outside the system directories (e.g. a pyenv under a home directory)
    # are created traversable and empty: bwrap would copy the host's mode (0700 for /root).
    system = [Path(name) for name in _SYSTEM_DIRS]
    parents = sorted({parent for path in binds for parent in path.parents
                      if parent != Path("/") and not any(s == parent or s in parent.parents
                                                         for s in system)},
                     key=lambda p: len(p.parts))
    view += [("dir", str(parent), "") for parent in parents]
    view += [("bind", str(path), "") for path in binds]
    view += [("hide", str(path), "") for path in hidden]
    return view


def _bwrap_prefix(bwrap: str, as_root: bool) -> list[str]:
    """bubblewrap's fixed arguments: namespaces and the read-only view of the interpreter."""
    if as_root:
        # No user namespace: the program becomes the real uid 65534 through setpriv (with
        # --unshare-user bwrap would map its uid to host root, merely without capabilities).
        chain = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup-try"]
    else:
        chain = [bwrap, "--unshare-all", "--cap-drop", "ALL"]
    chain += ["--die-with-parent", "--new-session"]
    options = {"link": ["--symlink"], "dir": ["--perms", "0755", "--dir"],
               "bind": ["--ro-bind"], "hide": ["--perms", "0555", "--size", "4096", "--tmpfs"]}
    for op, path, target in _jail_view():
        chain += [*options[op], *([target] if op == "link" else [path] if op == "bind" else []),
                  path]
        if op == "hide":  # in a user namespace the tmpfs would belong to the program
            chain += ["--remount-ro", path]
    return chain + ["--proc", "/proc", "--dev", "/dev"]


# The chroot jail (root, util-linux only): runs as root in fresh mount, pid, network, IPC and UTS
# namespaces (unshare makes mount propagation private: nothing reaches the host), builds the same
# view as the bubblewrap jail on a tmpfs, and runs the command chrooted. The shell stays pid 1 of
# the namespace, so the program is an ordinary process that dies with it.
_CHROOT_SCRIPT = r"""
set -eu
new="$1"; program="$2"; size="$3"; chroot="$4"; work="$5"; shift 5
mount -t tmpfs -o mode=0755,size=1m dflash-root "$new"
while [ "$1" != "--" ]; do
  op="${1%%:*}"; rest="${1#*:}"; shift
  case "$op" in
    link) ln -s "${rest#*:}" "$new${rest%%:*}" ;;
    dir) mkdir -p -m 0755 "$new$rest" ;;
    bind)
      # already visible through an earlier bind (an interpreter under /usr): nothing to add
      if [ -e "$new$rest" ] \
         && [ "$(stat -L -c %d:%i "$rest")" = "$(stat -L -c %d:%i "$new$rest")" ]; then
        continue
      fi
      if [ -d "$rest" ]; then mkdir -p "$new$rest"
      else mkdir -p "$(dirname "$new$rest")"; : > "$new$rest"; fi
      mount --bind "$rest" "$new$rest"
      mount -o remount,bind,ro,nosuid,nodev "$new$rest" ;;
    hide) mount -t tmpfs -o mode=0555,size=4k,ro dflash-hide "$new$rest" ;;
  esac
done
shift
mkdir -p "$new/proc" "$new/dev" "$new/tmp"
mount -t proc -o nosuid,nodev,noexec proc "$new/proc"
for d in null zero full random urandom; do
  : > "$new/dev/$d"; mount --bind "/dev/$d" "$new/dev/$d"
done
mount -t tmpfs -o "mode=1777,size=$size,nosuid,nodev" dflash-tmp "$new/tmp"
mkdir -m 0777 "$new$work"
cp "$program" "$new$work/program.py"; chmod 0444 "$new$work/program.py"
mount -o remount,ro "$new"
"$chroot" "$new" "$@"
"""


def _chroot_specs() -> list[str]:
    return [f"{op}:{path}:{target}" if op == "link" else f"{op}:{path}"
            for op, path, target in _jail_view()]


def _others_can_reach(path: Path) -> bool:
    """True if a user with no privileges can traverse every directory down to ``path``."""
    path = path.resolve()
    for part in (path, *path.parents):
        mode = part.stat().st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return bool(path.stat().st_mode & stat.S_IROTH)


def _unprivileged_uid() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return _UNPRIVILEGED_FALLBACK_UID


def _setpriv_drop(setpriv: str, uid: int, keep_read: bool) -> tuple[str, ...]:
    caps = "-all,+dac_read_search" if keep_read else "-all"
    return (setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
            f"--inh-caps={caps}", f"--bounding-set={caps}",
            *(["--ambient-caps=+dac_read_search"] if keep_read else []), "--")


# The probe program: every barrier is checked by trying to break it, not by trusting the tools.
_PROBE = r"""
import os, sys
cfg = {cfg!r}
open("probe", "w").close()
assert sys.version == cfg["version"], "another interpreter ran: " + sys.version
if cfg["jail"]:
    for path in cfg["invisible"]:
        assert not os.path.lexists(path), "visible in the jail: " + path
    for path in cfg["hidden"]:
        assert not os.listdir(path), "host packages visible in the jail: " + path
if cfg["seccomp"]:
    sys.modules.pop("posix", None)
    import posix
    try:
        pid = posix.fork()
    except PermissionError:
        pass
    else:
        if pid == 0:
            posix._exit(0)
        raise AssertionError("fork was allowed under the seccomp filter")
"""


def _try(launcher: _Launcher, **checks: object) -> str | None:
    """Run the probe through ``launcher`` with the real bootstrap; None if every check held."""
    secret = Path(tempfile.mkdtemp(prefix="dflash-sandbox-canary-"))
    try:
        (secret / "canary").write_text("x")
        invisible = [str(secret / "canary"), str(Path(__file__).resolve())]
        hidden = [path for op, path, _ in _jail_view() if op == "hide"] if checks["jail"] else []
        program = _PROBE.format(cfg={**checks, "invisible": invisible, "hidden": hidden,
                                     "version": sys.version})
        result = _execute(launcher, program, timeout_s=30.0, memory_mb=512, cpu_s=30,
                          max_procs=32, max_file_bytes=1 << 20, disk_bytes=4 << 20,
                          tail_chars=600)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(secret, ignore_errors=True)
    if result.status != "passed":
        last = result.stderr_tail.strip().splitlines()[-1:] or [result.status]
        return f"{result.status} (exit {result.returncode}): {last[0][-300:]}"
    return None


def _probe_jail(notes: list[str]) -> _Launcher | None:
    """The strongest jail that holds here: bubblewrap, else (as root) a chroot jail."""
    as_root = os.geteuid() == 0
    drop: tuple[str, ...] = ()
    uid = None
    if as_root:
        setpriv = shutil.which("setpriv", path=_TOOL_PATH)
        setpriv = os.path.realpath(setpriv) if setpriv else None  # it must exist in the jail
        if setpriv is None or not setpriv.startswith("/usr/"):
            notes.append("files: NO JAIL: util-linux setpriv not found under /usr; a jail "
                         "would run the program as root")
            return None
        uid = _unprivileged_uid()
        drop = _setpriv_drop(setpriv, uid, keep_read=False)
    user = (f"uid {uid} (real, no user namespace) without capabilities, no_new_privs" if as_root
            else "the parent's uid in a user namespace, no capabilities, no_new_privs")
    view = ("only the interpreter and its standard library (read-only), the working directory "
            "and a private size-capped /tmp are visible")
    failed: list[str] = []
    bwrap = shutil.which("bwrap", path=_TOOL_PATH)
    if bwrap is None:
        failed.append("bubblewrap (bwrap) not found; install the bubblewrap package "
                      "(apt-get install bubblewrap)")
    else:
        launcher = _Launcher(jail="bwrap", prefix=tuple(_bwrap_prefix(bwrap, as_root)),
                             drop=drop, uid=uid)
        reason = _try(launcher, jail=True, seccomp=False)
        if reason is None:
            notes += [f"files: bubblewrap jail: {view}",
                      "network: empty network namespace (bwrap), no route to the host",
                      "processes: own pid namespace, killed with the sandbox", f"user: {user}"]
            return launcher
        failed.append(f"bubblewrap failed here ({reason})")
    found = [shutil.which(name, path=_TOOL_PATH) for name in ("unshare", "chroot", "mount")]
    tools = [tool for tool in found if tool is not None]
    if as_root and len(tools) == len(found):
        launcher = _Launcher(jail="chroot", prefix=(tools[0], tools[1], *_chroot_specs()),
                             drop=drop, uid=uid)
        reason = _try(launcher, jail=True, seccomp=False)
        if reason is None:
            notes += [f"files: chroot jail (util-linux, bubblewrap unavailable): {view}",
                      "network: empty network namespace (unshare), no route to the host",
                      "processes: own pid namespace, killed with the sandbox", f"user: {user}"]
            return launcher
        failed.append(f"chroot jail failed here ({reason})")
    elif as_root:
        failed.append("util-linux unshare/chroot/mount not found")
    notes.append(f"files: NO JAIL: {'; '.join(failed)}")
    return None


def _probe_unjailed(notes: list[str]) -> _Launcher:
    """The util-linux chain: no file-system barrier, used only on explicit opt-in."""
    launcher = _Launcher(jail="", prefix=(), drop=(), uid=None)
    unshare = shutil.which("unshare", path=_TOOL_PATH)
    if unshare is None:
        notes.append("network: in-process socket guard only (util-linux unshare not found)")
    else:
        net = dataclasses.replace(launcher, prefix=(unshare, "--net", "--"))
        reason = _try(net, jail=False, seccomp=False)
        if reason is None:
            launcher = net
            notes.append("network: empty network namespace (unshare --net)")
        else:
            notes.append(f"network: in-process socket guard only (unshare --net failed: {reason})")
        mnt = dataclasses.replace(
            launcher, prefix=(unshare, *launcher.prefix[1:-1], "--mount", "--"), mount_ns=True
        )
        if _try(mnt, jail=False, seccomp=False) is None:
            launcher = mnt
            notes.append("writes: host file systems read-only except the working directory "
                         "(mount namespace); every world-readable host file stays readable")
    setpriv = shutil.which("setpriv", path=_TOOL_PATH)
    if os.geteuid() != 0:
        notes.append("user: unchanged (parent is not root)")
    elif setpriv is None:
        notes.append("user: stays root (util-linux setpriv not found)")
    else:
        uid = _unprivileged_uid()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        keep_read = not (_others_can_reach(_interpreter()) and _others_can_reach(stdlib))
        dropped = dataclasses.replace(launcher, drop=_setpriv_drop(setpriv, uid, keep_read),
                                      uid=uid)
        reason = _try(dropped, jail=False, seccomp=False)
        if reason is None:
            launcher = dropped
            notes.append(f"user: uid {uid}, no_new_privs"
                         + (", keeps CAP_DAC_READ_SEARCH (the interpreter is not reachable "
                            "otherwise): it can read every host file" if keep_read else ""))
        else:
            notes.append(f"user: stays root (setpriv failed: {reason})")
    return launcher


@functools.lru_cache(maxsize=1)
def _launcher() -> _Launcher:
    """Probe once which barriers this machine supports, strongest first; each one is kept only
    if a real run through it shows that it holds."""
    notes: list[str] = []
    launcher = _probe_jail(notes)
    if launcher is None:
        launcher = dataclasses.replace(_probe_unjailed(notes), isolation=())
    program = seccomp.filter_program()
    if program is None:
        notes.append("seccomp: none (no system-call table for this machine)")
    else:
        filtered = dataclasses.replace(launcher, seccomp=program.hex())
        reason = _try(filtered, jail=bool(launcher.jail), seccomp=True)
        if reason is None:
            launcher = filtered
            notes.append("seccomp: no fork/exec/ptrace/namespaces/io_uring/bpf (filter)")
        else:
            notes.append(f"seccomp: none (the filter could not be installed: {reason})")
    notes.append("limits: address space, CPU, processes, file size, no core dumps (rlimits)")
    notes.append("python guards: courtesy layer only, not a barrier")
    return dataclasses.replace(launcher, isolation=tuple(notes))


_launcher_lock = threading.Lock()


def isolation() -> tuple[str, ...]:
    """Which barriers contain sandboxed programs on this machine (probed once)."""
    with _launcher_lock:
        return _launcher().isolation


def jailed() -> bool:
    """True if a file-system jail holds here (otherwise only an explicit opt-in runs code)."""
    with _launcher_lock:
        return bool(_launcher().jail)


def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 4 * chars))
        return fh.read().decode("utf-8", errors="replace")[-chars:]


def _check_limits(timeout_s: float, memory_mb: int, cpu_s: int | None, max_procs: int,
                  max_file_bytes: int, disk_bytes: int) -> None:
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not isinstance(memory_mb, int) or memory_mb < 32:
        raise ValueError(
            f"memory_mb must be an integer >= 32 (the interpreter alone needs ~20 MiB of address "
            f"space), got {memory_mb!r}"
        )
    if cpu_s is not None and (not isinstance(cpu_s, int) or cpu_s < 1):
        raise ValueError(f"cpu_s must be a whole number of seconds >= 1 or None, got {cpu_s!r}")
    if not isinstance(max_procs, int) or max_procs < 1:
        raise ValueError(f"max_procs must be an integer >= 1, got {max_procs!r}")
    if not isinstance(max_file_bytes, int) or max_file_bytes < 4096:
        raise ValueError(
            f"max_file_bytes must be an integer >= 4096 (it also caps the program's captured "
            f"output), got {max_file_bytes!r}"
        )
    if not isinstance(disk_bytes, int) or disk_bytes < 65536:
        raise ValueError(f"disk_bytes must be an integer >= 65536, got {disk_bytes!r}")


def _unjailed_allowed(allow_unjailed: bool | None) -> bool:
    if allow_unjailed is None:
        return os.environ.get(ALLOW_UNJAILED_ENV, "") == "1"
    return bool(allow_unjailed)


def _permitted(allow_unjailed: bool | None) -> _Launcher:
    with _launcher_lock:
        launcher = _launcher()
    if launcher.jail:
        return launcher
    if not _unjailed_allowed(allow_unjailed):
        raise SandboxUnavailable(
            "refusing to run generated code: no file-system jail can be built here, so the "
            f"program could read the host's files ({launcher.isolation[0]}). Install "
            "bubblewrap, or opt in explicitly with --dflash-allow-unjailed (environment "
            f"{ALLOW_UNJAILED_ENV}=1); the choice is recorded in the report"
        )
    return dataclasses.replace(launcher, isolation=(
        "files: UNJAILED by explicit opt-in (allow_unjailed): host files are readable",
        *launcher.isolation))


def check_permitted(allow_unjailed: bool | None = None) -> tuple[str, ...]:
    """The isolation line generated code would run under here, or :class:`SandboxUnavailable`
    if it may not run at all: a gate asks first, before it spends time generating code."""
    return _permitted(allow_unjailed).isolation


def run_untrusted(
    program: str,
    *,
    timeout_s: float,
    memory_mb: int,
    cpu_s: int | None = None,
    max_procs: int = 32,
    max_file_bytes: int = 16 << 20,
    disk_bytes: int = 64 << 20,
    tail_chars: int = 4000,
    allow_unjailed: bool | None = None,
) -> SandboxResult:
    """Run ``program`` (Python source: a completion plus its tests) contained; never raises for
    anything the program does.

    ``cpu_s`` defaults to the wall timeout rounded up. ``max_procs`` caps processes *and threads*
    of the sandbox user (the kernel counts both). ``max_file_bytes`` caps every file the program
    writes, including its captured stdout/stderr; ``disk_bytes`` caps its working directory and
    ``/tmp`` together (jail only). Without a jail, raises :class:`SandboxUnavailable` unless
    ``allow_unjailed`` (default: ``$DFLASH_ALLOW_UNJAILED == "1"``). Safe to call from several
    threads at once.
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be Python source text (str), got {type(program).__name__}")
    try:
        program.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"program is not encodable as UTF-8 ({exc.reason} at index {exc.start}); decode model "
            "output with errors='replace' before scoring it"
        ) from None
    _check_limits(timeout_s, memory_mb, cpu_s, max_procs, max_file_bytes, disk_bytes)
    launcher = _permitted(allow_unjailed)
    return _execute(launcher, program, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
                    max_procs=max_procs, max_file_bytes=max_file_bytes, disk_bytes=disk_bytes,
                    tail_chars=tail_chars)


def _execute(launcher: _Launcher, program: str, *, timeout_s: float, memory_mb: int,
             cpu_s: int | None, max_procs: int, max_file_bytes: int, disk_bytes: int,
             tail_chars: int) -> SandboxResult:
    """Run one program through ``launcher``; the files it leaves on the host are removed."""
    cpu = cpu_s if cpu_s is not None else max(1, math.ceil(timeout_s))
    limits = {
        "RLIMIT_AS": memory_mb << 20,
        "RLIMIT_CPU": cpu,
        "RLIMIT_NPROC": max_procs,
        "RLIMIT_FSIZE": max_file_bytes,
        "RLIMIT_CORE": 0,
    }
    root = Path(tempfile.mkdtemp(prefix="dflash-sandbox-"))
    try:
        # root: parent-only (0711: an unjailed child may traverse it, not list or open its
        # files); program.py is bound read-only into the jail; work: the unjailed child's directory.
        root.chmod(0o711)
        (root / "program.py").write_text(program, encoding="utf-8")
        (root / "program.py").chmod(0o644)
        chain, workdir = launcher.argv(root, disk_bytes)
        program_path = workdir / "program.py"
        if not launcher.jail:
            work = root / "work"
            work.mkdir(mode=0o700)
            shutil.copy(root / "program.py", work / "program.py")
            if launcher.uid is not None:
                os.chown(work, launcher.uid, launcher.uid)
                os.chown(work / "program.py", launcher.uid, launcher.uid)
        config = json.dumps({"workdir": str(workdir), "program": str(program_path),
                             "limits": limits, "seccomp": launcher.seccomp})
        interpreter = str(_interpreter()) if launcher.jail else sys.executable
        argv = [*chain, interpreter, "-s", "-S", "-P", "-B", "-c", _BOOTSTRAP, config]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir),
               "PYTHONHASHSEED": "0"}
        out_path, err_path = root / "stdout", root / "stderr"
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=root,
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Kill the whole group in every case: nothing the program started may outlive it
            # (in the jail, bwrap's death also ends its pid namespace).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if timed_out:
                proc.wait()
                returncode = None
            elif launcher.jail and returncode is not None and returncode > 128:
                returncode = 128 - returncode  # bwrap reports death by signal N as 128 + N
        wall = time.perf_counter() - start
        stdout_tail, stderr_tail = _tail(out_path, tail_chars), _tail(err_path, tail_chars)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    status: Status
    if timed_out:
        status = "timeout"
        stderr_tail = (stderr_tail + f"\ndflash-sandbox: wall timeout {timeout_s} s, killed")[
            -tail_chars:
        ]
    elif returncode == 0:
        status = "passed"
    elif returncode is not None and returncode < 0:
        status = "killed"
    elif returncode == SETUP_FAILED:
        status = "error"
    else:
        status = "failed"
    return SandboxResult(
        passed=status == "passed",
        status=status,
        returncode=returncode,
        stdout_tail=stdout_tail,
        stderr_tail=stderr_tail,
        wall_s=wall,
        isolation=launcher.isolation,
    )
