"""Timing worker processes: the unit of repetition of every timing gate (docs/gates.md).

Why processes: a process carries a bias of its own (memory placement, the host path's dispatch
cost), so an interval over the rounds of one process covers only that process's noise and can
reject identical code. Each timing gate therefore collects one statistic from each of several
worker processes and decides on the interval across them
(``process_statistics.process_compare``).

Cost: starting a worker imports torch, loads the kernels and rebuilds the route registry, which
takes seconds, so a :class:`TimingPool` of ``policy.timing_processes`` workers is started once
per pytest run (lazily, at the first timing gate) and shared by every timing gate. A gate's
later look takes the next workers of the pool (no process contributes twice to one gate), which
are started together when a look first needs them and then stay for later gates.
A look's workers first build the job's pair together (``prepare``: engines, inputs, a CUDA
graph capture), then each is timed alone (the parent hands the job to one worker and waits for
its answer), so two timing workers never share a device while timing.

What a worker times is a *job*: a builder named ``"module:function"`` (defined by the suite
module, e.g. ``dflash_suites.support.gemm:verify_step_pair``) and JSON keyword arguments. The
worker calls ``builder(ctx, **kwargs)`` with a :class:`WorkerContext` that holds the device, the
policy, the profile and the route registry, rebuilt in the worker through the same
``pytest_dflash_routes`` hook and the same plugins as the pytest run (and the session's worker
plugins, such as the self-test's planted routes when it is on); the builder returns a
:class:`TimedPair`. This module is the parent's side; ``timing_child.py`` is the worker's.

Protocol: JSON lines. The parent writes a job to the worker's stdin; the worker answers on a
private pipe (its own stdout and stderr go to its log file, so prints of native code cannot
corrupt the protocol), with progress lines while it times. A worker that exits is an error
naming the gate, the worker and its log; one silent for ``policy.timing_worker_timeout_s`` is
killed and reported the same way, never waited on forever.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pytest_dflash.routes import origin

if TYPE_CHECKING:  # numpy stays off the plugin's import path
    from pytest_dflash.measure.process_statistics import ProcessSample

PROTOCOL_FD_ENV = "DFLASH_TIMING_PROTOCOL_FD"
# the baseline's name in a TimedArms round's order (candidates go by their route names)
BASELINE_ARM = "(baseline)"
START_TIMEOUT_S = 300.0
# glibc's allocator, fixed in every worker unless the run's environment sets it. By default a
# block above the mmap threshold (128 KiB at start) is mapped afresh on every allocation, and
# every page of it faults in again; each free of such a block raises the threshold, so a
# process's allocation cost falls over its first rounds and depends on what it ran before. A
# fresh worker timing 1024-token cold prefills saw the candidate's first rounds 50% slower than
# its later ones, and a worker that had timed other gates first did not: identical jobs gave
# a different verdict by the worker's history (benchmarks/results/cpu-worker-malloc.json).
# A fixed threshold at glibc's 64-bit maximum (32 MiB, which also ends the adjustment) and a
# trim threshold that keeps freed memory mapped give every worker, from its first round, the
# steady state a long-running server reaches. Other C libraries ignore these variables.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
                 "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024 * 1024)}


class TimingWorkerError(RuntimeError):
    """A timing worker crashed, hung, or could not build or time what it was asked to."""


@dataclass(frozen=True)
class TimingJob:
    """What a worker builds and times: ``builder(ctx, **kwargs)`` returns a TimedPair."""

    builder: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, sep, attr = self.builder.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"timing job builder {self.builder!r} must look like 'package.module:function'"
            )
        try:
            json.dumps(self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"timing job {self.builder}: kwargs must be JSON values (they "
                f"travel to worker processes): {exc}"
            ) from None


@dataclass
class TimedPair:
    """Candidate and baseline as zero-argument calls, built inside a worker."""

    candidate: Callable[[], Any]
    baseline: Callable[[], Any]
    before_each: Callable[[], Any] | None = None
    # on CUDA: try to capture both calls in a CUDA graph and time the replays (verify steps)
    graph: bool = False
    # called once after the timed rounds: JSON facts the gate checks (e.g. the first-token
    # hashes of every cold prefill), sent back in the process's info as "facts"
    facts: Callable[[], dict[str, Any]] | None = None
    # how the builder made the calls, for the process's info in the report (e.g. a cold
    # prefill captured in a CUDA graph by the builder itself: {"graph": ...})
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class TimedArms:
    """Several candidates and one baseline as zero-argument calls, built inside a worker and
    timed in the same rounds: each round runs every arm once, in an order balanced for each
    pair of arms, so the baseline runs once a round for all the candidates and each candidate's
    ratio is paired with the baseline run of its own round (``timing.SharedLook``)."""

    baseline: Callable[[], Any]
    candidates: dict[str, Callable[[], Any]]
    before_each: Callable[[], Any] | None = None
    # called once after the timed rounds: {candidate: its JSON facts}
    facts: Callable[[], dict[str, dict[str, Any]]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to rebuild the gate's environment, as JSON."""

    device: str
    threads: int
    profile: str
    policy: dict[str, Any]
    plugins: list[str]  # module names, or paths of conftest files
    # plugins the session adds in every worker (the self-test's, which plants its routes and
    # wraps their engines): {"factory": "module:callable", "kwargs": JSON}; the worker
    # registers ``factory(policy=the policy, **kwargs)`` before it asks for the routes
    worker_plugins: list[dict[str, Any]] = field(default_factory=list)
    # the in-process engine a job may build: None the reference engine, else the directory of
    # the Hugging Face model (--dflash-engine hf:PATH)
    hf_model: str | None = None
    hf_dtype: str | None = None  # its compute dtype (--dflash-dtype; None: float32)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "threads": self.threads,
            "profile": self.profile,
            "policy": self.policy,
            "plugins": list(self.plugins),
            "worker_plugins": [dict(entry) for entry in self.worker_plugins],
            "hf_model": self.hf_model,
            "hf_dtype": self.hf_dtype,
            "sys_path": list(self.sys_path),
        }


def plugin_references(hook_impls: Sequence[Any]) -> list[str]:
    """How a worker re-imports every plugin that registered routes.

    A module plugin travels by module name, a conftest by its file path. A plugin object (an
    instance registered at run time) cannot be rebuilt in another process: that is a usage
    error naming the fix, not a worker that silently lacks its routes.
    """
    refs: list[str] = []
    for impl in hook_impls:
        plugin = impl.plugin
        if not isinstance(plugin, ModuleType):
            raise TimingWorkerError(
                f"routes registered by plugin object {plugin!r} cannot be rebuilt in a timing "
                "worker process: implement pytest_dflash_routes in a module (a conftest.py or "
                "an installed plugin module) instead"
            )
        file = getattr(plugin, "__file__", None)
        name = plugin.__name__
        if file and (
            Path(file).name == "conftest.py"
            or name not in sys.modules
            or "/" in name
            or name.endswith("conftest")
        ):
            refs.append(str(Path(file).resolve()))
        else:
            refs.append(name)
    return refs


class _Worker:
    def __init__(self, index: int, spec: WorkerSpec, log_dir: Path, timeout_s: float) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self.log_path = log_dir / f"timing-worker-{index}.log"
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env[PROTOCOL_FD_ENV] = str(write_fd)
        env.setdefault("PYTHONHASHSEED", "random")
        for name, value in ALLOCATOR_ENV.items():
            env.setdefault(name, value)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest_dflash.measure.timing_child"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        self._reader = os.fdopen(read_fd, "rb", buffering=0)
        self._buffer = b""
        self._send({"op": "init", "spec": spec.as_json()})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the exit shows on the next read, with the log

    def _line(self, label: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimingWorkerError(
                    f"{label}: timing worker {self.index} (pid {self.pid}) sent nothing for "
                    f"{timeout_s:g} s (policy timing_worker_timeout_s) and was killed as "
                    f"hung; its log: {self.log_path}"
                )
            ready, _, _ = select.select([self._reader], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = self._reader.read(65536)
            if not chunk:
                code = self.proc.wait(timeout=10)
                raise TimingWorkerError(
                    f"{label}: timing worker {self.index} (pid {self.pid}) exited with code "
                    f"{code} while timing; its log: {self.log_path}{_tail(self.log_path)}"
                )
            self._buffer += chunk
            deadline = time.monotonic() + timeout_s  # any line is a sign of life
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def request(
        self, message: dict[str, Any], label: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send one request and wait for its answer (progress lines only keep it alive)."""
        self._send(message)
        return self.answer(label, timeout_s)

    def answer(self, label: str, timeout_s: float | None = None) -> dict[str, Any]:
        """The answer to the request sent last; TimingWorkerError if it is an error."""
        while True:
            answer = self._line(label, self.timeout_s if timeout_s is None else timeout_s)
            if "progress" in answer:
                continue
            if "error" in answer:
                error = TimingWorkerError(
                    f"{label}: timing worker {self.index} (pid {self.pid}) failed: "
                    f"{answer['error']}\nits log: {self.log_path}"
                )
                if answer.get("origin") == origin.CANDIDATE:  # the candidate's code raised there
                    origin.mark(error, origin.CANDIDATE)
                raise error
            return answer

    def close(self) -> None:
        self.ask_exit()
        self.finish()

    def ask_exit(self) -> None:
        """Tell a running worker to exit (it frees its device and engines as it goes)."""
        if self.proc.poll() is None:
            self._send({"op": "exit"})

    def finish(self) -> None:
        """Wait for the worker asked to exit (killed after 10 s), and close its pipes."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return ("\n  " + "\n  ".join(text[-lines:])) if text else ""


class TimingPool:
    """``size`` worker processes, started on first use and shared by every timing gate."""

    def __init__(
        self,
        spec: WorkerSpec | Callable[[], WorkerSpec],
        *,
        size: int,
        timeout_s: float,
        log_dir: Path | None = None,
    ) -> None:
        if size < 2:
            raise ValueError(
                f"a timing pool needs at least 2 workers (an interval across "
                f"processes needs two), got {size}"
            )
        # a callable is resolved at the first start: a run without timing gates imports no torch
        self._spec = spec
        self.size, self.timeout_s = size, timeout_s
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._workers: list[_Worker] = []
        self._started = 0
        self.started_s = 0.0  # seconds spent starting workers (reported as the pool's cost)

    @property
    def spec(self) -> WorkerSpec:
        if callable(self._spec):
            self._spec = self._spec()
        return self._spec

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="dflash-timing-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir

    def _ensure(self, label: str, count: int | None = None) -> None:
        """Start workers until the pool holds ``count`` (default: its size).

        The new workers start together (each imports torch and rebuilds the registry, seconds
        of mostly single-threaded work, or a CUDA context), and only then are they waited for:
        nothing is being timed while they start, and a look that needs six more pays about one
        start, not six. A worker that fails to start is an error naming the gate and its log.
        """
        wanted = (self.size if count is None else count) - len(self._workers)
        if wanted <= 0:
            return
        start = time.perf_counter()
        try:
            spec = self.spec
        except TimingWorkerError as exc:
            raise TimingWorkerError(f"{label}: {exc}") from None
        new = [_Worker(self._started + i, spec, self.log_dir, self.timeout_s)
               for i in range(wanted)]
        self._started += wanted
        try:
            for worker in new:
                # starting imports torch and rebuilds the registry: on a loaded machine that
                # alone can take longer than a hung worker's timeout
                worker.request({"op": "ping"}, label, max(self.timeout_s, START_TIMEOUT_S))
        except TimingWorkerError:
            for worker in new:
                worker.kill()
            raise
        self._workers.extend(new)
        self.started_s += time.perf_counter() - start

    def _answers(self, job: TimingJob, count: int, *, rounds: int, warmup: int, seed: int,
                 label: str, first: int, max_rounds: int | None,
                 budget_s: float) -> list[tuple[_Worker, dict[str, Any]]]:
        """Workers ``first .. first + count - 1`` prepare ``job`` together, then each times it
        alone; their answers, in order (the route hits they timed booked here)."""
        self._ensure(label, max(self.size, first + count))
        workers = self._workers[first : first + count]
        self._prepare(workers, job, label)
        answers = []
        for i, worker in enumerate(workers):
            answer = worker.request(
                {
                    "op": "time",
                    "builder": job.builder,
                    "kwargs": job.kwargs,
                    "rounds": rounds,
                    "max_rounds": rounds if max_rounds is None else max(rounds, max_rounds),
                    "budget_s": budget_s,
                    "warmup": warmup,
                    "seed": [seed, first + i],
                },
                label,
            )
            _replay_hits(answer.get("hits", []))
            answers.append((worker, answer))
        return answers

    def sample(
        self,
        job: TimingJob,
        count: int,
        *,
        rounds: int,
        warmup: int,
        seed: int,
        label: str,
        first: int = 0,
        max_rounds: int | None = None,
        budget_s: float = 0.0,
    ) -> list[ProcessSample]:
        """``count`` ProcessSamples of ``job`` from workers ``first .. first + count - 1``,
        timed one worker at a time, each timing at least ``rounds`` rounds and as many more as
        fill ``budget_s`` seconds, up to ``max_rounds`` (``worker.rounds_for``).

        A gate's first look takes the first workers, each later look the next ones, so no
        process contributes twice to one gate's interval. Workers a look needs beyond those
        running are started then and stay in the pool, so a later gate's later look finds them.
        """
        from pytest_dflash.measure.process_statistics import ProcessSample

        return [
            ProcessSample(worker=worker.index, pid=worker.pid, candidate_s=answer["candidate_s"],
                          baseline_s=answer["baseline_s"], orders=answer["orders"],
                          setup_s=answer["setup_s"], info=answer.get("info", {}))
            for worker, answer in self._answers(job, count, rounds=rounds, warmup=warmup,
                                                seed=seed, label=label, first=first,
                                                max_rounds=max_rounds, budget_s=budget_s)
        ]

    def sample_arms(self, job: TimingJob, count: int, *, rounds: int, warmup: int, seed: int,
                    label: str, first: int = 0, max_rounds: int | None = None,
                    budget_s: float = 0.0) -> dict[str, list[ProcessSample]]:
        """As :meth:`sample`, for a job whose builder returns :class:`TimedArms`: per candidate,
        its ProcessSamples, each paired with the baseline runs of the same rounds. A
        process's ``info`` names the arms timed together (``arms``) and holds the candidate's
        own facts."""
        from pytest_dflash.measure.process_statistics import ProcessSample

        samples: dict[str, list[ProcessSample]] = {}
        for worker, answer in self._answers(job, count, rounds=rounds, warmup=warmup, seed=seed,
                                            label=label, first=first, max_rounds=max_rounds,
                                            budget_s=budget_s):
            if "arms" not in answer:
                raise TimingWorkerError(f"{label}: job {job.builder} did not build TimedArms")
            info = answer.get("info", {})
            facts = info.get("facts") or {}
            for name, seconds in answer["arms"].items():
                orders = ["cb" if order.index(name) < order.index(BASELINE_ARM) else "bc"
                          for order in answer["orders"]]
                own = {**info, "arms": sorted(answer["arms"])}
                if name in facts:
                    own["facts"] = facts[name]
                samples.setdefault(name, []).append(ProcessSample(
                    worker=worker.index, pid=worker.pid, candidate_s=seconds,
                    baseline_s=answer["baseline_s"], orders=orders, setup_s=answer["setup_s"],
                    info=own))
        return samples

    def _prepare(self, workers: Sequence[_Worker], job: TimingJob, label: str) -> None:
        """Every worker of a look builds the job's pair at once (engines, inputs, a CUDA graph
        capture: seconds of host work each), and only then is each timed, alone. Nothing is
        timed while they build, so a look costs about one build instead of one per worker.
        Every answer is read before an error is raised, so no worker is left with a stale one.
        """
        message = {"op": "prepare", "builder": job.builder, "kwargs": job.kwargs}
        for worker in workers:
            worker._send(message)
        failure: TimingWorkerError | None = None
        for worker in workers:
            try:
                worker.answer(label)
            except TimingWorkerError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def ask(self, message: dict[str, Any], label: str) -> list[dict[str, Any]]:
        """Send ``message`` to every pool worker; their answers (for tests and diagnostics)."""
        self._ensure(label)
        return [worker.request(message, label) for worker in self._workers]

    def close(self) -> None:
        """Every worker told to exit first, then each waited for: they tear down their CUDA
        contexts and engines together, in the time of the slowest rather than of all."""
        for worker in self._workers:
            worker.ask_exit()
        for worker in self._workers:
            worker.finish()
        self._workers.clear()


def _replay_hits(counts: Sequence[Sequence[Any]]) -> None:
    """Record the worker's route hits here, so the gate's hit checks see what ran there."""
    from pytest_dflash.native import hits

    for route, op, n in counts:
        hits.record(route, op, int(n))


@dataclass(frozen=True)
class TimingSetup:
    """Where a session's timing gates time and show their progress: the run's pool of worker
    processes (None: time in the gate's process), the progress sinks (``progress.Sink``) and
    the first looks timed for a group of routes. The session keeps them and hands them to a
    gate as ``dflash_gate.timing``, so two pytest sessions in one process never share any."""

    pool: TimingPool | None = None
    sinks: tuple[Any, ...] = ()
    # the session's first looks timed for a group of routes, by (group, route), waiting for
    # their own gates (``timing.SharedLook``)
    looks: dict[tuple[str, str], Any] = field(default_factory=dict)
