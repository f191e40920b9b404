"""Session state and evidence: what the plugin knows about a run, and the report it writes.

``DflashState`` (one per config, stashed) holds the registry, the policy and the selection made
by ``--dflash-route`` / ``--dflash-gate``. ``EvidenceCollector`` runs in the controlling process
only: under xdist the workers' test reports reach it through ``pytest_runtest_logreport`` with
their measurements in ``user_properties``. It assembles the report (docs/report.md), writes it
atomically (also when the run is interrupted) and prints the verdict table last.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.evidence import catch, junit
from pytest_dflash.evidence import report as reports
from pytest_dflash.evidence.table import render
from pytest_dflash.evidence.verdict import INCONCLUSIVE, INTERRUPTED, INTERRUPTED_MESSAGE, PASSED
from pytest_dflash.measure import workers
from pytest_dflash.routes import shipped
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS, UnknownNameError, check_kind
from pytest_dflash.session import saved_runs
from pytest_dflash.session.environment import (
    device_info,
    fingerprint_of,
    profile_of,
    resolved_profile,
    torch_device,
)
from pytest_dflash.session.policy import Policy, PolicyError, load_policy
from pytest_dflash.session.shard import empty_note
from pytest_dflash.xdist import gpus

STATE = pytest.StashKey["DflashState"]()
PROPERTY = "dflash"  # user_properties key: travels with reports through xdist


class DflashState:
    """Everything the plugin knows about this session, stashed on the config."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.registry = RouteRegistry()
        self.policy = Policy()
        self.selected_routes: set[str] = set()
        self.selected_gates: set[tuple[str, str]] = set()
        self.timing_pool: workers.TimingPool | None = None
        self.planted: dict[str, dict[str, Any]] = {}  # route -> its report field ``planted``
        self.shard: dict[str, Any] | None = None  # --dflash-shard: the report field ``shard``

    def candidates(self) -> list[Route]:
        """The candidates this run gates: all registered, narrowed by the selection options."""
        routes = self.registry.candidates()
        if self.selected_routes:
            routes = [r for r in routes if r.name in self.selected_routes]
        if self.selected_gates:
            names = {route for route, _ in self.selected_gates}
            routes = [r for r in routes if r.name in names]
        return routes


def state_of(config: pytest.Config) -> DflashState:
    return config.stash[STATE]


def start(config: pytest.Config) -> DflashState:
    """Set the session up: routes from every plugin, policy, selection, sidecar, collector.

    Every mistake here (unknown route or kind, bad override, missing sidecar, CUDA asked for
    without one) is a ``pytest.UsageError`` naming the fix, raised before any test runs.
    """
    asked = settings.of(config)
    state = DflashState(config)
    config.stash[STATE] = state
    if not config.pluginmanager.is_registered(shipped):
        config.pluginmanager.register(shipped, "dflash-shipped-routes")
    if asked.engine == "hf":  # the transformers engine's own routes, only while it is selected
        from pytest_dflash.engines import transformers as hf_engine

        if not config.pluginmanager.is_registered(hf_engine):
            config.pluginmanager.register(hf_engine, "dflash-hf-routes")
    try:
        state.policy = load_policy(config.rootpath)
        config.hook.pytest_dflash_routes(registry=state.registry)
        route_plugins = list(config.hook.pytest_dflash_routes.get_hookimpls())
        state.registry.validate()
        _select(state, asked)
        selftest_originals = [r.name for r in state.candidates()]
        if asked.selftest:
            from pytest_dflash.selftest.session import start as start_selftest

            start_selftest(config, state)
    except (RegistryError, UnknownNameError, PolicyError) as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None
    settings.export_to_children(asked)
    if asked.device == "cuda":
        device_info(config)  # an explicit device is checked now, as a usage error
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(EvidenceCollector(config), "dflash-evidence")
    state.timing_pool = workers.TimingPool(
        lambda: _worker_spec(config, state, route_plugins,
                             selftest_originals if asked.selftest else None,
                             asked.selftest_calibrate),
        size=state.policy.timing_processes, timeout_s=state.policy.timing_worker_timeout_s)
    workers.install(state.timing_pool)
    return state


def _worker_spec(config: pytest.Config, state: DflashState, route_plugins: list[Any],
                 selftest: list[str] | None, calibrate: bool) -> workers.WorkerSpec:
    """The gate's environment as the timing workers rebuild it: its device, thread count,
    profile and policy, the plugins that registered routes, the self-test's originals."""
    import torch

    return workers.WorkerSpec(
        device=str(torch_device(config)), threads=torch.get_num_threads(),
        profile=profile_of(config), policy=state.policy.as_dict(),
        plugins=workers.plugin_references(route_plugins), selftest_candidates=selftest,
        selftest_calibrate=calibrate, hf_model=_hf_model(config))


def _hf_model(config: pytest.Config) -> str | None:
    model = settings.of(config).hf_model
    return None if model is None else str(model)


def stop(config: pytest.Config) -> None:
    """Stop the run's timing workers (also on an aborted run)."""
    state = config.stash.get(STATE, None)
    pool = getattr(state, "timing_pool", None)
    if pool is not None:
        pool.close()
        if workers.active() is pool:
            workers.install(None)


def _select(state: DflashState, asked: settings.Settings) -> None:
    for name in asked.routes:
        route = state.registry.get(name)
        if route.role != "candidate":
            raise UnknownNameError(f"--dflash-route {name}: only candidate routes are gated "
                                   f"({name} is the {route.role})")
        state.selected_routes.add(name)
    for spec in asked.gates:
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


def bind(item: pytest.Item, route: Route, kind: str) -> None:
    """Bind a gate test to its route and kind; the binding carries its measurements."""
    item.user_properties.append((PROPERTY, {"route": route.name, "kind": kind,
                                            "measurements": {}}))


def binding(item_or_report: Any) -> dict[str, Any] | None:
    """The route/kind/measurements binding of a gate test item or report, None for others."""
    for key, value in item_or_report.user_properties:
        if key == PROPERTY:
            return value
    return None


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
        self.report_path = settings.of(config).report
        self.problems: list[str] = []
        self.notes: list[str] = []  # said at the end, not problems (an empty shard)
        self.history: saved_runs.Comparison | None = None

    @pytest.hookimpl(tryfirst=True)  # before junitxml reads the flattened properties
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold each phase of a gate test into its entry: durations add up, a skip marks it
        skipped, a failure in setup/teardown is an error and in the call a failure. A test is
        ``interrupted`` until its call phase reports: a session stopped (Ctrl-C, a time limit)
        while the test ran leaves it so, and its gate pending, never passed."""
        bound = binding(report)
        if bound is None:
            return
        test = self.tests.setdefault(report.nodeid, {
            "nodeid": report.nodeid, "outcome": INTERRUPTED, "duration_s": 0.0,
            "message": INTERRUPTED_MESSAGE, "measurements": {}, "gpu": None})
        test["route"], test["kind"] = bound["route"], bound["kind"]
        test["duration_s"] = round(test["duration_s"] + report.duration, 6)
        test["measurements"].update(bound["measurements"])
        test["gpu"] = bound.get("gpu") or test["gpu"]
        if getattr(report, "wasxfail", None) is not None and report.skipped:
            # an expected failure is still a failed gate test (the self-test's planted defects
            # are expected to fail their gate); only its effect on the exit status differs
            test["outcome"] = "failed" if report.when == "call" else "error"
            test["message"] = _first_line(report)
        elif report.skipped and test["outcome"] in (INTERRUPTED, PASSED):
            # a timing gate that recorded an inconclusive decision skipped for that reason
            undecided = test["measurements"].get("decision") == INCONCLUSIVE
            test["outcome"], test["message"] = (INCONCLUSIVE if undecided else "skipped"), ""
            if isinstance(report.longrepr, tuple):
                test["message"] = str(report.longrepr[2]).removeprefix("Skipped: ")
                if undecided:  # pytest names the exception's class before its message
                    test["message"] = test["message"].split("TimingInconclusive: ", 1)[-1]
        elif report.failed:
            # an expected-failure test that failed anyway raised what its mark does not expect
            # (a planted route that broke the test instead of being judged): an error
            expected = "xfail" in report.keywords
            test["outcome"] = "failed" if report.when == "call" and not expected else "error"
            test["message"] = _first_line(report)
        elif report.when == "call" and test["outcome"] == INTERRUPTED:
            test["outcome"], test["message"] = PASSED, ""
        junit.flatten(report, PROPERTY, {**bound, "measurements": test["measurements"]})

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Assemble, merge (``--dflash-merge``) and write the report; apply strict mode."""
        config = self.config
        asked = settings.of(config)
        involved = (self.tests or self.state.selected_gates or self.state.selected_routes
                    or asked.strict or asked.shard
                    or any(item.get_closest_marker("gate") for item in session.items))
        if not involved:
            return  # an unrelated test run: no report, no torch import
        evidence = reports.new_report(
            routes=self.state.candidates(), fingerprint=fingerprint_of(config),
            device=device_info(config), profile=profile_of(config),
            policy=_policy_echo(self.state.policy), planted=self.state.planted)
        for test in self.tests.values():
            entry = {k: v for k, v in test.items() if k not in ("route", "kind")}
            reports.add_test(evidence, test["route"], test["kind"], entry)
        evidence["session"] = {
            "exitstatus": int(exitstatus),
            "interrupted": int(exitstatus) == int(pytest.ExitCode.INTERRUPTED),
            "strict": asked.strict,
            "allow_unjailed": asked.allow_unjailed,
        }
        if self.state.shard is not None:
            evidence["shard"] = self.state.shard
            if not self.state.shard["assigned"] and int(exitstatus) in (
                    pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                self.notes.append(empty_note(self.state.shard))
                session.exitstatus = pytest.ExitCode.OK
        if asked.merge and self.report_path.exists():
            try:
                evidence = reports.merge(reports.load(self.report_path), evidence)
            except reports.ReportError as exc:
                self.problems.append(f"{exc} (report {self.report_path} left unchanged)")
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
                return
        mixed = gpus.refuse_mixed_models(evidence["routes"], EXCLUSIVE_KINDS)
        if mixed:
            self.problems.extend(mixed)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if any("planted" in entry for entry in evidence["routes"].values()):
            evidence["selftest"] = catch.summarize(evidence)
        reports.write_atomic(evidence, self.report_path)
        self.report = evidence
        junit.add_verdicts(config, evidence)
        self.history = saved_runs.finish(config, evidence)
        self.problems.extend(self.history.problems)
        if asked.strict:
            for reason in catch.marks(evidence.get("selftest", {})).values():
                self.problems.append(f"strict mode: {reason}")
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            pending = [name for name, entry in reports.judged(evidence["routes"]).items()
                       if entry.get("verdict") == "pending"]
            if pending:
                self.problems.append("strict mode: selected candidates left pending: "
                                     + ", ".join(pending))
                if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after other plugins' tables: the run ends with verdicts
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The verdict table, the report path and any problem, as the last lines of the run."""
        if self.report is None and not self.problems and not self.notes:
            return
        tr = terminalreporter
        tr.write_sep("=", f"dflash verdicts (profile {resolved_profile(self.config) or '?'})")
        if self.report is not None:
            for line in render(self.report):
                tr.write_line(line)
            if "selftest" in self.report:
                tr.write_sep("-", "dflash self-test: planted defects caught per gate "
                                  "(docs/selftest.md)")
                for line in catch.render(self.report["selftest"]):
                    tr.write_line(line)
            tr.write_line(f"report: {self.report_path}")
        if self.history is not None:
            for line, markup in saved_runs.summary_lines(self.history, self.config.rootpath):
                tr.write_line(line, **markup)
        for note in self.notes:
            tr.write_line(f"dflash: {note}", bold=True)
        for problem in self.problems:
            tr.write_line(f"dflash: {problem}", red=True, bold=True)


def _policy_echo(policy: Policy) -> dict[str, Any]:
    """The thresholds as printed in the report: the policy plus the fixed output contract."""
    from pytest_dflash.metrics.quality import CONTRACT

    return {**policy.as_dict(), "output_contract": CONTRACT.as_dict()}


def _first_line(report: pytest.TestReport, limit: int = 400) -> str:
    """The assertion message on one line (gate messages often put details on later lines)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    joined = " | ".join(lines) or "failed"
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."
