"""Hostile completions against the sandboxed executor: each is contained, scored as a failure,
and the run goes on. Every check looks at the real outside world (a canary directory with a
root-only secret, the parent's environment, a victim process, the host's /proc), not at what the
sandbox claims. The in-process guards are bypassed on purpose (``posix`` re-import, raw
``ctypes``): only the kernel barriers may be what holds.

Without bubblewrap the jail tests skip with the reason, except where ``DFLASH_REQUIRE_JAIL=1``
(CI sets it): there a missing jail is a failure.
"""

from __future__ import annotations

import glob
import os
import re
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from pytest_dflash.sandbox import executor as sandbox
from pytest_dflash.sandbox import seccomp
from pytest_dflash.sandbox.executor import SandboxUnavailable, isolation, jailed, run_untrusted

LIMITS = {"timeout_s": 5.0, "memory_mb": 256}


def run(program: str, **overrides):
    return run_untrusted(textwrap.dedent(program), **{**LIMITS, **overrides})


@pytest.fixture(autouse=True)
def _own_programs_may_run_unjailed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no jail can be built, this file's ordinary programs still run (opted in); the
    hostile ones take the ``jail`` fixture and skip or fail."""
    if not jailed():
        monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "1")


def _tools(folder: Path, names: tuple[str, ...]) -> Path:
    """A tool path holding only ``names`` (links to this machine's real tools)."""
    folder.mkdir(exist_ok=True)
    for name in names:
        for where in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if Path(where, name).exists():
                (folder / name).symlink_to(Path(where, name))
                break
    return folder


_LAUNCHERS: dict[str, sandbox._Launcher] = {}


@pytest.fixture(params=["bwrap", "chroot"])
def jail(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         monkeypatch: pytest.MonkeyPatch) -> str:
    """Each jail this machine can build, probed for real once per kind: bubblewrap, and the
    util-linux chroot jail it falls back to (as root) when bubblewrap is missing."""
    kind = request.param
    if kind not in _LAUNCHERS:
        with monkeypatch.context() as patch:
            if kind == "chroot":
                tools = _tools(tmp_path_factory.mktemp("tools"),
                               ("unshare", "setpriv", "sh", "mount", "chroot"))
                patch.setattr(sandbox, "_TOOL_PATH", str(tools))
            sandbox._launcher.cache_clear()
            _LAUNCHERS[kind] = sandbox._launcher()
            sandbox._launcher.cache_clear()
    launcher = _LAUNCHERS[kind]
    if launcher.jail != kind:
        message = f"no {kind} jail on this machine: {launcher.isolation[0]}"
        if kind == "bwrap" and os.environ.get("DFLASH_REQUIRE_JAIL") == "1":
            pytest.fail(f"DFLASH_REQUIRE_JAIL=1 but {message}")
        pytest.skip(message)
    monkeypatch.setattr(sandbox, "_launcher", lambda: launcher)
    return kind


@pytest.fixture
def host_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The sandbox's host-side scratch goes here, so a test can see that nothing is left."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


class Canary:
    """A root-only secret (mode 600 in a mode 700 directory) that also sits in the parent's
    environment; ``untouched`` checks that nothing read, changed or added anything."""

    def __init__(self, base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.secret = "dflash-canary-" + os.urandom(12).hex()
        self.dir = base / "secret"
        self.dir.mkdir(mode=0o700)
        self.file = self.dir / "canary.txt"
        self.file.write_text(self.secret)
        self.file.chmod(0o600)
        monkeypatch.setenv("DFLASH_CANARY_SECRET", self.secret)
        self._before = self._state()

    def _state(self) -> list[tuple[str, int, int, int]]:
        return [(p.name, p.stat().st_mode, p.stat().st_size, p.stat().st_mtime_ns)
                for p in sorted(self.dir.iterdir())] + [(".", self.dir.stat().st_mode, 0,
                                                          self.dir.stat().st_mtime_ns)]

    def untouched(self, result: sandbox.SandboxResult) -> None:
        seen = result.stdout_tail + result.stderr_tail
        assert self.secret not in seen, seen
        assert self.file.read_text() == self.secret
        assert self._state() == self._before


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jail: str) -> Canary:
    return Canary(tmp_path, monkeypatch)


# ------------------------------------------------------------------------ ordinary programs


def test_correct_program_passes():
    result = run("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n")
    assert result.status == "passed", result.stderr_tail
    assert result.passed and result.returncode == 0
    assert result.stdout_tail.strip() == "ok"


def test_threads_and_the_workdir_work_in_the_jail(jail):
    program = """
        import os, pathlib, tempfile, threading
        results = []
        threads = [threading.Thread(target=results.append, args=(i,)) for i in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert sorted(results) == [0, 1, 2, 3]
        pathlib.Path("data.txt").write_text("hello")
        os.mkdir("sub")
        os.rename("data.txt", "sub/data.txt")
        with tempfile.TemporaryDirectory() as scratch:
            pathlib.Path(scratch, "x").write_text("y")
        assert pathlib.Path("sub/data.txt").read_text() == "hello"
        import hashlib, json, decimal, re, collections, itertools, math
    """
    result = run(program)
    assert result.passed, result.stderr_tail


def test_failing_assert_fails():
    result = run("assert 1 + 1 == 3, 'wrong sum'\n")
    assert result.status == "failed" and not result.passed
    assert "AssertionError: wrong sum" in result.stderr_tail


def test_syntax_error_is_a_failure_not_a_sandbox_error():
    result = run("def broken(:\n    pass\n")
    assert result.status == "failed"
    assert "SyntaxError" in result.stderr_tail


def test_exit_zero_before_tests_is_not_a_pass():
    result = run("import sys\nsys.exit(0)\nassert False\n")
    assert result.status == "failed", result.stderr_tail
    assert "SystemExit(0)" in result.stderr_tail


def test_cpu_limit_kills_busy_loop():
    result = run("while True:\n    pass\n", timeout_s=10.0, cpu_s=1)
    assert result.status == "killed", (result.status, result.stderr_tail)
    assert result.returncode is not None and result.returncode < 0


@pytest.mark.parametrize(
    "program",
    [
        "x = bytearray(8 * 1024 ** 3)\n",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))\n",
    ],
    ids=["one-block", "growing"],
)
def test_memory_bomb_is_contained(program, canary):
    result = run(program, memory_mb=128)
    canary.untouched(result)
    assert result.status in ("failed", "killed") and not result.passed
    assert "MemoryError" in result.stderr_tail or result.status == "killed"
    assert run("print('next')").passed


# ------------------------------------------------------------------------ the jail itself


def test_isolation_names_the_jail_first(jail):
    notes = isolation()
    name = {"bwrap": "bubblewrap jail", "chroot": "chroot jail (util-linux"}[jail]
    assert notes[0].startswith(f"files: {name}"), notes
    assert "only the interpreter and its standard library (read-only)" in notes[0]
    kinds = [note.split(":")[0] for note in notes]
    assert kinds == ["files", "network", "processes", "user", "seccomp", "limits",
                     "python guards"]
    assert notes[-1] == "python guards: courtesy layer only, not a barrier"
    assert run("pass").isolation == notes
    assert sandbox.check_permitted() == notes


def _host_package_dirs() -> list[str]:
    """Where this host keeps installed Python packages, as the running interpreter names them
    (``site.getsitepackages`` and the install scheme, for the environment and for the base
    interpreter: ``site-packages`` for CPython's layout, ``dist-packages`` under ``/usr`` and
    ``/usr/local`` for Debian's), plus every other interpreter's under ``/usr`` and pip's wheels
    that ``python3-venv`` installs: none of them may show in the jail."""
    bases = [sys.base_prefix, sys.base_exec_prefix]
    paths = {*site.getsitepackages(), *site.getsitepackages(bases)}
    for scheme in (sysconfig.get_paths(),
                   sysconfig.get_paths(vars={"base": sys.base_prefix,
                                             "platbase": sys.base_exec_prefix})):
        paths |= {scheme["purelib"], scheme["platlib"]}
    for pattern in ("/usr/lib*/python*/*-packages", "/usr/local/lib*/python*/*-packages",
                    "/usr/share/python-wheels"):
        paths |= set(glob.glob(pattern))
    return sorted(path for path in paths if os.path.isdir(path))


def test_the_jail_shows_only_the_interpreter(jail):
    """What exists in the jail's root: system directories, the interpreter's files, /tmp; no
    installed package of the host, whichever interpreter runs the tests."""
    packages = _host_package_dirs()
    populated = [path for path in packages if os.listdir(path)]
    # Without an installed package on the host, the check below would prove nothing.
    assert populated, f"no installed package on this host to look for: {packages}"
    program = f"""
        import os, re, sys
        print(sorted(os.listdir("/")))
        stdlib = os.path.dirname(os.__file__)
        print(os.path.isfile(stdlib + "/os.py"), os.path.isdir(stdlib + "/json"))
        seen = {{}}
        for path in {packages!r}:
            try:
                seen[path] = len(os.listdir(path))
            except FileNotFoundError:
                seen[path] = None
        print(seen)
        print(os.getuid(), os.getgid(), os.getgroups())
        status = open("/proc/self/status").read()
        print(re.search(r"CapEff:\\s*(\\w+)", status).group(1),
              re.search(r"NoNewPrivs:\\s*(\\d)", status).group(1),
              re.search(r"Seccomp:\\s*(\\d)", status).group(1))
    """
    result = run(program)
    assert result.passed, result.stderr_tail
    top, stdlib, seen, ids, caps = result.stdout_tail.strip().splitlines()
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp"}
    interpreter_top = Path(os.path.realpath(sandbox._interpreter())).parts[1]
    assert set(eval(top)) <= allowed | {interpreter_top}, top  # noqa: S307 - our own repr
    assert stdlib == "True True"  # the standard library is there, so the absences mean something
    shown = {path: count for path, count in eval(seen).items() if count}  # noqa: S307
    assert shown == {}, f"host packages in the jail (entries each); on the host: {populated}"
    if os.geteuid() == 0:
        assert ids == "65534 65534 []"
    assert caps.split() == ["0000000000000000", "1", "2"]


# ------------------------------------------------------------------------ hostile matrix


def test_reading_a_root_only_file(canary):
    result = run(f"""
        for attempt in (lambda: open({str(canary.file)!r}).read(),
                        lambda: __import__("os").listdir({str(canary.dir)!r})):
            try:
                print("GOT", attempt())
            except OSError as exc:
                print(type(exc).__name__, exc.errno)
    """)
    canary.untouched(result)
    assert "GOT" not in result.stdout_tail
    assert result.stdout_tail.split() == ["FileNotFoundError", "2", "FileNotFoundError", "2"]


def test_listing_root_and_home(canary):
    checkout = Path(__file__).resolve().parents[1]
    result = run(f"""
        import os
        for path in ("/root", "/home", "/etc", "/proc/1/root", {str(checkout)!r}):
            try:
                print(path, sorted(os.listdir(path)))
            except OSError as exc:
                print(path, type(exc).__name__)
    """)
    canary.untouched(result)
    assert result.passed, result.stderr_tail
    host_root = set(os.listdir("/root")) if os.access("/root", os.R_OK) else set()
    interpreter = Path(os.path.realpath(sandbox._interpreter()))
    bound = {interpreter.parts[2]} if interpreter.parts[1] == "root" else set()
    for name in host_root - bound:  # .cache, .gitconfig, .npmrc, .m2 ...
        assert repr(name) not in result.stdout_tail, name
    lines = dict(line.split(" ", 1) for line in result.stdout_tail.strip().splitlines())
    assert lines["/home"] == "FileNotFoundError"
    assert lines["/etc"] == "FileNotFoundError"
    assert lines[str(checkout)] == "FileNotFoundError"  # the project checkout is not there


def test_reading_proc_environ_of_init_and_the_parent(canary):
    result = run(f"""
        import os
        for pid in (1, os.getppid(), {os.getpid()}):
            try:
                print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as exc:
                print(pid, type(exc).__name__)
        print(dict(os.environ))
    """)
    canary.untouched(result)
    assert "DFLASH_CANARY_SECRET" not in result.stdout_tail
    assert "'PYTHONHASHSEED': '0'" in result.stdout_tail


def test_posix_reimport_bypass_runs_no_shell(canary, tmp_path):
    outside = tmp_path / "pwned"
    result = run(f"""
        import sys
        sys.modules.pop("posix")
        import posix
        print("system", posix.system("cat {canary.file}; touch {outside}"))
        for name, attempt in (("fork", posix.fork),
                              ("execv", lambda: posix.execv("/bin/sh", ["sh", "-c", "id"]))):
            try:
                attempt()
                print(name, "RAN")
            except OSError as exc:
                print(name, type(exc).__name__)
    """)
    canary.untouched(result)
    assert not outside.exists()
    assert "RAN" not in result.stdout_tail
    assert "fork PermissionError" in result.stdout_tail, result.stderr_tail
    assert "execv PermissionError" in result.stdout_tail
    assert "system 0" not in result.stdout_tail


def test_ctypes_system_runs_no_shell(canary, tmp_path):
    outside = tmp_path / "pwned"
    result = run(f"""
        import sys
        for name in ("ctypes", "_ctypes"):
            sys.modules.pop(name, None)
        import ctypes
        libc = ctypes.CDLL(None)
        print("system", libc.system(b"cat {canary.file}; touch {outside}"))
        print("fork", libc.fork())
    """)
    canary.untouched(result)
    assert not outside.exists()
    assert "fork -1" in result.stdout_tail, result.stderr_tail
    assert "system 0" not in result.stdout_tail


def test_signalling_the_parent_and_a_victim(canary):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = run(f"""
            import sys, signal
            sys.modules.pop("posix")
            import posix
            for pid in (posix.getppid(), {os.getpid()}, {victim.pid}, -1):
                try:
                    posix.kill(pid, signal.SIGKILL)
                    print(pid, "sent")
                except OSError as exc:
                    print(pid, type(exc).__name__)
        """)
        canary.untouched(result)
        assert victim.poll() is None, "the victim process was killed"
        assert f"{victim.pid} sent" not in result.stdout_tail
        assert f"{os.getpid()} sent" not in result.stdout_tail
    finally:
        victim.kill()
        victim.wait()


def _namespace_processes(inode: str) -> list[int]:
    """Host pids whose pid namespace is ``inode`` (``pid:[...]``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "pid") == inode:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_until_gone(inode: str, patience_s: float = 10.0) -> list[int]:
    """The kernel tears a pid namespace down asynchronously after its init died."""
    deadline = time.monotonic() + patience_s
    while (left := _namespace_processes(inode)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_fork_bomb_is_contained(canary):
    program = """
        import os, sys
        print(os.readlink("/proc/self/ns/pid"), flush=True)
        refused = []
        attempts = {
            "fork": lambda: os.fork(),
            "posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
            "subprocess": lambda: __import__("subprocess").Popen(["/bin/true"]),
            "multiprocessing": lambda: __import__("multiprocessing").Process(target=print).start(),
            "ctypes": lambda: __import__("ctypes").CDLL(None).fork(),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
            except (PermissionError, ImportError):
                refused.append(name)
        print(",".join(refused), flush=True)
        sys.modules.pop("posix")
        import posix
        while True:
            posix.fork()
    """
    result = run(program)
    canary.untouched(result)
    assert result.status == "failed" and not result.passed, result.stderr_tail
    inode, refused = result.stdout_tail.split()
    assert refused.split(",") == ["fork", "posix_spawn", "subprocess", "multiprocessing",
                                  "ctypes"]
    assert "PermissionError" in result.stderr_tail  # the kernel refused the bypassed fork
    assert _wait_until_gone(inode) == []


def test_sleeping_past_the_timeout_with_the_output_held_open(canary, host_tmp):
    result = run("""
        import os, sys, threading, time
        print(os.readlink("/proc/self/ns/pid"), flush=True)
        threading.Thread(target=time.sleep, args=(3600,)).start()
        sys.stdout.write("holding stdout\\n"); sys.stdout.flush()
        time.sleep(3600)
    """, timeout_s=1.0)
    canary.untouched(result)
    assert result.status == "timeout" and not result.passed
    assert "wall timeout 1.0 s, killed" in result.stderr_tail
    inode = result.stdout_tail.split()[0]
    assert inode.startswith("pid:[")
    assert _wait_until_gone(inode) == []
    assert list(host_tmp.iterdir()) == []  # the host-side scratch is removed
    assert run("print('next')").passed


def test_disk_fill_stops_at_the_cap(canary, host_tmp):
    disk = 1 << 20
    result = run("""
        import os
        written = 0
        try:
            for target in ("fill", "/tmp/fill"):
                for i in range(10 ** 6):
                    with open(f"{target}-{i}", "wb") as out:
                        out.write(b"x" * 65536)
                    written += 65536
        finally:
            print(written, flush=True)
    """, disk_bytes=disk)
    canary.untouched(result)
    assert result.status == "failed", result.stderr_tail
    assert "No space left on device" in result.stderr_tail
    assert int(result.stdout_tail.split()[0]) <= disk
    assert list(host_tmp.iterdir()) == []


def test_a_gigabyte_of_output_is_cut_at_the_file_limit(canary, host_tmp):
    result = run("""
        import sys
        block = "y" * (1 << 20)
        for _ in range(1024):
            sys.stdout.write(block)
        sys.stdout.flush()
    """, max_file_bytes=1 << 20, tail_chars=2000)
    canary.untouched(result)
    assert not result.passed and result.status in ("killed", "failed"), result.stderr_tail
    assert len(result.stdout_tail) <= 2000
    assert list(host_tmp.iterdir()) == []


def test_symlink_from_the_workdir_to_outside(canary):
    result = run(f"""
        import sys
        sys.modules.pop("posix")
        import posix
        for name, target in (("secret", {str(canary.file)!r}),
                             ("root", {str(Path.home() / ".gitconfig")!r}),
                             ("dir", {str(canary.dir)!r})):
            posix.symlink(target, name)
            try:
                print(name, open(name).read())
            except OSError as exc:
                print(name, type(exc).__name__)
    """)
    canary.untouched(result)
    assert result.stdout_tail.split() == ["secret", "FileNotFoundError", "root",
                                          "FileNotFoundError", "dir", "FileNotFoundError"]


def test_writing_outside_is_refused_by_the_kernel(canary, tmp_path):
    program = f"""
        import io, os, sys
        raw_fileio = io.FileIO.__mro__[1]  # sidesteps the in-process guard
        sys.modules.pop("posix")
        import posix
        for path in ({str(tmp_path / "a.txt")!r}, {str(canary.dir / "b.txt")!r},
                     "/usr/dflash-escape", "/proc/sys/kernel/hostname"):
            try:
                raw_fileio(path, "w").write(b"escaped")
                print("WROTE", path)
            except OSError as exc:
                print(type(exc).__name__)
    """
    result = run(program)
    canary.untouched(result)
    assert "WROTE" not in result.stdout_tail
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]
    assert not Path("/usr/dflash-escape").exists()


# ------------------------------------------------------------------------ network


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    yield server
    server.close()


def _assert_accepted_nothing(server: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        conn, peer = server.accept()
        conn.close()
        pytest.fail(f"the listener accepted a connection from {peer}")


def test_connecting_to_a_local_listener_is_refused(listener):
    port = listener.getsockname()[1]
    program = f"""
        import socket, urllib.request
        for attempt in (
            lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1),
            lambda: socket.socket().connect(("127.0.0.1", {port})),
            lambda: urllib.request.urlopen("http://127.0.0.1:{port}/", timeout=1),
        ):
            try:
                attempt()
                print("CONNECTED")
            except OSError as exc:
                print(type(exc).__name__)
        assert False, "scored as failure either way"
    """
    result = run(program)
    assert not result.passed
    assert "CONNECTED" not in result.stdout_tail
    _assert_accepted_nothing(listener)


def _raw_socket_spec() -> str:
    """Source that finds the raw ``_socket`` module past the in-process guard: from its extension
    file (CPython's ``lib-dynload``; the path is the same inside the jail), or, where the
    interpreter has it built in (Debian's ``/usr/bin/python3``), from the built-in importer."""
    path = getattr(sys.modules["_socket"], "__file__", None)
    if path is not None:
        return f"importlib.util.spec_from_file_location('_socket', {os.path.realpath(path)!r})"
    assert "_socket" in sys.builtin_module_names
    return "importlib.machinery.BuiltinImporter.find_spec('_socket')"


def test_bypassing_the_socket_guard_is_stopped_by_the_kernel(listener, jail):
    port = listener.getsockname()[1]
    program = f"""
        import importlib.machinery, importlib.util
        spec = {_raw_socket_spec()}
        raw = importlib.util.module_from_spec(spec)
        sock = raw.socket(2, 1)
        print("raw socket made", flush=True)
        sock.settimeout(2)
        sock.connect(("127.0.0.1", {port}))
        print("CONNECTED")
    """
    result = run(program)
    assert not result.passed
    assert "raw socket made" in result.stdout_tail, result.stderr_tail
    assert "CONNECTED" not in result.stdout_tail
    assert re.search("Network is unreachable|Connection refused", result.stderr_tail)
    _assert_accepted_nothing(listener)


# ------------------------------------------------------------------------ no jail, no code


@pytest.fixture
def no_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """This machine as it would be without bubblewrap and chroot: util-linux's unshare only."""
    tools = _tools(tmp_path / "tools", ("unshare", "setpriv", "sh", "mount", "mountpoint"))
    monkeypatch.setattr(sandbox, "_TOOL_PATH", str(tools))
    monkeypatch.delenv(sandbox.ALLOW_UNJAILED_ENV, raising=False)
    sandbox._launcher.cache_clear()
    yield
    sandbox._launcher.cache_clear()


def test_without_a_jail_generated_code_is_refused_unless_opted_in(no_bwrap):
    assert not jailed()
    assert isolation()[0].startswith("files: NO JAIL: bubblewrap (bwrap) not found")
    with pytest.raises(SandboxUnavailable, match="refusing to run generated code.*install "
                       "bubblewrap.*--dflash-allow-unjailed"):
        run("print('hi')")
    with pytest.raises(SandboxUnavailable):
        sandbox.check_permitted()
    assert sandbox.check_permitted(allow_unjailed=True)[0].startswith("files: UNJAILED")
    result = run("print('hi')", allow_unjailed=True)
    assert result.passed, result.stderr_tail
    assert result.isolation[0].startswith("files: UNJAILED by explicit opt-in")


def test_the_opt_in_environment_variable(no_bwrap, monkeypatch):
    monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "1")
    assert run("print('hi')").isolation[0].startswith("files: UNJAILED by explicit opt-in")
    with pytest.raises(SandboxUnavailable):
        run("print('hi')", allow_unjailed=False)


# ------------------------------------------------------------------------ seccomp table


@pytest.mark.parametrize(
    ("machine", "header"),
    [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
     ("aarch64", "/usr/include/asm-generic/unistd.h")],
)
def test_syscall_numbers_match_the_kernel_headers(machine, header):
    if not Path(header).is_file():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    text = Path(header).read_text()
    numbers = {m.group(1): int(m.group(2))
               for m in re.finditer(r"#define __NR3?2?_(\w+)\s+(\d+)\b", text)}
    table = seccomp.ARCHES[machine][1]
    assert {name: numbers.get(name) for name in table} == table
    missing = [name for name in (*seccomp.DENIED, "clone", "clone3")
               if name not in table and name in numbers]
    assert missing == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"memory_mb": 8}, "memory_mb must be an integer >= 32"),
        ({"cpu_s": 0}, "cpu_s must be a whole number"),
        ({"max_procs": 0}, "max_procs must be an integer >= 1"),
        ({"max_file_bytes": 10}, "max_file_bytes must be an integer >= 4096"),
        ({"disk_bytes": 10}, "disk_bytes must be an integer >= 65536"),
    ],
)
def test_bad_limits_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        run("pass", **overrides)


def test_unencodable_program_is_a_clear_error():
    with pytest.raises(ValueError, match="program is not encodable as UTF-8"):
        run("x = '\ud800'\n")


# ------------------------------------------------------------------------ the pytest option

_TOY_CONFTEST = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.add", None, baseline="toy.add.base", gates=("parity",)))
    registry.register(Route("toy.add.base", "toy.add", "baseline"))
    registry.register(Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                            gates=("parity",)))
"""

_TOY_GATE = """
import os
import pytest

@pytest.mark.gate("parity", family="toy.add")
def test_parity(dflash_route, dflash_record):
    dflash_record(figure="env " + os.environ.get("DFLASH_ALLOW_UNJAILED", "unset"))
"""


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "opted-in"])
def test_the_report_records_the_unjailed_opt_in(pytester: pytest.Pytester,
                                                monkeypatch: pytest.MonkeyPatch,
                                                opt_in: bool) -> None:
    import json

    monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "0")  # restored after the in-process run
    pytester.makeconftest(_TOY_CONFTEST)
    pytester.makepyfile(test_gate=_TOY_GATE)
    args = ["-p", "no:cacheprovider", *(["--dflash-allow-unjailed"] if opt_in else [])]
    pytester.runpytest(*args).assert_outcomes(passed=1)
    report = json.loads((pytester.path / "dflash-report.json").read_text())
    assert report["session"]["allow_unjailed"] is opt_in
    figure = report["routes"]["toy.add.fast"]["gates"]["parity"]["figure"]
    assert figure == ("env 1" if opt_in else "env 0")  # what the sandbox reads in the tests


@pytest.mark.skipif(not Path("/usr/bin/python3").is_file() or os.geteuid() != 0,
                    reason="needs root and a system interpreter under /usr/bin")
def test_chroot_jail_holds_for_an_interpreter_under_usr(tmp_path: Path) -> None:
    """An interpreter inside /usr (a GPU box's system Python) is already visible through the /usr
    bind: the chroot jail must not try to create it again on the read-only view (it once failed
    with 'Read-only file system' there, leaving the quality gate pending)."""
    tools = _tools(tmp_path / "tools", ("unshare", "setpriv", "sh", "mount", "chroot", "stat"))
    repo = Path(sandbox.__file__).resolve().parents[2]
    child = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from pytest_dflash.sandbox import executor as sandbox\n"
        "sandbox._TOOL_PATH = sys.argv[2]\n"
        "r = sandbox.run_untrusted('print(6 * 7)', timeout_s=20, memory_mb=256)\n"
        "print(r.status, '|', r.stdout_tail.strip(), '|', r.isolation[0])\n"
    )
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", child, str(repo), str(tools)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 42 |" in done.stdout, done.stdout
    assert "chroot jail" in done.stdout, done.stdout
