"""Sandboxed executor for generated code (DESIGN 6 quality, DESIGN 7 HumanEval).

A completion produced by a model under test is hostile until proven otherwise: it may loop, eat
memory, fork, delete or write files, open sockets, or read secrets from the environment. Scoring it
must never disturb the test session, so every program runs in a fresh interpreter that is
contained by *kernel* barriers wherever this machine offers them, and by in-process guards on top:

kernel barriers
    - its own session and process group; the wall timeout SIGKILLs the whole group;
    - resource limits set before the program runs: address space, CPU seconds, process count,
      file size, no core dumps;
    - a network namespace with only a downed loopback (``unshare --net``), when available;
    - when the parent runs as root, the child runs as the unprivileged ``nobody`` user with no
      capabilities and ``no_new_privs`` (``setpriv``), so files outside its directory are not
      writable by the kernel's own permission checks, ``/proc/<parent>/environ`` is unreadable,
      and RLIMIT_NPROC is enforced (the kernel ignores it for root). If the interpreter lives in a
      directory ``nobody`` cannot traverse (``/root`` on many machines), the child keeps only
      CAP_DAC_READ_SEARCH so it can import the standard library: read access, never write.
in-process guards (installed by a small bootstrap before the program's first line)
    - process spawning (``os.fork``/``system``/``exec*``/``spawn*``/``posix_spawn``,
      ``subprocess``, ``pty``, ``multiprocessing``, ``ctypes``) raises PermissionError;
    - ``socket.socket``/``create_connection``/... raise PermissionError;
    - file writes and destructive ``os`` calls outside the temporary working directory raise
      PermissionError; ``chdir`` is refused;
    - a scrubbed environment (only PATH, LANG, HOME=workdir, PYTHONHASHSEED=0), umask 077.

Which kernel barriers were in force is probed once and reported with every result
(:attr:`SandboxResult.isolation`), so a gate's evidence says how its code was contained.

The interpreter runs with ``-s -S -P -B`` (no user or system site-packages, no unsafe path entry,
no bytecode writes): the programs get the standard library only. ``-I`` is not used because it
also implies ``-E``, which would ignore PYTHONHASHSEED; the environment is built from scratch
here, so no other PYTHON* variable can reach the child anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

Status = Literal["passed", "failed", "timeout", "killed", "error"]

#: exit status the bootstrap uses when the sandbox itself could not be set up
SETUP_FAILED = 120
#: exit status the bootstrap uses when the program raised SystemExit (even with code 0)
PROGRAM_EXITED = 121

_UNPRIVILEGED_FALLBACK_UID = 65534

# The bootstrap runs inside the child before the program: limits, guards, then exec of the program.
# It reads its configuration from argv[1] as JSON; only the two exit statuses are filled in here.
_BOOTSTRAP_TEMPLATE = r"""
import sys
_real_exit = __import__("os")._exit
try:
    import builtins, io, json, os, posix, resource, socket, subprocess, _io
    cfg = json.loads(sys.argv[1])
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
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
_BOOTSTRAP = _BOOTSTRAP_TEMPLATE.replace("@SETUP_FAILED@", str(SETUP_FAILED)).replace(
    "@PROGRAM_EXITED@", str(PROGRAM_EXITED)
)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one untrusted program.

    ``status``: ``passed`` (exit 0), ``failed`` (non-zero exit: assertion, exception, SystemExit,
    refused operation), ``timeout`` (wall limit hit, group killed), ``killed`` (ended by a signal,
    e.g. SIGXCPU from the CPU limit), ``error`` (the sandbox itself could not start the program).
    """

    passed: bool
    status: Status
    returncode: int | None
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    isolation: tuple[str, ...] = ()


# Runs as root inside the new mount namespace (unshare makes its propagation private, so nothing
# here reaches the host): every file system read-only except the program's own directory.
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


@dataclasses.dataclass(frozen=True)
class _Launcher:
    """The command chain that wraps the interpreter, as probed on this machine."""

    unshare: tuple[str, ...]  # e.g. ("/usr/bin/unshare", "--net", "--mount", "--")
    mount_ns: bool
    setpriv: tuple[str, ...]  # e.g. ("/usr/bin/setpriv", "--reuid=65534", ..., "--")
    uid: int | None  # the unprivileged user the child runs as; None when it keeps the parent's
    isolation: tuple[str, ...]

    def argv(self, workdir: Path) -> list[str]:
        chain = list(self.unshare)
        if self.mount_ns:
            chain += ["/bin/sh", "-c", _MOUNT_SCRIPT, "dflash-sandbox", str(workdir)]
        return chain + list(self.setpriv)


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


def _try(launcher: _Launcher, code: str) -> str | None:
    """Run ``code`` through ``launcher`` in a scratch directory; None if it exited 0, else why."""
    scratch = Path(tempfile.mkdtemp(prefix="dflash-sandbox-probe-"))
    try:
        scratch.chmod(0o755)
        if launcher.uid is not None:
            os.chown(scratch, launcher.uid, launcher.uid)
        argv = [*launcher.argv(scratch), sys.executable, "-s", "-S", "-P", "-B", "-c", code]
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            env={"PATH": _TOOL_PATH},
            cwd=scratch,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-300:]}"
    return None


@functools.lru_cache(maxsize=1)
def _launcher() -> _Launcher:
    """Probe once which kernel barriers this machine supports, strongest chain first.

    Each barrier is added only if a real run through the chain built so far works, so a machine
    without namespaces or privileges still scores programs (with the in-process guards), and the
    notes say exactly what was missing.
    """
    probe = "import os, json, socket, subprocess; open('probe', 'w').close()"
    launcher = _Launcher((), False, (), None, ())
    notes: list[str] = []

    unshare = shutil.which("unshare", path=_TOOL_PATH)
    if unshare is None:
        notes.append("network: in-process socket guard only (util-linux unshare not found)")
        notes.append("files: in-process guard only (no mount namespace: unshare not found)")
    else:
        net = dataclasses.replace(launcher, unshare=(unshare, "--net", "--"))
        reason = _try(net, probe)
        if reason is None:
            launcher = net
            notes.append("network: empty network namespace (unshare --net)")
        else:
            notes.append(f"network: in-process socket guard only (unshare --net failed: {reason})")
        mnt = dataclasses.replace(
            launcher, unshare=(unshare, *launcher.unshare[1:-1], "--mount", "--"), mount_ns=True
        )
        reason = _try(mnt, probe)
        if reason is None:
            launcher = mnt
            notes.append("files: read-only file systems except the working directory (mount ns)")
        else:
            notes.append(f"files: in-process guard only (mount namespace failed: {reason})")

    setpriv = shutil.which("setpriv", path=_TOOL_PATH)
    if os.geteuid() != 0:
        notes.append("user: unchanged (parent is not root); RLIMIT_NPROC enforced by the kernel")
    elif setpriv is None:
        notes.append(
            "user: stays root (util-linux setpriv not found): RLIMIT_NPROC is not enforced for root"
        )
    else:
        uid = _unprivileged_uid()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        need_read = not (_others_can_reach(Path(sys.executable)) and _others_can_reach(stdlib))
        caps = "-all,+dac_read_search" if need_read else "-all"
        drop = [
            setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            f"--inh-caps={caps}",
            f"--bounding-set={caps}",
            *(["--ambient-caps=+dac_read_search"] if need_read else []),
            "--",
        ]
        dropped = dataclasses.replace(launcher, setpriv=tuple(drop), uid=uid)
        reason = _try(dropped, probe)
        if reason is None:
            launcher = dropped
            notes.append(
                f"user: uid {uid} without capabilities, no_new_privs"
                + (
                    " (keeps CAP_DAC_READ_SEARCH, read-only: the interpreter is not "
                    "world-readable here)"
                    if need_read
                    else ""
                )
            )
        else:
            notes.append(
                f"user: stays root (setpriv failed: {reason}): "
                "RLIMIT_NPROC is not enforced for root"
            )
    return dataclasses.replace(launcher, isolation=tuple(notes))


_launcher_lock = threading.Lock()


def isolation() -> tuple[str, ...]:
    """Which kernel barriers contain sandboxed programs on this machine (probed once)."""
    with _launcher_lock:
        return _launcher().isolation


def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 4 * chars))
        return fh.read().decode("utf-8", errors="replace")[-chars:]


def _check_limits(
    timeout_s: float, memory_mb: int, cpu_s: int | None, max_procs: int, max_file_bytes: int
) -> None:
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


def run_untrusted(
    program: str,
    *,
    timeout_s: float,
    memory_mb: int,
    cpu_s: int | None = None,
    max_procs: int = 32,
    max_file_bytes: int = 16 << 20,
    tail_chars: int = 4000,
) -> SandboxResult:
    """Run ``program`` (Python source: a completion plus its tests) contained; never raises for
    anything the program does.

    ``cpu_s`` defaults to the wall timeout rounded up. ``max_procs`` caps processes *and threads*
    of the sandbox user (the kernel counts both). ``max_file_bytes`` caps every file the program
    writes, including its captured stdout/stderr. Safe to call from several threads at once.
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
    _check_limits(timeout_s, memory_mb, cpu_s, max_procs, max_file_bytes)
    with _launcher_lock:
        launcher = _launcher()
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
        # root: parent-only (0711: the child may traverse it, not list or open its files);
        # work: the child's own directory, owned by the sandbox user.
        root.chmod(0o711)
        work = root / "work"
        work.mkdir(mode=0o700)
        program_path = work / "main.py"
        program_path.write_text(program, encoding="utf-8")
        if launcher.uid is not None:
            os.chown(work, launcher.uid, launcher.uid)
            os.chown(program_path, launcher.uid, launcher.uid)
        config = json.dumps({"workdir": str(work), "program": str(program_path), "limits": limits})
        argv = [
            *launcher.argv(work),
            sys.executable,
            "-s",
            "-S",
            "-P",
            "-B",
            "-c",
            _BOOTSTRAP,
            config,
        ]
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(work),
            "PYTHONHASHSEED": "0",
        }
        out_path, err_path = root / "stdout", root / "stderr"
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=work,
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Kill the whole group in every case: nothing the program started may outlive it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if timed_out:
                proc.wait()
                returncode = None
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
