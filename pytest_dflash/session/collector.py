"""The evidence collector: the test reports of a run folded into its report, and the verdicts.

``EvidenceCollector`` runs in the controlling process only: under xdist the workers' test
reports reach it through ``pytest_runtest_logreport`` with their measurements in
``user_properties``. It assembles the report (docs/report.md), writes it atomically (also when
the run is interrupted) and prints the verdict table last.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.evidence import catch, junit
from pytest_dflash.evidence import report as reports
from pytest_dflash.evidence.table import render
from pytest_dflash.evidence.verdict import (
    ERROR,
    FAILED,
    INCONCLUSIVE,
    INTERRUPTED,
    INTERRUPTED_MESSAGE,
    PASSED,
)
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes import origin
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS
from pytest_dflash.session import saved_runs, settled
from pytest_dflash.session.environment import (
    device_info,
    fingerprint_of,
    profile_of,
    resolved_profile,
)
from pytest_dflash.session.shard import empty_note
from pytest_dflash.session.state import PROPERTY, binding, state_of
from pytest_dflash.xdist import gpus


def register(config: pytest.Config) -> None:
    """Register the collector in the controlling process (an xdist worker sends its reports
    there instead)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(EvidenceCollector(config), "dflash-evidence")


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
            raised = bound.get("raised")
            if expected:
                test["outcome"], test["message"] = ERROR, _first_line(report)
            elif raised is not None and raised["origin"] == origin.HARNESS:
                # the harness raised: an error, unless a failure was already proven
                if test["outcome"] != FAILED:
                    test["outcome"], test["message"] = ERROR, raised_message(raised)
                    test["raised"] = raised
            elif raised is not None:  # the candidate's own code raised: it failed the gate
                test["outcome"], test["message"] = FAILED, raised_message(raised)
                test["raised"] = raised
            else:
                test["outcome"] = FAILED if report.when == "call" else ERROR
                test["message"] = _first_line(report)
        elif report.when == "call" and test["outcome"] == INTERRUPTED:
            test["outcome"], test["message"] = PASSED, ""
        if test["outcome"] == FAILED:  # the gate is decided: its later tests are skipped
            settled.record_failure(self.config, test["route"], test["kind"], report.nodeid)
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
            errors = [f"{name} {kind}" for name, entry in reports.judged(evidence["routes"]).items()
                      for kind, gate in entry["gates"].items() if gate["status"] == ERROR]
            if errors:
                self.problems.append("strict mode: the harness raised (ERROR, not a verdict) in "
                                     + ", ".join(errors))
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


def raised_message(raised: dict[str, Any]) -> str:
    """One line for a test's message: whose code raised what, and where."""
    what = f"{raised['exception']}: {raised.get('message', '')}".rstrip(": ")
    if raised["origin"] == origin.CANDIDATE:
        return f"the candidate raised {what} (at {raised['where']})"
    return f"{what} (raised at {raised['where']}: the harness, not the candidate)"


def _first_line(report: pytest.TestReport, limit: int = 400) -> str:
    """The assertion message on one line (gate messages often put details on later lines)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    joined = " | ".join(lines) or "failed"
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."
