"""The timing worker process, the child (``python -m pytest_dflash.measure.timing_child``); its
parent's side is ``timing_pool.py``.

It rebuilds the gate's environment from the parent's :class:`~timing_pool.WorkerSpec` (device,
threads, policy, profile, the routes of the same plugins, the worker plugins the session named,
such as the self-test's, which plant their routes and wrap their engines through the same
``pytest_dflash_routes`` and ``pytest_dflash_engine`` hooks as in the session), then answers
jobs: build the pair with the suite's builder, warm it up, time interleaved rounds in a
balanced order (as many candidate-first as baseline-first rounds, shuffled by the seed) for the
job's time budget, and send back the raw durations, the route hits of the timed calls and the
pair's facts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pluggy

from pytest_dflash.measure.timing_pool import (
    ALLOCATOR_ENV,
    BASELINE_ARM,
    PROTOCOL_FD_ENV,
    TimedArms,
    TimedPair,
)
from pytest_dflash.routes.origin import CandidateCode, origin_of

_hookimpl = pluggy.HookimplMarker("pytest")  # what pytest.hookimpl marks, without pytest


class WorkerContext:
    """What a job's builder gets: the device, the policy, the profile and the route registry.

    It is also the ``config`` a worker plugin's ``pytest_dflash_engine`` receives: its ``hook``
    asks the worker plugins and then the worker's own engine factory, as ``config.hook`` asks
    the session's plugins and then the session's factory."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from pytest_dflash.policy.thresholds import Policy

        self.device = torch.device(spec["device"])
        self.profile: str = spec["profile"]
        self.policy = Policy(**spec["policy"])
        self.threads = int(spec["threads"])
        self.hf_model, self.hf_dtype = spec.get("hf_model"), spec.get("hf_dtype")
        # the candidate of the job being timed, and its objects: an exception raised in them is
        # the candidate's (routes.origin), told to the gate's process with the error
        self.candidate: str | None = None
        self.candidate_code = CandidateCode()
        self._factory: Any = None
        self.prepared: Prepared | None = None  # the job built ahead of its time request
        # jobs this process has timed: the first pays the process's one-time costs (run_job)
        self.timed_jobs = 0
        self.registry, manager, route_plugins = _rebuild_registry(
            spec["plugins"], spec.get("worker_plugins") or [], self.policy)
        manager.register(_DefaultEngine(self), "dflash-worker-engine")
        # the engine hook of the worker plugins and the factory only: a conftest's own engine
        # hook was written for the pytest session (its config), and the gate times the engines
        # it builds in the gate's process (``EngineFactory.rebuildable``)
        self.hook = SimpleNamespace(pytest_dflash_engine=manager.subset_hook_caller(
            "pytest_dflash_engine", remove_plugins=route_plugins))
        if self.hf_model:  # the engine's imports, paid while the pool's workers start together
            from pytest_dflash.engines.transformers import preload

            preload(self.hf_model)

    def engine(self, *route_names: str) -> Any:
        """The session's in-process engine (reference, or the transformers engine of the same
        model) running every family's baseline except ``route_names``, built once per
        selection in this worker, as the gate's process builds it: through the worker plugins'
        ``pytest_dflash_engine`` (a self-test's planted route: its engine, as the gate built
        it), else the worker's engine factory."""

        def hook(selection: dict[str, str]) -> Any:
            return self.hook.pytest_dflash_engine(config=self, selection=selection,
                                                  profile=self.profile)

        engine = self.factory.engine(self.registry.engine_selection(route_names), hook)
        if self.candidate is not None and self.candidate in route_names:
            self.candidate_code.add(engine)
        return engine

    @property
    def factory(self) -> Any:
        """The worker's engine factory, whose cache holds one engine per selection."""
        if self._factory is None:
            from pytest_dflash.engines.factory import EngineFactory

            self._factory = EngineFactory(
                self.registry, self.profile, self.device.type,
                hf_model=Path(self.hf_model) if self.hf_model else None,
                hf_dtype=self.hf_dtype)
        return self._factory

    def implementation(self, route: str) -> Any:
        """The implementation object of ``route``, as the gate's process resolves it."""
        return self.registry.get(route).implementation()

    def gate(self, route: str, kind: str) -> Any:
        """A ``GateContext`` of ``route`` and ``kind`` as the gate's test sees it (no engines:
        a job that needs one builds it itself; records are the parent's business)."""
        from pytest_dflash.measure.gate import GateContext

        def no_engine(selection: dict[str, str]) -> Any:
            raise RuntimeError("timing workers build no engines through the gate context")

        gate = GateContext(
            route=self.registry.get(route),
            kind=kind,
            registry=self.registry,
            policy=self.policy,
            profile=self.profile,
            device=self.device,
            record=lambda **_: None,
            engine=no_engine,
        )
        if route == self.candidate:
            gate.candidate_code = self.candidate_code
        return gate


class _DefaultEngine:
    """The worker's last answer to ``pytest_dflash_engine``: its own engine factory."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    @_hookimpl(trylast=True)
    def pytest_dflash_engine(self, config: Any, selection: dict[str, str], profile: str) -> Any:
        return self.ctx.factory.engine(selection)


def _rebuild_registry(
    plugins: list[str], worker_plugins: list[dict[str, Any]], policy: Any
) -> tuple[Any, Any, list[Any]]:
    """The run's route registry, through the same hook and plugins as the pytest run and the
    session's worker plugins (each built as ``factory(policy=..., **kwargs)``: the self-test's
    plants its routes in that hook, after the others); the plugin manager; the run's plugins."""
    from pytest_dflash.routes import hookspec
    from pytest_dflash.routes.registry import RouteRegistry, resolve

    class Manager(pluggy.PluginManager):
        # hookspec.py's functions are specs by their name, as pytest's manager reads them
        def parse_hookspec_opts(self, module_or_class: Any, name: str) -> Any:
            opts = super().parse_hookspec_opts(module_or_class, name)
            return opts if opts is not None or not name.startswith("pytest_dflash_") else {}

        # and plain functions named after a hook implement it, as in a conftest
        def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
            opts = super().parse_hookimpl_opts(plugin, name)
            if opts is None and name.startswith("pytest_dflash_"):
                return {} if callable(getattr(plugin, name, None)) else None
            return opts

    manager = Manager("pytest")
    manager.add_hookspecs(hookspec)
    route_plugins = []
    for i, ref in enumerate(plugins):
        if ref.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"_dflash_worker_plugin_{i}", ref)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load plugin file {ref}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ref)
        manager.register(module, f"plugin-{i}")
        route_plugins.append(module)
    for i, entry in enumerate(worker_plugins):
        factory = resolve(entry["factory"])
        manager.register(factory(policy=policy, **entry.get("kwargs", {})), f"worker-plugin-{i}")
    registry = RouteRegistry()
    manager.hook.pytest_dflash_routes(registry=registry)
    registry.validate()
    return registry, manager, route_plugins


def _balanced_orders(rounds: int, seed: list[int]) -> list[str]:
    """Half the rounds candidate-first, half baseline-first, in a seeded shuffled order, so the
    order's own effect (a warm cache for the second call) cancels within every process."""
    import numpy as np

    orders = ["cb", "bc"] * (rounds // 2) + (["cb"] if rounds % 2 else [])
    np.random.default_rng(seed).shuffle(orders)
    return orders


def _balanced_arm_orders(arms: list[str], rounds: int, seed: list[int]) -> list[list[str]]:
    """Orders of several arms for ``rounds`` rounds (an even number): each seeded random order
    followed by its reverse, so in every two rounds each arm runs before each other arm once,
    and every arm's mean position is the same: what a warm cache gives the next call cancels
    for every pair of arms, as ``_balanced_orders`` does for two."""
    import numpy as np

    rng = np.random.default_rng(seed)
    orders: list[list[str]] = []
    while len(orders) < rounds:
        order = [arms[i] for i in rng.permutation(len(arms))]
        orders += [order, order[::-1]]
    return orders[:rounds]


def _as_arms(run_pair: Any) -> Any:
    """A pair's round timer (``timing.round_timer``) as an arms timer of arms ``c`` and ``b``."""

    def run_arms(order: Sequence[str]) -> dict[str, float]:
        return dict(zip("cb", run_pair("".join(order)), strict=True))

    return run_arms


def rounds_for(round_s: float | None, *, minimum: int, maximum: int, budget_s: float) -> int:
    """How many rounds this process times: enough to fill ``budget_s`` at ``round_s`` seconds a
    round (the warm-up's last round), an even number within [minimum, maximum].

    A fixed round count gives a 26 us graph replay a few milliseconds of evidence per process
    and a 0.2 s cold prefill many seconds; a budget gives every gate's per-process statistic
    about the same time, so the within-process noise shrinks where rounds are cheap.
    """
    wanted = minimum
    if round_s is not None and round_s > 0 and budget_s > 0:
        wanted = max(minimum, math.ceil(budget_s / round_s))
    wanted = min(maximum, wanted)
    return wanted + (wanted % 2 if wanted < maximum else 0)


@dataclass
class Prepared:
    """A job's pair as its builder made it, waiting for its turn to be timed."""

    key: str
    pair: TimedPair | TimedArms
    candidate: str | None
    candidate_code: CandidateCode
    build_s: float
    reserved_before: int | None = None  # device bytes held before the build (cuda_graphs)


def _job_key(message: dict[str, Any]) -> str:
    return json.dumps([message["builder"], message.get("kwargs", {})], sort_keys=True)


def build_job(ctx: WorkerContext, message: dict[str, Any]) -> Prepared:
    """The job's pair from its builder (engines, inputs, a capture), and the seconds it took."""
    from pytest_dflash.measure import cuda_graphs
    from pytest_dflash.routes.registry import resolve

    start = time.perf_counter()
    reserved_before = cuda_graphs.reserved(ctx.device)
    ctx.candidate = message.get("kwargs", {}).get("route")
    ctx.candidate_code = CandidateCode()
    builder = resolve(message["builder"])
    pair = builder(ctx, **message["kwargs"])
    if not isinstance(pair, TimedPair | TimedArms):
        raise TypeError(f"builder {message['builder']} returned {type(pair).__name__}, expected "
                        "a TimedPair or TimedArms")
    return Prepared(_job_key(message), pair, ctx.candidate, ctx.candidate_code,
                    time.perf_counter() - start, reserved_before)


def prepare_job(ctx: WorkerContext, message: dict[str, Any]) -> dict[str, Any]:
    """Build a job's pair ahead of its ``time`` request (the pool prepares a look's workers
    together, then times them one at a time). A worker holds one prepared job: a newer one
    replaces it, so a look abandoned by an error leaves nothing behind for long."""
    from pytest_dflash.measure import cuda_graphs

    ctx.prepared = None
    cuda_graphs.release(ctx.device)
    ctx.prepared = build_job(ctx, message)
    return {"prepared_s": ctx.prepared.build_s}


def time_job(ctx: WorkerContext, message: dict[str, Any], beat: Any) -> dict[str, Any]:
    """Build (unless prepared), warm up and time one job; the answer carries raw seconds and
    the timed hits."""
    from pytest_dflash.measure import cuda_graphs
    from pytest_dflash.measure.timing import arms_timers, pair_timers
    from pytest_dflash.native import hits

    start = time.perf_counter()
    prepared = ctx.prepared
    ctx.prepared = None
    if prepared is None or prepared.key != _job_key(message):
        prepared = build_job(ctx, message)
        built_here = prepared.build_s
    else:
        built_here = 0.0
        ctx.candidate, ctx.candidate_code = prepared.candidate, prepared.candidate_code
    pair = prepared.pair
    if isinstance(pair, TimedArms):
        run_arms, info = arms_timers(pair, ctx.device, ctx.policy)
        first_order: Sequence[str] = [*pair.candidates, BASELINE_ARM]
    else:
        run_pair, info = pair_timers(pair, ctx.device, ctx.policy)
        run_arms, first_order = _as_arms(run_pair), "cb"
        del run_pair  # its captured graphs go with run_arms, below

    round_s = None
    budget_s = float(message.get("budget_s", 0.0))
    warmed = 0
    for _ in range(int(message["warmup"])):
        began = time.perf_counter()
        run_arms(first_order)
        round_s = time.perf_counter() - began  # the last warm-up round: caches and JIT warm
        warmed += 1
        if budget_s > 0 and round_s >= budget_s and (ctx.timed_jobs or warmed > 1):
            # a round that alone outlasts the process's timing budget (a cold prefill, a long
            # attention) has paid its first-call costs in that round; a second warm-up round
            # would cost as much as the timed rounds themselves. Except in the process's first
            # job, whose first round also pays what the process does once (the CUDA timer's
            # L2 flush buffer, kernel modules loaded at their first call): there a second round
            # says what a round costs. A fresh worker's first round of fa2's 512-token
            # attention took 0.7 s, 0.4 ms a round after it, and the process timed the minimum
            # rounds instead of filling its budget.
            break
    ctx.timed_jobs += 1
    info["warmup_rounds"] = warmed
    # how this process's allocator was set: the report shows what each statistic was timed under
    info["allocator"] = {name: os.environ.get(name) for name in ALLOCATOR_ENV}
    # the build counts whether it ran here or was prepared beside the look's other workers
    setup_s = time.perf_counter() - start - built_here + prepared.build_s
    info["build_s"] = round(prepared.build_s, 3)
    info["prepared"] = built_here == 0.0
    rounds = rounds_for(round_s, minimum=int(message["rounds"]),
                        maximum=int(message.get("max_rounds", message["rounds"])),
                        budget_s=budget_s)
    info["round_s"] = round_s
    # the calls each side made in the timed rounds: a gate checks its replayed route hits
    info["timed_calls"] = rounds * int(info.get("calls_per_sample", 1))
    orders: list[Any] = (_balanced_arm_orders(list(first_order), rounds, message["seed"])
                         if isinstance(pair, TimedArms)
                         else _balanced_orders(rounds, message["seed"]))
    spent: dict[str, list[float]] = {name: [] for name in first_order}
    last = time.monotonic()
    with hits.counting() as delta:
        for done, order in enumerate(orders, start=1):
            for name, seconds in run_arms(order).items():
                spent[name].append(seconds)
            if time.monotonic() - last > 2.0:
                beat({"progress": done})
                last = time.monotonic()
        if pair.facts is not None:  # inside the count: it may book the last run's hits
            info["facts"] = pair.facts()
    # the pair's engines stay cached, its buffers and graphs go before the answer, while no
    # worker is timed; the full collection only where emptying the cache did not get back to
    # what the process held before the build
    down_to = prepared.reserved_before
    timed = {"arms": {name: spent[name] for name in pair.candidates},
             "baseline_s": spent[BASELINE_ARM]} if isinstance(pair, TimedArms) else {
             "candidate_s": spent["c"], "baseline_s": spent["b"]}
    del pair, prepared, run_arms
    cuda_graphs.release(ctx.device, down_to=down_to)
    return {
        **timed,
        "orders": orders,
        "setup_s": setup_s,
        "info": info,
        "hits": [[r, op, n] for (r, op), n in delta.counts.items()],
    }


def main() -> int:
    """Serve requests on stdin until told to exit; answers go to the protocol pipe."""
    out = os.fdopen(int(os.environ[PROTOCOL_FD_ENV]), "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    ctx: WorkerContext | None = None
    for raw in sys.stdin:
        message = json.loads(raw)
        op = message.get("op")
        if op == "exit":
            break
        try:
            if op == "init":
                spec = message["spec"]
                sys.path[:] = [p for p in spec["sys_path"] if p] + [
                    p for p in sys.path if p not in spec["sys_path"]
                ]
                import torch

                torch.set_num_threads(int(spec["threads"]))
                ctx = WorkerContext(spec)
                continue  # answered by the ping that follows
            if ctx is None:
                raise RuntimeError("the worker got a request before its init")
            if op == "ping":
                import torch

                send(
                    {
                        "pid": os.getpid(),
                        "cwd": str(Path.cwd()),
                        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "allocator": {name: os.environ.get(name) for name in ALLOCATOR_ENV},
                        "threads": torch.get_num_threads(),
                        "device": str(ctx.device),
                        "routes": sorted(r.name for r in ctx.registry),
                    }
                )
            elif op == "prepare":
                send(prepare_job(ctx, message))
            elif op == "time":
                send(time_job(ctx, message, send))
            elif op == "crash":  # for the protocol's tests: an abrupt exit mid-request
                os._exit(int(message.get("code", 3)))
            elif op == "hang":  # for the protocol's tests: a worker that stops answering
                time.sleep(float(message.get("seconds", 3600)))
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the gate, named
            traceback.print_exc()
            send(
                {
                    "error": traceback.format_exc(limit=8).strip().splitlines()[-1],
                    "traceback": traceback.format_exc(),
                    "origin": origin_of(exc, ctx.candidate_code if ctx else None),
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
