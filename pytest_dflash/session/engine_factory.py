"""The engine factory of a pytest session (docs/engines.md).

The engine options (``--dflash-engine``, ``--dflash-serve``, ``--dflash-engine-url``,
``--dflash-serve-timeout``, ``--dflash-data``) are checked by :mod:`pytest_dflash.settings` when
the session starts; the session's :class:`~pytest_dflash.engines.factory.EngineFactory` is built
here on first use from the session's route registry, and closed when the session ends, so no
server outlives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

FACTORY = pytest.StashKey[Any]()


def factory_of(config: pytest.Config) -> Any:
    """The session's engine factory, built on first use from the session's registry."""
    factory = config.stash.get(FACTORY, None)
    if factory is None:
        from pytest_dflash import settings
        from pytest_dflash.engines.factory import EngineFactory
        from pytest_dflash.session.environment import device_info, profile_of
        from pytest_dflash.session.state import state_of
        from pytest_dflash.xdist import gpus

        asked = settings.of(config)
        factory = EngineFactory(
            state_of(config).registry, profile_of(config), device_info(config)["type"],
            serve=asked.serve, urls=asked.engine_urls, startup_timeout_s=asked.serve_timeout_s,
            hf_model=asked.hf_model, hf_dtype=asked.hf_dtype,
            base_env=gpus.server_env() if asked.serve else None,
            log_dir=Path(config.rootpath) / ".dflash" / "server-logs" if asked.serve else None)
        config.stash[FACTORY] = factory
    return factory


def close(config: pytest.Config) -> None:
    """Close every engine and stop every server of the session (idempotent)."""
    factory = config.stash.get(FACTORY, None)
    if factory is not None:
        factory.close()
