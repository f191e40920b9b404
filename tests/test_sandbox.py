"""Hostile completions against the sandboxed executor: each is contained, scored as a failure,
and the run goes on. Every check looks at the real outside world (files, sockets, processes),
not at what the sandbox claims."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from pytest_dflash.sandbox import isolation, run_untrusted

LIMITS = {"timeout_s": 2.0, "memory_mb": 256}


def run(program: str, **overrides):
    return run_untrusted(textwrap.dedent(program), **{**LIMITS, **overrides})


def kernel_barrier(prefix: str) -> bool:
    """True if the probed isolation notes say a kernel barrier of this kind is in force."""
    return any(
        note.startswith(prefix) and "in-process" not in note and "stays root" not in note
        for note in isolation()
    )


def test_correct_program_passes():
    result = run("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n")
    assert result.status == "passed", result.stderr_tail
    assert result.passed and result.returncode == 0
    assert result.stdout_tail.strip() == "ok"


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


def test_infinite_loop_times_out_and_workdir_is_removed():
    result = run(
        "import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    pass\n", timeout_s=1.0
    )
    assert result.status == "timeout" and not result.passed
    workdir = Path(result.stdout_tail.strip())
    assert workdir.name == "work", result.stdout_tail
    assert not workdir.exists()
    assert not workdir.parent.exists()
    assert run("print('next')").passed  # the run goes on


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
def test_memory_bomb_is_contained(program):
    result = run(program, memory_mb=128)
    assert result.status in ("failed", "killed") and not result.passed
    assert "MemoryError" in result.stderr_tail or result.status == "killed"
    assert run("print('next')").passed


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry.name))
    return found


def test_fork_bomb_is_contained():
    program = """
        import os
        print(os.getcwd(), flush=True)
        refused = []
        attempts = {
            "fork": lambda: os.fork(),
            "forkpty": lambda: os.forkpty(),
            "posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
            "spawnv": lambda: os.spawnv(os.P_NOWAIT, "/bin/true", ["true"]),
            "execv": lambda: os.execv("/bin/true", ["true"]),
            "subprocess": lambda: __import__("subprocess").Popen(["/bin/true"]),
            "multiprocessing": lambda: __import__("multiprocessing").Process(target=print).start(),
            "pty": lambda: __import__("pty").fork(),
            "ctypes": lambda: __import__("ctypes").CDLL(None).fork(),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
            except (PermissionError, ImportError):
                refused.append(name)
        print(",".join(refused), flush=True)
        while True:
            os.fork()
    """
    result = run(program)
    assert result.status == "failed" and not result.passed, result.stderr_tail
    workdir, refused = result.stdout_tail.split()
    assert refused.split(",") == [
        "fork",
        "forkpty",
        "posix_spawn",
        "spawnv",
        "execv",
        "subprocess",
        "multiprocessing",
        "pty",
        "ctypes",
    ]
    assert _processes_with(workdir) == []  # nothing it started outlives it


def test_deleting_a_file_outside_is_refused(tmp_path):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep me\n")
    before = sentinel.stat()
    program = f"""
        import os, pathlib, shutil
        target = {str(sentinel)!r}
        for attempt in (
            lambda: os.remove(target),
            lambda: os.unlink(target),
            lambda: pathlib.Path(target).unlink(),
            lambda: os.rename(target, "stolen.txt"),
            lambda: os.truncate(target, 0),
            lambda: os.chmod(target, 0o777),
            lambda: shutil.rmtree(os.path.dirname(target)),
            lambda: open(target, "w").write("overwritten"),
        ):
            try:
                attempt()
            except OSError as exc:
                print(type(exc).__name__)
        assert not os.path.exists(target), "the attack failed"
    """
    result = run(program)
    assert not result.passed
    assert sentinel.read_text() == "keep me\n"
    after = sentinel.stat()
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == (
        before.st_mode,
        before.st_size,
        before.st_mtime_ns,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sentinel.txt"]


def test_writing_a_file_outside_is_refused(tmp_path):
    program = f"""
        import os, pathlib
        base = {str(tmp_path)!r}
        wrote = []
        for name, attempt in {{
            "open": lambda: open(os.path.join(base, "a.txt"), "w").write("x"),
            "pathlib": lambda: pathlib.Path(base, "b.txt").write_text("x"),
            "os.open": lambda: os.open(os.path.join(base, "c.txt"), os.O_CREAT | os.O_WRONLY),
            "mkdir": lambda: os.mkdir(os.path.join(base, "d")),
            "symlink": lambda: os.symlink("/etc/passwd", os.path.join(base, "e")),
            "tmp": lambda: open("/tmp/dflash-sandbox-escape.txt", "w").write("x"),
        }}.items():
            try:
                attempt()
                wrote.append(name)
            except OSError:
                pass
        assert len(wrote) == 6, f"the attack failed: only {{wrote}} wrote"
    """
    result = run(program)
    assert not result.passed
    assert list(tmp_path.iterdir()) == []
    assert not Path("/tmp/dflash-sandbox-escape.txt").exists()


def test_writing_inside_the_workdir_is_allowed():
    program = """
        import os, pathlib, tempfile
        pathlib.Path("data.txt").write_text("hello")
        os.mkdir("sub")
        os.rename("data.txt", "sub/data.txt")
        with tempfile.TemporaryDirectory() as scratch:
            pathlib.Path(scratch, "x").write_text("y")
        assert pathlib.Path("sub/data.txt").read_text() == "hello"
    """
    result = run(program)
    assert result.passed, result.stderr_tail


def test_bypassing_the_file_guard_is_stopped_by_the_kernel(tmp_path):
    if not kernel_barrier("files:") and not kernel_barrier("user:"):
        pytest.skip(f"no kernel file barrier on this machine: {isolation()}")
    # The un-guarded FileIO base class sidesteps the in-process guard: only the kernel remains.
    program = f"""
        import io
        raw_fileio = io.FileIO.__mro__[1]
        raw_fileio({str(tmp_path / "bypass.txt")!r}, "w").write(b"escaped")
    """
    result = run(program)
    assert result.status == "failed"
    assert "PermissionError" in result.stderr_tail or "Read-only file system" in result.stderr_tail
    assert list(tmp_path.iterdir()) == []


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


def test_bypassing_the_socket_guard_is_stopped_by_the_kernel(listener):
    if not kernel_barrier("network:"):
        pytest.skip(f"no network namespace on this machine: {isolation()}")
    port = listener.getsockname()[1]
    # Load the raw _socket extension from its file, past the in-process guard.
    program = f"""
        import glob, importlib.util, sys
        path = glob.glob(sys.base_prefix + "/lib/python3*/lib-dynload/_socket*.so")[0]
        spec = importlib.util.spec_from_file_location("_socket", path)
        raw = importlib.util.module_from_spec(spec)
        sock = raw.socket(2, 1)
        print("raw socket made", flush=True)
        sock.connect(("127.0.0.1", {port}))
        print("CONNECTED")
    """
    result = run(program)
    assert not result.passed
    assert "raw socket made" in result.stdout_tail, result.stderr_tail
    assert "CONNECTED" not in result.stdout_tail
    assert "Network is unreachable" in result.stderr_tail, result.stderr_tail
    _assert_accepted_nothing(listener)


def test_os_system_touch_is_refused(tmp_path):
    target = tmp_path / "touched"
    result = run(f"import os\nos.system('touch {target}')\n")
    assert result.status == "failed"
    assert "PermissionError" in result.stderr_tail
    assert not target.exists()


def test_parent_environment_is_not_visible(monkeypatch):
    secret = "dflash-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("DFLASH_TEST_SECRET", secret)
    program = """
        import os
        print(dict(os.environ))
        for pid in (os.getppid(), 1):
            try:
                print(open(f"/proc/{pid}/environ", "rb").read())
            except OSError as exc:
                print(type(exc).__name__)
        assert "DFLASH_TEST_SECRET" in os.environ
    """
    result = run(program)
    assert not result.passed
    assert secret not in result.stdout_tail + result.stderr_tail
    assert "'PYTHONHASHSEED': '0'" in result.stdout_tail


def test_isolation_reports_every_barrier():
    notes = isolation()
    assert [note.split(":")[0] for note in notes] == ["network", "files", "user"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"memory_mb": 8}, "memory_mb must be an integer >= 32"),
        ({"cpu_s": 0}, "cpu_s must be a whole number"),
        ({"max_procs": 0}, "max_procs must be an integer >= 1"),
        ({"max_file_bytes": 10}, "max_file_bytes must be an integer >= 4096"),
    ],
)
def test_bad_limits_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        run("pass", **overrides)


def test_unencodable_program_is_a_clear_error():
    with pytest.raises(ValueError, match="program is not encodable as UTF-8"):
        run("x = '\ud800'\n")
