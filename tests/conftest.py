"""Own tests of pytest-dflash.

torch is imported here, once, before any pytester inline run: pytester restores sys.modules
after each inline run, and a C extension such as torch cannot be imported a second time.
httpx likewise: imported first inside an inline run and re-imported after it, its transport maps
the *old* httpcore exception classes, so a refused connection escapes as a raw httpcore error
and a server engine's health wait gives up at once instead of retrying. `evaluate` likewise: its
import registers torch's ``c10d_functional`` op library, which a second import refuses, so a
second inline run that scores perplexity would end in a harness error. httpx and `evaluate`
are imported by a session fixture every test uses, not at this module's import: a gate session
started at the repository root (``--pyargs dflash_suites``) loads this conftest through
``testpaths`` and runs none of these tests, and `evaluate` alone costs it seconds.

``real_runs`` runs real gates once per session; the readers of a report (plot, JUnit, diff,
summaries, merge) are tested on the files they wrote. Under pytest-xdist (``pytest tests -n
auto``) the first worker that needs such a run makes it, under a file lock, and every other
worker reads the same files.

Under xdist every test still sees the environment of a run without it: the plugin refuses timing
gates in a process that has ``PYTEST_XDIST_WORKER`` (they must never share the device), and the
gate sessions these tests start, in process or as children, are sessions of their own.

Under xdist the workers share the host's cores out: each worker, and every process it starts (a
gate session, its timing workers, a served engine), runs ``cores // workers`` torch CPU threads
(``OMP_NUM_THREADS`` and ``torch.set_num_threads``). With a thread per core in every worker, the
workers' OpenMP threads spin on the same cores and a test of many small ops (an engine's decode
steps) runs many times slower. A test marked ``idle_cores`` runs alone and gets the caller's
threads back for its duration: a timing decision is asserted only on the threads a run without
xdist has. A caller who sets ``OMP_NUM_THREADS`` keeps it everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _imported_once() -> None:
    """Before the first test, so before any pytester inline run (see the module's docstring)."""
    import evaluate  # noqa: F401

    with contextlib.suppress(ImportError):  # the test extra; `pip install -e .` alone lacks it
        import httpcore  # noqa: F401  (httpx imports it lazily, inside the first client)
        import httpx  # noqa: F401


# ------------------------------------------------------------------ xdist

XDIST_VARIABLES = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def child_env() -> dict[str, str]:
    """This process's environment without the variables by which xdist marks its workers: the
    environment of a pytest session a test starts."""
    return {k: v for k, v in os.environ.items() if k not in XDIST_VARIABLES}


@pytest.fixture(autouse=True)
def _outside_xdist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs as in a session without xdist (see the module's docstring); a test of the
    plugin under xdist starts its own workers (``runpytest_subprocess("-n", "2")``)."""
    for name in XDIST_VARIABLES:
        monkeypatch.delenv(name, raising=False)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class _Threads:
    """A worker's share of the cores, and the caller's setting an ``idle_cores`` test gets back."""

    share: int
    full: int
    saved: dict[str, str | None]

    def cap(self) -> None:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(self.share)
        torch.set_num_threads(self.share)

    def restore(self) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(self.full)


THREADS = pytest.StashKey[_Threads]()


def worker_threads(cores: int, workers: int) -> int:
    """Torch threads of one of ``workers`` xdist workers on ``cores`` cores: together no more
    threads than cores, and at least one each."""
    return max(1, cores // max(1, workers))


CACHE_HOME = "XDG_CACHE_HOME"


def pin_cache_home() -> Path:
    """Keep every test on the caller's cache folder, whatever HOME a test is given.

    pytester gives each test a HOME of its own (its tmp path), so the user's ``~/.cache``
    vanished for every gate session a test started there, in process or as a child: each one
    built the native library again (11 to 14 s on two cores), and the Hugging Face and
    matplotlib caches started empty. Pinning ``XDG_CACHE_HOME`` (which pytest-dflash's build
    cache, huggingface_hub, datasets, matplotlib and torch's extension builds all follow) to the
    folder the caller's HOME gives keeps one cache for the whole run; a caller who sets it, or
    ``DFLASH_CACHE_DIR``, keeps theirs. A test of the cache's location sets its own."""
    if not os.environ.get(CACHE_HOME):
        os.environ[CACHE_HOME] = str(Path.home() / ".cache")
    return Path(os.environ[CACHE_HOME])


def pytest_configure(config: pytest.Config) -> None:
    pin_cache_home()
    config.addinivalue_line(
        "markers", "idle_cores: the test asserts a timing decision; under xdist no other test "
        "runs while it does (the other workers wait), on the caller's torch threads")
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or "OMP_NUM_THREADS" in os.environ:
        return  # no xdist, or the caller chose the threads: every process keeps them
    share = worker_threads(len(os.sched_getaffinity(0)), int(workerinput["workercount"]))
    threads = _Threads(share, torch.get_num_threads(),
                       {name: os.environ.get(name) for name in THREAD_VARIABLES})
    config.stash[THREADS] = threads
    threads.cap()


def _xdist_base(config: pytest.Config) -> Path:
    """The folder this test run's processes share (the workers' basetemps are its children)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if hasattr(config, "workerinput") else base


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under xdist a test marked ``idle_cores`` runs alone: it holds an exclusive lock that every
    other test takes shared. A waiting exclusive test holds the turnstile, so the other workers
    start no new test meanwhile (a writer-preferring lock out of two flock files)."""
    if not hasattr(item.config, "workerinput"):
        return (yield)
    import fcntl

    base = _xdist_base(item.config)
    exclusive = item.get_closest_marker("idle_cores") is not None
    threads = item.config.stash.get(THREADS, None)
    with open(base / "idle-cores.turnstile", "a") as turnstile, \
            open(base / "idle-cores.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive and threads is not None:
            threads.restore()  # alone on the cores: the threads of a run without xdist
        try:
            return (yield)
        finally:
            if exclusive and threads is not None:
                threads.cap()
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@contextlib.contextmanager
def shared_once(request: pytest.FixtureRequest, name: str):
    """A folder for data made once per test run, whatever the number of xdist workers: yields
    ``(folder, made)``; when ``made`` is False the caller makes the data in ``folder`` while it
    holds the lock, and it is marked made only when that succeeds."""
    from filelock import FileLock

    base = _xdist_base(request.config)
    folder, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock"), timeout=1800):
        made = done.exists()
        folder.mkdir(exist_ok=True)
        yield folder, made
        done.touch()


# ------------------------------------------------------------------ reports of real gate runs

ROOT = Path(__file__).resolve().parent.parent
# the real gates the readers of a report are tested on: the fa2 route's loader and parity gates
# (deterministic) and its speed gate (timed in worker processes), at quick size
REAL_SELECTION = ("-m", "sm70 and (loader or parity or speed)", "--dflash-route",
                  "attn.d256.fa2", "--dflash-profile", "quick")


@dataclass(frozen=True)
class RealRuns:
    """Three shards of the real selection, each run in its own folder as on its own host,
    their merge, and one unsharded run of the deterministic gates."""

    folder: Path
    shards: tuple[Path, ...]  # s1.json, s2.json, s3.json
    junit: tuple[Path, ...]  # each shard's JUnit XML
    merged: Path  # pytest-dflash merge of the three
    unsharded: Path  # one run of the loader and parity gates

    def load(self, path: Path) -> dict:
        return json.loads(path.read_text(encoding="utf-8"))


def _pytest_in(folder: Path, *args: str) -> subprocess.Popen[bytes]:
    """A gate session started in ``folder`` (as on a host of its own), not waited for; its
    output goes to ``folder/pytest.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "--rootdir", str(ROOT), "-c",
               str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider", "-q", *args,
               str(ROOT / "suites")]
    with open(folder / "pytest.log", "wb") as log:
        return subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env())


@pytest.fixture(scope="session")
def real_runs(request: pytest.FixtureRequest) -> RealRuns:
    """Real gates run once per test run (a few minutes on a 2-core CPU), shared by the xdist
    workers: a change of the report's shape reaches every test built on these files. The
    readers only read them; a test that edits one edits a copy in its own tmp_path."""
    with shared_once(request, "real-runs") as (folder, made):
        shards = tuple(folder / f"host{k}" / f"s{k}.json" for k in (1, 2, 3))
        junit = tuple(p.with_suffix(".xml") for p in shards)
        unsharded, merged = folder / "one" / "one.json", folder / "all.json"
        if not made:
            # the four sessions at once, as on four hosts: the readers never depend on a speed
            # verdict, and the other xdist worker often waits for these files meanwhile
            runs = [_pytest_in(report.parent, *REAL_SELECTION, f"--dflash-shard={k}/3",
                               # 3 rounds a process in the report (evidence.compact): every
                               # reader meets a sample
                               "--dflash-report-rounds=3",
                               f"--dflash-report={report}", f"--junitxml={xml}")
                    for k, report, xml in zip((1, 2, 3), shards, junit, strict=True)]
            runs.append(_pytest_in(unsharded.parent, "-m", "sm70 and (loader or parity)",
                                   *REAL_SELECTION[2:], f"--dflash-report={unsharded}"))
            for run in runs:
                run.wait(timeout=1200)
            for run, where in zip(runs, [*(p.parent for p in shards), unsharded.parent],
                                  strict=True):
                log = (where / "pytest.log").read_text(encoding="utf-8", errors="replace")
                assert run.returncode in (0, 1), log[-6000:]
            done = subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "merge",
                                   str(merged), *map(str, shards)], capture_output=True,
                                  text=True, timeout=120, env=child_env())
            assert done.returncode == 0, done.stderr
    return RealRuns(folder, shards, junit, merged, unsharded)
