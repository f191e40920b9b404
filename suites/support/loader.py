"""Loader scenarios, each run in its own child process (docs/gates.md, "loader").

Why a child process per scenario: loading native libraries is irreversible within a process,
and the clash scenario's failure mode is a SIGABRT of the whole process. A child reports its
loader status as one JSON line on stdout; the parent reads the exit status too, so "no abort" is
checked, not assumed.

The parent side is :func:`library_files` (real library files: the full and dense-only builds of
``kernels/csrc`` plus a copy, random bytes and a text file) and :func:`run_scenarios` (all
scenarios started at once, as separate processes, to keep the gate inside its time budget).
Run as ``python -m dflash_suites.support.loader SPEC_JSON`` to run one scenario by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_dflash.native.loader import SIDECAR_ENV

SCENARIO_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Scenario:
    """One child run: what the loader is given and what the child does before/after."""

    name: str
    bundled: str | None = "bundled"  # "bundled" = the package's own build, a path, or None
    sidecar: str | None = None  # passed as the argument
    sidecar_env: str | None = None  # passed through $DFLASH_D256_LIBRARY instead
    preload: str | None = None  # torch.ops.load_library(...) before the loader runs
    first_sidecar: str | None = None  # an earlier load_d256(first_sidecar, bundled=None) call
    raw_load: str | None = None  # torch.ops.load_library(...) with no loader at all (control)
    route_impl: str | None = None  # "module:attr" of the route to call once after loading
    device: str = "cpu"  # the gate's device: the loader verifies and the route runs there


@dataclass
class Outcome:
    scenario: Scenario
    returncode: int
    status: dict[str, Any] | None
    warnings: list[dict[str, str]]
    loaded: list[dict[str, str]]
    call: dict[str, Any] | None
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (f"scenario {self.scenario.name}: exit {self.returncode}, status "
                f"{json.dumps(self.status)[:1500]}, stderr tail {self.stderr[-800:]!r}")


def library_files(directory: Path) -> dict[str, Path]:
    """Real files for the scenarios, in ``directory``: full/dense-only builds (from the build
    cache), a copy of the full build at another path, a second copy (the clash), random bytes
    with a .so name, and a text file with a .so name."""
    from pytest_dflash.native import build
    built = build.build_libraries(("full", "dense_only"))
    full = built["full"]
    directory.mkdir(parents=True, exist_ok=True)
    files = {"full": full, "dense_only": built["dense_only"]}
    for name in ("sidecar_copy", "clash_copy"):
        files[name] = directory / f"{name}/libdflash_d256.so"
        files[name].parent.mkdir(exist_ok=True)
        shutil.copyfile(full, files[name])
    files["random"] = directory / "random.so"
    files["random"].write_bytes(os.urandom(64 * 1024))
    files["text"] = directory / "text.so"
    files["text"].write_text("this is a README, not a shared library\n" * 50)
    files["nonexistent"] = directory / "no/such/libdflash_d256.so"
    return files


def run_scenarios(scenarios: list[Scenario]) -> dict[str, Outcome]:
    """Start every scenario in its own child process at once; wait for all; parse their reports.

    The children are forked from one server process that has imported torch and nothing of this
    project (multiprocessing's forkserver): a child is a process no native library was ever
    loaded into, as a fresh interpreter is, without paying torch's import once per scenario
    (13 imports at once took half a minute on two cores).
    """
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    with tempfile.TemporaryDirectory(prefix="dflash-loader-") as tmp:
        started = []
        for scenario in scenarios:
            out, err = Path(tmp, f"{scenario.name}.out"), Path(tmp, f"{scenario.name}.err")
            proc = context.Process(target=_scenario_process,
                                   args=(json.dumps(scenario.__dict__), str(out), str(err)),
                                   name=f"loader-{scenario.name}")
            proc.start()
            started.append((scenario, proc, out, err, time.perf_counter()))
        outcomes = {}
        for scenario, proc, out, err, t0 in started:
            proc.join(SCENARIO_TIMEOUT_S - (time.perf_counter() - t0))
            if proc.is_alive():
                proc.kill()
                proc.join()
            report = _parse(out.read_text(errors="replace") if out.exists() else "")
            outcomes[scenario.name] = Outcome(
                scenario, int(proc.exitcode if proc.exitcode is not None else -1),
                report.get("status"), report.get("warnings", []), report.get("loaded", []),
                report.get("call"), err.read_text(errors="replace") if err.exists() else "",
                time.perf_counter() - t0,
            )
    return outcomes


def _scenario_process(spec: str, out: str, err: str) -> None:
    """A forked child's entry: its stdout and stderr go to files (a native abort's message
    included), the parent's loader variable is cleared or set as the scenario says."""
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.pop(SIDECAR_ENV, None)  # the parent's sidecar must not leak into a scenario
    scenario = json.loads(spec)
    if scenario["sidecar_env"] is not None:
        os.environ[SIDECAR_ENV] = scenario["sidecar_env"]
    _child(scenario)


def _parse(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {}


# ------------------------------------------------------------------------- child side

def _call_route(impl_name: str, device: str) -> dict[str, Any]:
    """Call the route's dense op once on ``device``; report the hits it recorded or the error
    it raised."""
    import torch

    from pytest_dflash.native import hits
    from pytest_dflash.routes.registry import resolve

    impl = resolve(impl_name)
    q = torch.randn(8, 4, 256, device=device)
    k = torch.randn(8, 1, 256, device=device)
    v = torch.randn(8, 1, 256, device=device)
    out = torch.full_like(q, float("nan"))
    try:
        with hits.counting() as delta:
            impl.dense(q, k, v, out, 0.0625, True)
    except Exception as exc:  # noqa: BLE001 - the error text is the observation
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "hits": {}}
    return {"ok": bool(torch.isfinite(out).all()), "error": None, "hits": delta.as_json()}


def _child(spec: dict[str, Any]) -> None:
    import warnings

    import torch

    scenario = Scenario(**spec)
    if scenario.raw_load is not None:
        torch.ops.load_library(scenario.raw_load)
    if scenario.preload is not None:
        torch.ops.load_library(scenario.preload)
    report: dict[str, Any] = {}
    if scenario.raw_load is None:
        from pytest_dflash.native import loader
        if scenario.first_sidecar is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loader.load_d256(scenario.first_sidecar, bundled=None, device=scenario.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            status = loader.load_d256(scenario.sidecar, bundled=scenario.bundled,
                                      device=scenario.device)
            again = loader.load_d256(scenario.sidecar, bundled=scenario.bundled,
                                     device=scenario.device)
        report["status"] = status.as_json()
        report["status"]["cached"] = again is status
        report["warnings"] = [{"category": w.category.__name__, "message": str(w.message)}
                              for w in caught]
        report["loaded"] = loader.loaded_libraries()
        if scenario.route_impl is not None:
            report["call"] = _call_route(scenario.route_impl, scenario.device)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
