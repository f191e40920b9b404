"""The gate context: everything a gate test needs, behind the one ``dflash_gate`` fixture.

A gate test receives a :class:`GateContext` for the candidate it measures, the way a
pytest-benchmark test receives ``benchmark``::

    @pytest.mark.gate("parity", family="attn.d256")
    def test_my_parity(dflash_gate):
        impl, oracle = dflash_gate.impl, dflash_gate.oracle       # family contract objects
        x = make_input(seed=dflash_gate.seed("my case"), device=dflash_gate.device)
        ...
        dflash_gate.record(figure="rel L2 1e-7", rel_l2=1e-7)

Routes are resolved through the family declaration (``pytest_dflash.routes.families``), so a generic
gate never names a route: ``.baseline`` is the candidate's baseline, ``.oracle`` the family's
oracle, ``.verify_route`` the route that serves verification when the candidate is disabled.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_dflash.measure.timing_pool import TimingSetup
from pytest_dflash.policy.profiles import ProfileSizes, sizes
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.families import Family, contract_calls
from pytest_dflash.routes.origin import CandidateCode, candidate_code
from pytest_dflash.routes.registry import Route, RouteRegistry

if TYPE_CHECKING:
    import torch


def gate_dtype(device: torch.device) -> torch.dtype:
    """The dtype timed gates run in: fp16 on the GPU (what ships on SM70, which has no bf16),
    fp32 on the CPU (its native GEMM dtype; CPU fp16 kernels are emulated and would time the
    emulation)."""
    import torch

    return torch.float16 if device.type == "cuda" else torch.float32


def case_seed(policy: Policy, *parts: object) -> int:
    """A seed fixed by the policy seed and the case name, so every case has its own inputs and
    every run (and every rerun of one node id) sees the same ones."""
    return (policy.seed + zlib.crc32("/".join(map(str, parts)).encode())) % 2**31


class GateContext:
    """One candidate route under one gate kind, with the session's policy, profile and device."""

    def __init__(self, *, route: Route, kind: str, registry: RouteRegistry, policy: Policy,
                 profile: str, device: torch.device, record: Callable[..., None],
                 engine: Callable[[dict[str, str]], Any], data_dir: Path | None = None,
                 servers: Callable[[], list[dict[str, Any]]] | None = None,
                 rebuildable: Callable[[Any], bool] | None = None,
                 timing: TimingSetup | None = None,
                 upcoming: Callable[[], list[tuple[Route, dict[str, Any]]]] | None = None,
                 ) -> None:
        self.route = route
        self.kind = kind
        self.registry = registry
        self.policy = policy
        self.profile = profile
        self.device = device
        self._record = record
        self._engine = engine
        self.data_dir = data_dir  # --dflash-data, or None for the shipped held-out data
        self._servers = servers
        self._rebuildable = rebuildable
        self._upcoming = upcoming  # later tests of this test function: (route, parameters)
        # what counts as the candidate's own code when a test raises (routes.origin)
        self.candidate_code = CandidateCode()
        # the session's timing pool and progress sinks, for speed_gate(..., timing=...)
        self.timing = timing if timing is not None else TimingSetup()

    def __repr__(self) -> str:
        return f"<GateContext {self.kind} {self.route.name} profile={self.profile} " \
               f"device={self.device}>"

    # ------------------------------------------------------------ session
    @property
    def sizes(self) -> ProfileSizes:
        """The profile's sizes (``pytest_dflash.policy.profiles``)."""
        return sizes(self.profile)

    @property
    def dtype(self) -> torch.dtype:
        """The timed gates' dtype on this device (:func:`gate_dtype`)."""
        return gate_dtype(self.device)

    def seed(self, *parts: object) -> int:
        """The seed of the case named by ``parts`` (see :func:`case_seed`)."""
        return case_seed(self.policy, *parts)

    def record(self, **measurements: Any) -> None:
        """Attach measurements to this test's report entry; ``figure=`` is the one-line figure
        of the verdict table. Values must be JSON-serialisable."""
        self._record(**measurements)

    # ------------------------------------------------------------ routes of the family
    @cached_property
    def family(self) -> Family:
        """The family declaration (derived from the roles if the family declared none)."""
        return self.registry.family_of(self.route.family)

    @cached_property
    def impl(self) -> Any:
        """The candidate's implementation, checked against the family contract.

        What its import raises is the candidate's failure; the contract check is the gate's
        own (a route without the contract's calls is an error, never a reject)."""
        with candidate_code():
            impl = self.route.implementation()
        calls = contract_calls(self.family.contract) if self.family.contract else ()
        self.candidate_code.add(impl, calls)
        return self.family.check(impl, self.route.name)

    @cached_property
    def baseline_route(self) -> Route:
        return self.registry.get(self.route.baseline or self.family.baseline)

    @cached_property
    def baseline(self) -> Any:
        """The implementation of the candidate's baseline (what runs while it is off)."""
        return self.family.check(self.baseline_route.implementation(), self.baseline_route.name)

    @cached_property
    def oracle_route(self) -> Route:
        return self.registry.role(self.route.family, "oracle")

    @cached_property
    def oracle(self) -> Any:
        """The implementation of the family's oracle (high-precision reference)."""
        return self.family.check(self.oracle_route.implementation(), self.oracle_route.name)

    @cached_property
    def verify_route(self) -> Route:
        """The route that serves speculative verification when the candidate is disabled: the
        candidate's own ``Route.verify_route`` if it names one, else the family's."""
        name = self.route.verify_route or self.family.verify_route
        if name is None:
            raise LookupError(f"family {self.route.family!r} declares no verify_route; declare "
                              "it with registry.declare(Family(..., verify_route=NAME)) to run "
                              f"{self.kind} gates on its candidates")
        return self.registry.get(name)

    def implementation(self, name: str) -> Any:
        """The implementation of any registered route (route-specific gates: type-A partners)."""
        return self.registry.get(name).implementation()

    # ------------------------------------------------------------ engines (model-level gates)
    def engine(self, *route_names: str) -> Any:
        """An engine running every family's baseline except the named routes (built once per
        selection and session, through the ``pytest_dflash_engine`` hook).

        An engine whose selection enables the candidate is the candidate's code: what its build
        raises, and what its methods raise later in the test, rejects the candidate."""
        selection = self.registry.engine_selection(route_names)
        if self.route.name not in route_names:
            return self._engine(selection)
        with candidate_code():
            engine = self._engine(selection)
        return self.candidate_code.add(engine)

    def engines(self) -> tuple[Any, Any]:
        """(baseline engine, candidate engine): the pair every model-level gate compares."""
        return self.engine(self.baseline_route.name), self.engine(self.route.name)

    def require(self, *capabilities: str, engines: tuple[Any, ...] | None = None) -> tuple[
            Any, ...]:
        """The engines (default: :meth:`engines`) if each offers every named capability
        (``pytest_dflash.engines.CAPABILITIES``); otherwise the test is skipped with the reason,
        which leaves the gate pending: an engine that cannot measure something neither fails
        nor passes a gate."""
        import pytest

        from pytest_dflash.engines import missing

        engines = self.engines() if engines is None else engines
        reason = missing(engines, capabilities)
        if reason:
            pytest.skip(f"{self.kind} gate needs {', '.join(capabilities)}: {reason}")
        return engines

    def engine_job(self, builder: str, engines: tuple[Any, ...], **kwargs: Any) -> Any:
        """A :class:`~pytest_dflash.measure.timing_pool.TimingJob` of ``builder`` when a timing
        worker can rebuild every one of ``engines`` (the session's in-process reference or
        transformers engine), else None: a server or an engine another plugin built is timed
        in this process, and the report says so (``unit: round (one process)``)."""
        from pytest_dflash.measure.timing_pool import TimingJob

        if self._rebuildable is None or not all(self._rebuildable(e) for e in engines):
            return None
        return TimingJob(builder, kwargs)

    def peers(self, **params: Any) -> list[Route]:
        """The routes this gate may time its first look with (``timing.SharedLook``): those
        whose test of this gate, with the same ``params`` (e.g. ``size=1024``), is still to run
        in this session, whose gate has not failed and whose baseline runs what this route's
        baseline runs (the same engine selection). Empty outside a session and under xdist."""
        if self._upcoming is None:
            return []
        own = self.registry.engine_selection((self.baseline_route.name,))
        found = []
        for route, values in self._upcoming():
            if route.name == self.route.name or any(
                    values.get(key) != value for key, value in params.items()):
                continue
            baseline = route.baseline or self.registry.family_of(route.family).baseline
            if self.registry.engine_selection((baseline,)) == own:
                found.append(route)
        return found

    def record_engines(self, *engines: Any) -> None:
        """Record what the engines were: their kind and capabilities, each one's route proof
        (a server's switches and own counters) and every server the session started."""
        import copy

        from pytest_dflash.engines import capabilities_of

        entries = []
        for engine in engines:
            entry: dict[str, Any] = {"engine": type(engine).__name__,
                                     "selection": dict(getattr(engine, "selection", {})),
                                     "capabilities": capabilities_of(engine).as_dict()}
            proof = getattr(engine, "route_proof", None)
            if callable(proof):
                entry["route_proof"] = proof()
            entries.append(entry)
        self.record(engines=entries)
        servers = self._servers() if self._servers is not None else []
        if servers:
            self.record(servers=copy.deepcopy(servers))
