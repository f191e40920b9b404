"""The engine options of a pytest session and the factory they configure (docs/engines.md).

``--dflash-engine``, ``--dflash-serve``, ``--dflash-engine-url``, ``--dflash-serve-timeout`` and
``--dflash-data`` are checked when the session starts (a bad value is a usage error naming the
fix); the session's :class:`~pytest_dflash.engines.factory.EngineFactory` is built on first use
from the session's route registry, and closed when the session ends, so no server outlives it.
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
    engine: str = "reference"  # "reference" or "hf" (hf_model is then its model directory)
    hf_model: Path | None = None
    serve: str | None = None
    urls: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    data: Path | None = None


def add_options(group: Any, parser: pytest.Parser) -> None:
    group.addoption("--dflash-engine", default=None, metavar="ENGINE",
                    help="the in-process engine of the model-level gates: 'reference' (the "
                         "default), 'hf:PATH' for a local Hugging Face causal LM, or 'hf' for "
                         "the tiny one shipped (extra [hf]; docs/engines.md)")
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
    parser.addini("dflash_engine", "default for --dflash-engine", default="")
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
    engine, hf_model = parse_engine(config)
    if hf_model is not None and (serve or urls):
        raise pytest.UsageError("--dflash-engine hf runs the model in process; --dflash-serve "
                                "and --dflash-engine-url gate servers: give one of them")
    settings = EngineSettings(engine=engine, hf_model=hf_model, serve=serve, urls=urls,
                              startup_timeout_s=timeout, data=data if data else None)
    config.stash[SETTINGS] = settings
    return settings


def engine_spec(config: pytest.Config) -> str:
    """The ``--dflash-engine`` value (else ini ``dflash_engine``), stripped; "" if neither."""
    return str(config.getoption("dflash_engine", default=None)
               or config.getini("dflash_engine") or "").strip()


def parse_engine(config: pytest.Config) -> tuple[str, Path | None]:
    """("reference", None) or ("hf", model directory); a bad value is a usage error naming
    the fix (unknown engine, a missing directory, transformers not installed)."""
    spec = engine_spec(config)
    if spec in ("", "reference"):
        return "reference", None
    kind, _, path = spec.partition(":")
    if kind != "hf":
        raise pytest.UsageError(f"--dflash-engine {spec!r}: unknown engine; give 'reference', "
                                "'hf' (the shipped tiny model) or 'hf:PATH' (a local Hugging "
                                "Face causal LM directory)")
    from pytest_dflash.engines import transformers as hf

    reason = hf.missing_library()
    if reason:
        raise pytest.UsageError(f"--dflash-engine {spec}: {reason}")
    if not path:
        model = hf.default_model_dir()
    else:
        model = Path(path)
        if not model.is_absolute():
            model = Path(config.invocation_params.dir) / model
    try:
        return "hf", hf.check_model_dir(model)
    except hf.EngineError as exc:
        raise pytest.UsageError(str(exc)) from None


def register_engine_routes(config: pytest.Config) -> None:
    """Before the routes are collected: the transformers engine's own routes
    (``pytest_dflash.engines.transformers.ROUTES``) join the registry while it is selected."""
    kind = engine_spec(config).partition(":")[0]
    if kind == "hf":
        from pytest_dflash.engines import transformers as hf

        if not config.pluginmanager.is_registered(hf):
            config.pluginmanager.register(hf, "dflash-hf-routes")


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
            serve=settings.serve, urls=settings.urls, hf_model=settings.hf_model,
            startup_timeout_s=settings.startup_timeout_s,
            log_dir=Path(config.rootpath) / ".dflash" / "server-logs" if settings.serve else None)
        config.stash[FACTORY] = factory
    return factory


def close(config: pytest.Config) -> None:
    """Close every engine and stop every server of the session (idempotent)."""
    factory = config.stash.get(FACTORY, None)
    if factory is not None:
        factory.close()
