"""The pytest plugin: options, markers, route parametrization, evidence collection, verdicts.

Loaded by pytest through the ``pytest11`` entry point. It imports nothing heavy at load time:
torch is imported only when a fixture or the report header needs the device, so ``pytest --help``
and unrelated test runs stay fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pytest_dflash import hookspec, shipped
from pytest_dflash import report as reports
from pytest_dflash.gates import EXCLUSIVE_KINDS, GATE_KINDS, PROFILES, UnknownNameError, check_kind
from pytest_dflash.loader import SIDECAR_ENV
from pytest_dflash.policy import Policy, PolicyError, load_policy
from pytest_dflash.registry import RegistryError, Route, RouteRegistry
from pytest_dflash.table import render

STATE = pytest.StashKey["DflashState"]()
PROPERTY = "dflash"  # user_properties key: travels with reports through xdist
DEFAULT_REPORT = "dflash-report.json"


class DflashState:
    """Everything the plugin knows about this session, stashed on the config."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.registry = RouteRegistry()
        self.policy = Policy()
        self.selected_routes: set[str] = set()
        self.selected_gates: set[tuple[str, str]] = set()
        self.device_info: dict[str, Any] | None = None
        self.profile: str | None = None

    def candidates(self) -> list[Route]:
        routes = self.registry.candidates()
        if self.selected_routes:
            routes = [r for r in routes if r.name in self.selected_routes]
        if self.selected_gates:
            names = {route for route, _ in self.selected_gates}
            routes = [r for r in routes if r.name in names]
        return routes


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dflash", "pytest-dflash: gate candidate kernel routes")
    group.addoption("--dflash-device", choices=("auto", "cpu", "cuda"), default=None,
                    help="device the gates run on (default: ini dflash_device, else auto)")
    group.addoption("--dflash-profile", choices=PROFILES, default=None,
                    help="gate sizes: quick | ci | full (default: ci on CPU, full on CUDA)")
    group.addoption("--dflash-route", action="append", default=[], metavar="NAME",
                    help="gate only this candidate route (repeatable)")
    group.addoption("--dflash-gate", action="append", default=[], metavar="ROUTE:KIND",
                    help="run exactly this gate of this route, e.g. to rerun one failure "
                         "(repeatable)")
    group.addoption("--dflash-sidecar", default=None, metavar="PATH",
                    help=f"explicit D256 op library, used only if the bundled build lacks the "
                         f"ops (also ${SIDECAR_ENV})")
    group.addoption("--dflash-report", default=None, metavar="PATH",
                    help="JSON evidence report (default: ini dflash_report, else "
                         f"{DEFAULT_REPORT})")
    group.addoption("--dflash-merge", action="store_true", default=None,
                    help="merge this run's results into the existing report (same evidence only)")
    group.addoption("--dflash-strict", action="store_true", default=None,
                    help="fail the run if a selected candidate is left pending (CI gate jobs)")
    parser.addini("dflash_device", "default for --dflash-device", default="auto")
    parser.addini("dflash_profile", "default for --dflash-profile", default="")
    parser.addini("dflash_report", "default for --dflash-report", default=DEFAULT_REPORT)
    parser.addini("dflash_strict", "default for --dflash-strict", type="bool", default=False)
    parser.addini("dflash_merge", "default for --dflash-merge", type="bool", default=False)


def _option(config: pytest.Config, name: str) -> Any:
    value = config.getoption(f"dflash_{name}")
    return config.getini(f"dflash_{name}") if value is None else value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sm70: the SM70 gate suite")
    config.addinivalue_line(
        "markers", "gate(kind, family=None, route=None): a gate test of the given kind, "
        "parametrized over the candidates of a family (or one route) via `dflash_route`")
    config.addinivalue_line(
        "markers", "requires_sm70: needs exact compute capability 7.0; elsewhere skipped and "
        "its gate stays pending")
    for kind in GATE_KINDS:
        config.addinivalue_line("markers", f"{kind}: gate tests of kind {kind}")

    state = DflashState(config)
    config.stash[STATE] = state
    if not config.pluginmanager.is_registered(shipped):
        config.pluginmanager.register(shipped, "dflash-shipped-routes")
    try:
        state.policy = load_policy(config.rootpath)
        config.hook.pytest_dflash_routes(registry=state.registry)
        state.registry.validate()
        _select(state, config)
    except (RegistryError, UnknownNameError, PolicyError) as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None
    sidecar = config.getoption("dflash_sidecar")
    if sidecar:
        path = Path(sidecar).expanduser().resolve()
        if not path.exists():
            raise pytest.UsageError(f"--dflash-sidecar {sidecar}: no such file")
        os.environ[SIDECAR_ENV] = str(path)
    if _option(config, "device") == "cuda":
        device_info(config)  # an explicit device is checked now, as a usage error
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(EvidenceCollector(config), "dflash-evidence")


def _select(state: DflashState, config: pytest.Config) -> None:
    for name in config.getoption("dflash_route"):
        route = state.registry.get(name)
        if route.role != "candidate":
            raise UnknownNameError(f"--dflash-route {name}: only candidate routes are gated "
                                   f"({name} is the {route.role})")
        state.selected_routes.add(name)
    for spec in config.getoption("dflash_gate"):
        name, sep, kind = spec.rpartition(":")
        if not sep or not name:
            raise UnknownNameError(f"--dflash-gate {spec!r} must look like ROUTE:KIND, "
                                   f"e.g. attn.d256.fa2:speed")
        route = state.registry.get(name)
        check_kind(kind)
        if kind not in route.gates:
            raise UnknownNameError(f"--dflash-gate {spec}: route {name} does not require a "
                                   f"{kind} gate; its gates: {', '.join(route.gates) or 'none'}")
        state.selected_gates.add((name, kind))


def state_of(config: pytest.Config) -> DflashState:
    return config.stash[STATE]


# ---------------------------------------------------------------- collection

def _gate_marker(definition: Any) -> tuple[str, str | None, str | None] | None:
    marker = definition.get_closest_marker("gate")
    if marker is None:
        return None
    if len(marker.args) != 1:
        raise ValueError("@pytest.mark.gate takes exactly one gate kind, e.g. gate('parity', "
                         f"family='attn.d256'); known kinds: {', '.join(GATE_KINDS)}")
    kind = check_kind(marker.args[0])
    family, route = marker.kwargs.get("family"), marker.kwargs.get("route")
    if (family is None) == (route is None):
        raise ValueError(f"@pytest.mark.gate({kind!r}) needs exactly one of family= or route=")
    return kind, family, route


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    gate = _gate_marker(metafunc.definition)
    if gate is None:
        return
    kind, family, route_name = gate
    if "dflash_route" not in metafunc.fixturenames:
        raise ValueError(f"{metafunc.definition.nodeid}: a gate test must take the "
                         "`dflash_route` fixture so its outcome is bound to a route")
    state = state_of(metafunc.config)
    if route_name is not None:
        routes = [state.registry.get(route_name)]
    else:
        if family not in state.registry.families():
            raise UnknownNameError(f"unknown family {family!r}; known families: "
                                   f"{', '.join(state.registry.families())}")
        routes = state.registry.candidates(family, kind)
    selected = {r.name for r in state.candidates()}
    routes = [r for r in routes if r.name in selected and kind in r.gates]
    metafunc.parametrize("dflash_route", routes, ids=[r.name for r in routes], indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = state_of(config)
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        route = callspec.params.get("dflash_route") if callspec else None
        marker = item.get_closest_marker("gate")
        if route is None or marker is None:
            if state.selected_gates:
                drop.append(item)
            else:
                keep.append(item)
            continue
        kind = marker.args[0]
        item.add_marker(kind)
        item.user_properties.append((PROPERTY, {"route": route.name, "kind": kind,
                                                "measurements": {}}))
        if state.selected_gates and (route.name, kind) not in state.selected_gates:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _binding(item_or_report: Any) -> dict[str, Any] | None:
    for key, value in item_or_report.user_properties:
        if key == PROPERTY:
            return value
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    binding = _binding(item)
    if binding and binding["kind"] in EXCLUSIVE_KINDS and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip(f"refused: {binding['kind']} gates never share the device with parallel "
                    "workers; rerun them without -n (or with -n0)")
    if item.get_closest_marker("requires_sm70"):
        reason = _sm70_missing(item.config)
        if reason:
            pytest.skip(f"requires SM70 hardware: {reason}")


def _sm70_missing(config: pytest.Config) -> str | None:
    info = device_info(config)
    if info["type"] != "cuda":
        return f"running on {info['name']}"
    if info.get("capability") != "7.0":
        return f"{info['name']} has capability {info.get('capability')}, not 7.0"
    return None


# ---------------------------------------------------------------- fixtures

@pytest.fixture
def dflash_route(request: pytest.FixtureRequest) -> Route:
    """The candidate route this gate test measures (parametrized by the plugin)."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(f"{request.node.nodeid}: `dflash_route` is only available to "
                                "tests marked @pytest.mark.gate(kind, family=...)")
    reason = request.param.unavailable_reason()
    if reason:
        pytest.skip(f"{request.param.name} unavailable here: {reason}")
    return request.param


@pytest.fixture(scope="session")
def dflash_registry(pytestconfig: pytest.Config) -> RouteRegistry:
    return state_of(pytestconfig).registry


@pytest.fixture(scope="session")
def dflash_policy(pytestconfig: pytest.Config) -> Policy:
    return state_of(pytestconfig).policy


@pytest.fixture(scope="session")
def dflash_profile(pytestconfig: pytest.Config) -> str:
    return profile_of(pytestconfig)


@pytest.fixture(scope="session")
def dflash_device(pytestconfig: pytest.Config) -> Any:
    import torch

    return torch.device(device_info(pytestconfig)["type"])


@pytest.fixture(scope="session")
def dflash_sidecar(pytestconfig: pytest.Config) -> Path | None:
    value = pytestconfig.getoption("dflash_sidecar") or os.environ.get(SIDECAR_ENV)
    return Path(value).expanduser().resolve() if value else None


@pytest.fixture
def dflash_record(request: pytest.FixtureRequest):
    """Attach measurements to this gate test: ``dflash_record(figure="...", key=value, ...)``.

    ``figure`` is the one-line figure shown in the verdict table; ``samples`` holds raw timing
    samples. Values must be JSON-serialisable (they travel through xdist and into the report).
    """
    binding = _binding(request.node)

    def record(**measurements: Any) -> None:
        if binding is None:
            raise RuntimeError(f"{request.node.nodeid} is not a gate test; mark it "
                               "@pytest.mark.gate(kind, family=...) to record measurements")
        binding["measurements"].update(measurements)

    return record


@pytest.fixture(scope="session")
def dflash_engine(pytestconfig: pytest.Config):
    """Factory: ``dflash_engine(selection)`` builds (once per selection) an engine via the hook."""
    cache: dict[tuple[tuple[str, str], ...], Any] = {}

    def build(selection: dict[str, str]) -> Any:
        key = tuple(sorted(selection.items()))
        if key not in cache:
            engine = pytestconfig.hook.pytest_dflash_engine(
                config=pytestconfig, selection=dict(selection), profile=profile_of(pytestconfig))
            if engine is None:
                raise RuntimeError("no pytest_dflash_engine implementation built an engine")
            cache[key] = engine
        return cache[key]

    return build


@pytest.hookimpl(trylast=True)
def pytest_dflash_engine(config: pytest.Config, selection: dict[str, str], profile: str) -> Any:
    from pytest_dflash.engines import reference

    return reference.build(selection, profile, device=device_info(config)["type"])


# ---------------------------------------------------------------- device, profile, header

def device_info(config: pytest.Config) -> dict[str, Any]:
    state = state_of(config)
    if state.device_info is None:
        import torch

        wanted = _option(config, "device") or "auto"
        if wanted not in ("auto", "cpu", "cuda"):
            raise pytest.UsageError(f"dflash_device = {wanted!r}; use auto, cpu or cuda")
        has_cuda = torch.cuda.is_available()
        if wanted == "cuda" and not has_cuda:
            raise pytest.UsageError("--dflash-device cuda, but torch sees no CUDA device; "
                                    "use --dflash-device cpu or auto")
        kind = "cuda" if wanted == "cuda" or (wanted == "auto" and has_cuda) else "cpu"
        info: dict[str, Any] = {"type": kind, "torch": torch.__version__,
                                "cuda": torch.version.cuda, "capability": None}
        if kind == "cuda":
            major, minor = torch.cuda.get_device_capability()
            info.update(name=torch.cuda.get_device_name(), capability=f"{major}.{minor}")
        else:
            info["name"] = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        state.device_info = info
    return state.device_info


def profile_of(config: pytest.Config) -> str:
    state = state_of(config)
    if state.profile is None:
        profile = _option(config, "profile")
        if not profile:
            profile = "full" if device_info(config)["type"] == "cuda" else "ci"
        if profile not in PROFILES:
            raise pytest.UsageError(f"dflash_profile = {profile!r}; use {', '.join(PROFILES)}")
        state.profile = profile
    return state.profile


def _fingerprint(config: pytest.Config) -> dict[str, Any]:
    from pytest_dflash import fingerprint

    sidecar = config.getoption("dflash_sidecar") or os.environ.get(SIDECAR_ENV)
    data = fingerprint.collect(config.rootpath, Path(sidecar) if sidecar else None)
    info = device_info(config)
    data.update(torch=info["torch"], cuda=info["cuda"], device=info["name"])
    data["libraries"] = _loaded_libraries()
    return data


def _loaded_libraries() -> list[dict[str, Any]]:
    import sys

    loader = sys.modules.get("pytest_dflash.loader")
    if loader is None or not hasattr(loader, "loaded_libraries"):
        return []
    return list(loader.loaded_libraries())


def pytest_report_header(config: pytest.Config) -> list[str]:
    from pytest_dflash import fingerprint

    info = device_info(config)
    capability = info["capability"] or "n/a"
    fp = _fingerprint(config)
    return [f"dflash: device {info['name']} (capability {capability}), torch {info['torch']}, "
            f"CUDA {info['cuda'] or 'none'}, profile {profile_of(config)}, "
            f"fingerprint {fingerprint.short(fp)}"]


# ---------------------------------------------------------------- evidence and verdicts

class EvidenceCollector:
    """Session-level half of the plugin: gathers test outcomes, writes the report, prints verdicts.

    Registered only in the controlling process: under xdist the workers' reports arrive here
    through ``pytest_runtest_logreport`` with their measurements in ``user_properties``.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.state = state_of(config)
        self.tests: dict[str, dict[str, Any]] = {}
        self.report: dict[str, Any] | None = None
        self.report_path = _report_path(config)
        self.problems: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        binding = _binding(report)
        if binding is None:
            return
        test = self.tests.setdefault(report.nodeid, {
            "nodeid": report.nodeid, "outcome": "passed", "duration_s": 0.0, "message": "",
            "measurements": {}})
        test["route"], test["kind"] = binding["route"], binding["kind"]
        test["duration_s"] = round(test["duration_s"] + report.duration, 6)
        test["measurements"].update(binding["measurements"])
        if report.skipped and test["outcome"] == "passed":
            test["outcome"] = "skipped"
            if isinstance(report.longrepr, tuple):
                test["message"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            test["outcome"] = "failed" if report.when == "call" else "error"
            test["message"] = _first_line(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        config = self.config
        involved = (self.tests or self.state.selected_gates or self.state.selected_routes
                    or _option(config, "strict")
                    or any(item.get_closest_marker("gate") for item in session.items))
        if not involved:
            return  # an unrelated test run: no report, no torch import
        evidence = reports.new_report(
            routes=self.state.candidates(), fingerprint=_fingerprint(config),
            device=device_info(config), profile=profile_of(config),
            policy=_policy_echo(self.state.policy))
        for test in self.tests.values():
            entry = {k: v for k, v in test.items() if k not in ("route", "kind")}
            reports.add_test(evidence, test["route"], test["kind"], entry)
        evidence["session"] = {
            "exitstatus": int(exitstatus),
            "interrupted": int(exitstatus) == int(pytest.ExitCode.INTERRUPTED),
            "strict": bool(_option(config, "strict")),
        }
        if _option(config, "merge") and self.report_path.exists():
            try:
                evidence = reports.merge(reports.load(self.report_path), evidence)
            except reports.ReportError as exc:
                self.problems.append(f"{exc} (report {self.report_path} left unchanged)")
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
                return
        reports.write_atomic(evidence, self.report_path)
        self.report = evidence
        if _option(config, "strict"):
            pending = [r.name for r in self.state.candidates()
                       if evidence["routes"].get(r.name, {}).get("verdict") == "pending"]
            if pending:
                self.problems.append("strict mode: selected candidates left pending: "
                                     + ", ".join(pending))
                if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after other plugins' tables: the run ends with verdicts
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.report is None and not self.problems:
            return
        tr = terminalreporter
        tr.write_sep("=", f"dflash verdicts (profile {self.state.profile or '?'})")
        if self.report is not None:
            for line in render(self.report):
                tr.write_line(line)
            tr.write_line(f"report: {self.report_path}")
        for problem in self.problems:
            tr.write_line(f"dflash: {problem}", red=True, bold=True)


def _policy_echo(policy: Policy) -> dict[str, Any]:
    """The thresholds as printed in the report: the policy plus the fixed output contract."""
    from pytest_dflash.quality import CONTRACT

    return {**policy.as_dict(), "output_contract": CONTRACT.as_dict()}


def _first_line(report: pytest.TestReport, limit: int = 400) -> str:
    """The assertion message on one line (gate messages often put details on later lines)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    joined = " | ".join(lines) or "failed"
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def _report_path(config: pytest.Config) -> Path:
    value = config.getoption("dflash_report") or config.getini("dflash_report") or DEFAULT_REPORT
    path = Path(value)
    return path if path.is_absolute() else config.rootpath / path
