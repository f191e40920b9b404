"""The pytest plugin (entry point ``pytest11: dflash``): hooks that delegate, nothing else.

Each hook hands its work to the module that owns it (docs/architecture.md has the map):

- ``session``: session state, the route selection, evidence collection and the report;
- ``collection``: gate markers -> tests parametrized over routes and profile sizes;
- ``fixtures``: ``dflash_gate`` and the narrower fixtures;
- ``environment``: device, profile, dtype and the evidence fingerprint.

Nothing heavy is imported at load time: torch is imported only when a fixture, the report header
or the report needs the device, so ``pytest --help`` and unrelated runs stay fast.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dflash import (
    collection,
    engine_setup,
    environment,
    fixtures,
    hookspec,
    progress,
    reporting,
    session,
)
from pytest_dflash.loader import SIDECAR_ENV
from pytest_dflash.session import DEFAULT_REPORT
from pytest_dflash.vocabulary import GATE_KINDS, PROFILES


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add the ``pytest_dflash_*`` hook specifications (``pytest_dflash.hookspec``)."""
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ``--dflash-*`` options and their ini keys (README "Running the gates")."""
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
    group.addoption("--dflash-progress-log", default=None, metavar="DIR",
                    help="also append the progress of long timing gates to DIR/<process>.log "
                         "(main, or the xdist worker id such as gw0), under -q and in workers "
                         "too; DIR is created if missing")
    group.addoption("--dflash-merge", action="store_true", default=None,
                    help="merge this run's results into the existing report (same evidence only)")
    group.addoption("--dflash-strict", action="store_true", default=None,
                    help="fail the run if a selected candidate is left pending, or a gate's "
                         "self-test missed a planted defect (CI gate jobs)")
    group.addoption("--dflash-selftest", action="store_true", default=None,
                    help="plant the catalogue's defects next to every selected candidate and "
                         "prove each gate catches them here (docs/selftest.md)")
    group.addoption("--dflash-allow-unjailed", action="store_true", default=False,
                    help="score generated code even where no file-system jail can be built "
                         "(the host's files readable to it); recorded in the report "
                         "(docs/security.md)")
    reporting.add_options(group)
    parser.addini("dflash_device", "default for --dflash-device", default="auto")
    parser.addini("dflash_profile", "default for --dflash-profile", default="")
    parser.addini("dflash_report", "default for --dflash-report", default=DEFAULT_REPORT)
    parser.addini("dflash_strict", "default for --dflash-strict", type="bool", default=False)
    parser.addini("dflash_merge", "default for --dflash-merge", type="bool", default=False)
    parser.addini("dflash_selftest", "default for --dflash-selftest", type="bool", default=False)
    engine_setup.add_options(group, parser)


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers, register the fixtures, set the session up (``session.start``)."""
    config.addinivalue_line("markers", "sm70: the SM70 gate suite")
    config.addinivalue_line(
        "markers", "gate(kind, family=None, route=None, per_size=None): a gate test of the given "
        "kind, parametrized over the candidates of a family (or one route) via `dflash_gate`; "
        "per_size names a profile size the `size` argument runs over")
    config.addinivalue_line(
        "markers", "requires_sm70: needs exact compute capability 7.0; elsewhere skipped and "
        "its gate stays pending")
    for kind in GATE_KINDS:
        config.addinivalue_line("markers", f"{kind}: gate tests of kind {kind}")
    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "dflash-fixtures")
    engine_setup.register_engine_routes(config)
    session.start(config)
    reporting.check_options(config)
    progress.install_for(config)
    engine_setup.configure(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize gate tests over their routes and profile sizes."""
    collection.generate_tests(metafunc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bind gate tests to route and kind; keep only what ``--dflash-gate`` selects."""
    collection.modify_items(config, items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Refuse timing gates under xdist, skip SM70-only tests elsewhere (gate stays pending)."""
    collection.check_setup(item)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One ``dflash:`` header line: device, torch/CUDA, profile, evidence fingerprint."""
    return environment.header_lines(config)


@pytest.hookimpl(trylast=True)
def pytest_dflash_engine(config: pytest.Config, selection: dict[str, str], profile: str) -> Any:
    """The default engine, asked last, built from the session's route registry: the reference
    engine on the gate device, the transformers engine under --dflash-engine hf:PATH, or a
    server engine under --dflash-serve / --dflash-engine-url."""
    return engine_setup.factory_of(config).build(selection)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close every engine and stop every server once the report is written."""
    engine_setup.close(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Also on an aborted session: no server outlives it."""
    engine_setup.close(config)
