"""The engine options of a pytest session and the factory they configure (docs/engines.md).

``--dflash-serve``, ``--dflash-engine-url``, ``--dflash-serve-timeout`` and ``--dflash-data``
are checked when the session starts (a bad value is a usage error naming the fix); the session's
:class:`~pytest_dflash.engines.factory.EngineFactory` is built on first use from the session's
route registry, and closed when the session ends, so no server outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SETTINGS = pytest.StashKey["EngineSettings"]()
FACTORY = pytest.StashKey[Any]()


@dataclass(frozen=True)
class EngineSettings:
    serve: str | None = None
    urls: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    data: Path | None = None


def add_options(group: Any, parser: pytest.Parser) -> None:
    group.addoption("--dflash-serve", default=None, metavar="CMD",
                    help="gate a server: the command that starts an OpenAI-compatible server "
                         "with {port} for its port, run once per route selection with that "
                         "selection's NAME=1 switches, e.g. 'vllm serve MODEL --port {port}'")
    group.addoption("--dflash-engine-url", action="append", default=[], metavar="KEY=URL",
                    help="gate servers you run: baseline=URL, candidate=URL or ROUTE=URL "
                         "(repeatable)")
    group.addoption("--dflash-serve-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long a started server may take to become healthy (default 600)")
    group.addoption("--dflash-data", default=None, metavar="DIR",
                    help="held-out data of the ppl/quality gates: DIR/ppl_segments.jsonl and/or "
                         "DIR/coding_tasks.jsonl in the shipped schema")
    parser.addini("dflash_serve", "default for --dflash-serve", default="")
    parser.addini("dflash_engine_url", "default for --dflash-engine-url (one KEY=URL a line)",
                  type="linelist", default=[])
    parser.addini("dflash_serve_timeout", "default for --dflash-serve-timeout", default="600")
    parser.addini("dflash_data", "default for --dflash-data", default="")


def configure(config: pytest.Config) -> EngineSettings:
    """Check the options now (usage errors), before any test or server runs."""
    from pytest_dflash.engines.data import DataError, check_data_dir
    from pytest_dflash.engines.openai_server import parse_engine_urls

    serve = config.getoption("dflash_serve") or config.getini("dflash_serve") or None
    url_specs = config.getoption("dflash_engine_url") or config.getini("dflash_engine_url")
    timeout = config.getoption("dflash_serve_timeout")
    if timeout is None:
        try:
            timeout = float(config.getini("dflash_serve_timeout"))
        except ValueError:
            raise pytest.UsageError("dflash_serve_timeout must be a number of seconds, got "
                                    f"{config.getini('dflash_serve_timeout')!r}") from None
    if timeout <= 0:
        raise pytest.UsageError(f"--dflash-serve-timeout {timeout:g}: must be > 0 seconds")
    try:
        urls = parse_engine_urls(list(url_specs))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if serve and urls:
        raise pytest.UsageError("--dflash-serve starts servers, --dflash-engine-url names "
                                "running ones: give one of them")
    if serve and "{port}" not in serve:
        raise pytest.UsageError(f"--dflash-serve {serve!r} must contain {{port}} where the "
                                "server's port goes, e.g. 'vllm serve MODEL --port {port}'")
    if serve and (getattr(config.option, "numprocesses", None) or 0):
        raise pytest.UsageError("--dflash-serve starts one server at a time on the device; it "
                                "cannot run under pytest -n: run without -n")
    data = config.getoption("dflash_data") or config.getini("dflash_data") or None
    if data:
        path = Path(data)
        if not path.is_absolute():
            path = Path(config.invocation_params.dir) / path
        try:
            data = check_data_dir(path)
        except DataError as exc:
            raise pytest.UsageError(str(exc)) from None
    settings = EngineSettings(serve=serve, urls=urls, startup_timeout_s=timeout,
                              data=data if data else None)
    config.stash[SETTINGS] = settings
    return settings


def settings_of(config: pytest.Config) -> EngineSettings:
    return config.stash.get(SETTINGS, None) or configure(config)


def factory_of(config: pytest.Config) -> Any:
    """The session's engine factory, built on first use from the session's registry."""
    factory = config.stash.get(FACTORY, None)
    if factory is None:
        from pytest_dflash.engines.factory import EngineFactory
        from pytest_dflash.environment import device_info, profile_of
        from pytest_dflash.session import state_of

        settings = settings_of(config)
        factory = EngineFactory(
            state_of(config).registry, profile_of(config), device_info(config)["type"],
            serve=settings.serve, urls=settings.urls,
            startup_timeout_s=settings.startup_timeout_s,
            log_dir=Path(config.rootpath) / ".dflash" / "server-logs" if settings.serve else None)
        config.stash[FACTORY] = factory
    return factory


def close(config: pytest.Config) -> None:
    """Close every engine and stop every server of the session (idempotent)."""
    factory = config.stash.get(FACTORY, None)
    if factory is not None:
        factory.close()
