"""The pytest plugin (entry point ``pytest11: dflash``): hooks that delegate, nothing else.

Each hook hands its work to the module that owns it (docs/architecture.md has the map):

- ``session.state``: session state and the route selection;
- ``session.collector``: evidence collection, the report and the verdict table;
- ``session.collection``: gate markers -> tests parametrized over routes and profile sizes;
- ``session.fixture``: ``dflash_gate`` and the narrower fixtures;
- ``session.environment``: device, profile, dtype and the evidence fingerprint.

Nothing heavy is imported at load time: torch is imported only when a fixture, the report header
or the report needs the device, so ``pytest --help`` and unrelated runs stay fast.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.measure import progress
from pytest_dflash.routes import hookspec
from pytest_dflash.routes.vocabulary import GATE_KINDS
from pytest_dflash.session import (
    collection,
    collector,
    engine_factory,
    environment,
    fixture,
    saved_runs,
    state,
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add the ``pytest_dflash_*`` hook specifications (``pytest_dflash.routes.hookspec``)."""
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ``--dflash-*`` options and their ini keys (``pytest_dflash.settings``)."""
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers, register the fixtures, set the session up (``state.start``) and
    the evidence collector (``collector.register``)."""
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
    if not config.pluginmanager.is_registered(fixture):
        config.pluginmanager.register(fixture, "dflash-fixtures")
    state.start(config)
    collector.register(config)
    saved_runs.check_options(config)
    progress.install_for(config, settings.of(config).progress_log)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize gate tests over their routes and profile sizes."""
    collection.generate_tests(metafunc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bind gate tests to route and kind; keep only what ``--dflash-gate`` selects."""
    collection.modify_items(config, items)


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dflash-shard K/N``: keep this shard's share, after every other selection (``-m``,
    ``-k``, ``--dflash-gate``) has been made; an xdist worker hands the plan to the controller.

    A second implementation of ``pytest_collection_modifyitems`` (``specname``), run last: the
    one above must run first, since ``-m KIND`` selects by the markers it adds."""
    record = collection.select_shard(config, items)
    if record is not None:
        state.state_of(config).shard = record
        if hasattr(config, "workeroutput"):
            config.workeroutput["dflash_shard"] = record


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: the shard plan, as a worker computed it, for the report."""
    record = getattr(node, "workeroutput", {}).get("dflash_shard")
    held = state.state_of(node.config)
    if record is not None and held.shard is None:
        held.shard = record


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Refuse timing gates under xdist, skip SM70-only tests elsewhere (gate stays pending)."""
    collection.check_setup(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Record whose code a gate test's exception came from (``state.record_raised``) before
    its report is made, so the record travels with it (also through xdist)."""
    state.record_raised(item, call)
    yield


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One ``dflash:`` header line: device, torch/CUDA, profile, evidence fingerprint."""
    return environment.header_lines(config)


@pytest.hookimpl(trylast=True)
def pytest_dflash_engine(config: pytest.Config, selection: dict[str, str], profile: str) -> Any:
    """The default engine, asked last, built from the session's route registry: the reference
    engine on the gate device, the transformers engine under --dflash-engine hf:PATH, or a
    server engine under --dflash-serve / --dflash-engine-url."""
    return engine_factory.factory_of(config).engine(selection)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close every engine and stop every server once the report is written."""
    engine_factory.close(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Also on an aborted session: no server or timing worker outlives it."""
    engine_factory.close(config)
    state.stop(config)
