"""The engines of one pytest session: built from the session's route registry, cached per
selection, closed when the session ends.

Engines are always built from the *session's* registry, so routes registered by an outside
plugin or conftest reach the model-level gates exactly like the shipped ones. Which engine is
built depends on the options: the in-process reference engine by default, the transformers
engine of a local Hugging Face model with ``--dflash-engine hf:PATH`` (``transformers``), a
server engine when ``--dflash-serve`` or ``--dflash-engine-url`` is given (``openai_server``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_dflash.engines import close as close_engine
from pytest_dflash.routes.registry import selection_key

if TYPE_CHECKING:
    from pytest_dflash.engines import Engine
    from pytest_dflash.routes.registry import RouteRegistry


class EngineFactory:
    """Builds and owns the session's engines (see the module docstring)."""

    def __init__(self, registry: RouteRegistry, profile: str, device: str, *,
                 serve: str | None = None, urls: Mapping[str, str] | None = None,
                 startup_timeout_s: float = 600.0, request_timeout_s: float = 600.0,
                 log_dir: Path | None = None,
                 hf_model: Path | None = None,
                 hf_dtype: str | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        if hf_model is not None and (serve or urls):
            raise ValueError("the transformers engine runs in process: give hf_model or a "
                             "server (serve / urls), not both")
        self.registry, self.profile, self.device = registry, profile, device
        self.hf_model, self.hf_dtype = hf_model, hf_dtype
        self.pool = None
        if serve or urls:
            from pytest_dflash.engines.openai_server import ServerPool

            self.pool = ServerPool(registry, command=serve or None, urls=urls or None,
                                   profile=profile, device=device,
                                   startup_timeout_s=startup_timeout_s,
                                   request_timeout_s=request_timeout_s, log_dir=log_dir,
                                   base_env=base_env)
        self.engines: list[Any] = []  # every engine to close with the session
        # the session's one engine cache: one engine per selection, whoever built it
        self._cache: dict[tuple[tuple[str, str], ...], Any] = {}
        self._own: list[Any] = []  # the engines of the cache that build() made here

    @property
    def kind(self) -> str:
        if self.hf_model is not None:
            return f"transformers ({self.hf_model})"
        if self.pool is None:
            return "reference"
        return "server (--dflash-serve)" if self.pool.command else "server (--dflash-engine-url)"

    def build(self, selection: Mapping[str, str]) -> Any:
        """The default engine for ``selection`` (family -> route; missing families: baselines)."""
        full = {**self.registry.engine_selection(), **dict(selection)}
        for family, name in selection.items():
            route = self.registry.get(name)  # unknown name: an error listing the known routes
            if route.family != family:
                raise ValueError(f"selection maps family {family!r} to route {name!r}, which "
                                 f"is of family {route.family!r}")
        engine: Any
        if self.pool is not None:
            engine = self.pool.engine(full)
        elif self.hf_model is not None:
            from pytest_dflash.engines import transformers

            engine = transformers.build(self.hf_model, full, self.profile, device=self.device,
                                        registry=self.registry, dtype=self.hf_dtype)
        else:
            from pytest_dflash.engines import reference

            engine = reference.build(full, self.profile, device=self.device,
                                     registry=self.registry)
        self.engines.append(engine)
        return engine

    def engine(self, selection: Mapping[str, str],
               build: Callable[[dict[str, str]], Any] | None = None) -> Any:
        """The engine of ``selection``, built once per selection and kept until :meth:`close`.

        ``build(selection)`` builds it when given (the ``pytest_dflash_engine`` hook, whose
        last answer is this factory's own engine), else :meth:`build`. The one engine cache of
        a session and of a timing worker: the ``dflash_engine`` fixture, the default hook
        implementation and a worker all ask it, so a selection never gets two engines.
        """
        key = selection_key(selection)
        if key not in self._cache:
            if build is None:
                engine = self.build(selection)
                self._own.append(engine)
            else:
                engine = build(dict(selection))
                if engine is None:
                    raise RuntimeError("no pytest_dflash_engine implementation built an engine "
                                       f"for {dict(selection)}")
            # the hook's last answer is this factory's own engine, cached here meanwhile
            self._cache.setdefault(key, self.adopt(engine))
        return self._cache[key]

    def rebuildable(self, engine: Engine) -> bool:
        """True for an engine this factory built in process (the reference or the transformers
        engine): a timing worker builds the very same one from the session's registry and
        options. A server, or an engine another plugin's hook built, lives here only."""
        return self.pool is None and any(e is engine for e in self._own)

    def adopt(self, engine: Engine) -> Engine:
        """Take an engine another hook implementation built, so it is closed with the rest."""
        if engine not in self.engines:
            self.engines.append(engine)
        return engine

    def servers(self) -> list[dict[str, Any]]:
        """Every server this session started (selection, switches, command, pid, exit status):
        the route proof of a served engine."""
        return list(self.pool.history) if self.pool is not None else []

    def close(self) -> None:
        """Close every engine and stop every server; safe to call twice."""
        errors = []
        for engine in self.engines:
            try:
                close_engine(engine)
            except Exception as exc:  # one engine's failure must not keep a server running
                errors.append(f"{engine!r}: {exc}")
        self.engines.clear()
        if self.pool is not None:
            self.pool.close()
        if errors:
            raise RuntimeError("closing engines failed: " + "; ".join(errors))
