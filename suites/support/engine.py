"""Support for the engine-level gates: the families an engine applies, the proof that a
candidate served an engine's calls, and the timing pairs: cold prefills (the ``prefill`` gate
of every engine family) and speculative rounds (gemm.nvfp4 validation_cost), built alike in
the gate's process and in each timing worker, where the worker rebuilds the session's
in-process engine (``WorkerContext.engine``).

What the gate checks besides the time travels back as *facts* (``TimedPair.facts``): every
cold prefill's first-token hash, greedy first token and chunk count, and the candidate's route
hits, so a worker's runs are judged exactly like runs in the gate's own process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# The families the engines apply (the reference engine runs attention, the MLP projections and
# the prefill geometry through the selected routes; the transformers engine also the kernel
# libraries' gated DeltaNet and norm routes): the model-level gates (ppl, quality, prefill)
# serve a candidate of any of them, on an engine with that candidate switched in and every
# other family at its baseline.
ENGINE_FAMILIES: tuple[str, ...] = ("attn.d256", "gemm.nvfp4", "prefill.geometry", "linear.gdn",
                                    "norm_mlp")


class Served:
    """Proof that a model-level gate's candidate engine ran the candidate: the engine's route
    hits of the candidate between construction and :meth:`check`. An engine without the
    ``route_hits`` capability (a server: its proof is the switches it was started with, which
    ``record_engines`` records) proves nothing here, and :meth:`check` returns None."""

    def __init__(self, engine: Any, route: str) -> None:
        from pytest_dflash.engines import capabilities_of

        self.engine, self.route = engine, route
        self.counted = capabilities_of(engine).route_hits
        if self.counted and callable(getattr(engine, "reset_prefix_cache", None)):
            # cold from here: an engine shared with an earlier gate (or the self-test's copy
            # of a route) would answer those prompts from cached prefixes, and the candidate
            # would not serve their prefills
            engine.reset_prefix_cache()
        self.before = self._count()

    def _count(self) -> int:
        return int(self.engine.route_hits().get(self.route, 0)) if self.counted else 0

    def check(self, what: str) -> int | None:
        """The candidate's hits since construction; AssertionError when there are none."""
        if not self.counted:
            return None
        ran = self._count() - self.before
        if ran <= 0:
            raise AssertionError(
                f"{self.route} recorded no route hits over {what} on its engine (hits "
                f"{self.engine.route_hits()}): the candidate did not serve the calls")
        return ran


class PrefillRuns:
    """Cold prefills of one engine: what each run yielded, for the determinism checks."""

    def __init__(self, engine: Any, ids: list[int]) -> None:
        self.engine, self.ids = engine, ids
        self.hashes: set[str] = set()
        self.first_tokens: set[int] = set()
        self.chunks: set[int] = set()
        self.runs = 0

    def reset(self) -> None:
        self.engine.reset_prefix_cache()

    def __call__(self) -> None:
        result = self.engine.prefill(self.ids)
        self.hashes.add(result.first_token_hash)
        self.first_tokens.add(result.first_token)
        self.chunks.add(result.chunks)
        self.runs += 1

    def facts(self) -> dict[str, Any]:
        chunk = getattr(self.engine, "chunk", None)
        expected = -(-len(self.ids) // chunk) if chunk else min(self.chunks, default=0)
        return {"hashes": sorted(self.hashes), "first_tokens": sorted(self.first_tokens),
                "chunks": sorted(self.chunks), "runs": self.runs, "expected_chunks": expected}


class ReplayedPrefillRuns(PrefillRuns):
    """Cold prefills of one engine as replays of one CUDA graph of its ``cold_prefill_call``.

    The timed call is the replay alone. What a run yielded (its first-token hash and greedy
    token, read from the graph's output) and its route hits (``ColdPrefillCall.book``) are
    taken untimed, before the next sample (``reset``) or with the facts."""

    def __init__(self, runs: PrefillRuns, call: Any, replay: Any, output: Any) -> None:
        super().__init__(runs.engine, runs.ids)
        self.call, self.replay, self.output = call, replay, output
        self.pending = False

    def reset(self) -> None:
        self.settle()

    def __call__(self) -> None:
        self.replay()
        self.pending = True

    def settle(self) -> None:
        """Take the last replay's result and book its route hits (once per replay)."""
        if not self.pending:
            return
        result = self.call.result(self.output)
        self.call.book()
        self.hashes.add(result.first_token_hash)
        self.first_tokens.add(result.first_token)
        self.chunks.add(result.chunks)
        self.runs += 1
        self.pending = False

    def facts(self) -> dict[str, Any]:
        self.settle()
        return super().facts()


class ColdPrefills:
    """Cold prefills of one prompt on a baseline engine and one or more candidate engines,
    every prefix cache reset before every timed run, and each candidate's route hits over the
    runs. Several candidates share the baseline's runs when their first look is timed together
    (``cold_prefill_arms``)."""

    def __init__(self, baseline: Any, candidates: dict[str, Any], ids: Sequence[int]) -> None:
        ids = list(ids)
        self.baseline = PrefillRuns(baseline, ids)
        self.candidates = {route: PrefillRuns(engine, ids) for route, engine in candidates.items()}
        self._hits_before = {route: engine.route_hits().get(route, 0)
                             for route, engine in candidates.items()}

    def _sides(self) -> list[PrefillRuns]:
        return [*self.candidates.values(), self.baseline]

    def before_each(self) -> None:
        for side in self._sides():
            side.reset()

    def capture(self, device: Any) -> dict[str, Any]:
        """On CUDA, every side's cold prefill captured in a CUDA graph, whose replays are then
        timed (one warm-up run of each first); how it went, for the report. An engine without
        a ``cold_prefill_call`` or a prefill the capture refuses is timed eagerly, and the
        report says why (docs/gates.md, "prefill")."""
        from pytest_dflash.measure import cuda_graphs

        sides = self._sides()
        calls = [getattr(side.engine, "cold_prefill_call", None) for side in sides]
        if any(call is None for call in calls):
            return {"graph": "not captured, timed eagerly: the engine has no cold_prefill_call"}
        prefills = [call(side.ids) for call, side in zip(calls, sides, strict=True)]
        try:
            captured = cuda_graphs.capture(prefills, device, warmup=1)
        except cuda_graphs.CaptureRefused as why:
            return {"graph": f"not captured, timed eagerly: {why}"}
        replayed = [ReplayedPrefillRuns(side, call, replay, output) for side, call, replay, output
                    in zip(sides, prefills, captured.replays, captured.outputs, strict=True)]
        self.candidates = dict(zip(self.candidates, replayed[:-1], strict=True))
        self.baseline = replayed[-1]
        names = [*self.candidates, "baseline"]
        return {"graph": "captured: each cold prefill is one graph replay",
                "eager_s": dict(zip(names, captured.warm_s, strict=True))}

    def facts_of(self, route: str) -> dict[str, Any]:
        """The runs of ``route`` and of the baseline, and the route hits its runs booked."""
        side = self.candidates[route]
        ran = side.engine.route_hits().get(route, 0) - self._hits_before[route]
        return {"candidate": side.facts(), "baseline": self.baseline.facts(),
                "candidate_route_hits": ran}


class ColdPrefillPair(ColdPrefills):
    """Candidate and baseline cold prefills of one prompt (one candidate's ``ColdPrefills``)."""

    def __init__(self, baseline: Any, candidate: Any, route: str, ids: Sequence[int]) -> None:
        super().__init__(baseline, {route: candidate}, ids)
        self.route = route

    @property
    def candidate(self) -> PrefillRuns:
        return self.candidates[self.route]

    def capture(self, device: Any) -> dict[str, Any]:
        info = super().capture(device)
        if "eager_s" in info:
            info["eager_s"] = {"candidate": info["eager_s"][self.route],
                               "baseline": info["eager_s"]["baseline"]}
        return info

    def facts(self) -> dict[str, Any]:
        return self.facts_of(self.route)


def merged_prefill_facts(facts: Sequence[dict[str, Any]], side: str) -> dict[str, Any]:
    """One side's facts over every process that timed it: sets joined, runs summed."""
    merged: dict[str, Any] = {"hashes": set(), "first_tokens": set(), "chunks": set(),
                              "expected_chunks": set(), "runs": 0}
    for fact in facts:
        one = fact[side]
        for key in ("hashes", "first_tokens", "chunks"):
            merged[key].update(one[key])
        merged["expected_chunks"].add(one["expected_chunks"])
        merged["runs"] += one["runs"]
    return merged


def check_prefill_runs(merged: dict[str, Any], label: str) -> tuple[str, int]:
    """(first-token hash, greedy first token) of a side whose every cold prefill, in every
    process, gave one hash and the expected chunk count; AssertionError otherwise."""
    if len(merged["hashes"]) != 1:
        raise AssertionError(f"{label}: {len(merged['hashes'])} different first-token hashes "
                             f"over {merged['runs']} cold prefills of one prompt: not "
                             "deterministic")
    if merged["chunks"] != merged["expected_chunks"] or len(merged["chunks"]) != 1:
        raise AssertionError(f"{label}: prefill ran in {sorted(merged['chunks'])} chunks, "
                             f"expected {sorted(merged['expected_chunks'])}: a warm prefix was "
                             "reused")
    return next(iter(merged["hashes"])), next(iter(merged["first_tokens"]))


def cold_prefill_pair(ctx: Any, *, route: str, baseline: str, ids: list[int]) -> Any:
    """Timing-worker builder of the prefill gate: cold prefills of the prompt ``ids`` on the
    candidate's and the baseline's engines, one call a sample: graph replays on CUDA where the
    engine's prefill can be captured, else eager. The ids come from the gate's process, so
    every worker times the very tokens the gate checked, and no worker reads the data files
    (their reader's imports cost a fresh worker most of a second of CPU)."""
    from pytest_dflash.measure.timing_pool import TimedPair

    pair = ColdPrefillPair(ctx.engine(baseline), ctx.engine(route), route, ids)
    info = pair.capture(ctx.device) if ctx.device.type == "cuda" else {}
    return TimedPair(pair.candidate, pair.baseline, before_each=pair.before_each,
                     facts=pair.facts, info=info)


def cold_prefill_arms(ctx: Any, *, routes: list[str], baseline: str, ids: list[int]) -> Any:
    """Timing-worker builder of a prefill gate's first look shared by several routes: each
    route's cold prefills and the baseline's, timed in the same rounds
    (``timing.SharedLook``), so the baseline runs once a round for all of them. As
    ``cold_prefill_pair`` otherwise; each route's facts are its own and the baseline's."""
    from pytest_dflash.measure.timing_pool import TimedArms

    arms = ColdPrefills(ctx.engine(baseline), {route: ctx.engine(route) for route in routes},
                        ids)
    info = arms.capture(ctx.device) if ctx.device.type == "cuda" else {}
    return TimedArms(arms.baseline, dict(arms.candidates), before_each=arms.before_each,
                     facts=lambda: {route: arms.facts_of(route) for route in routes},
                     info=info)


def verify_drafts(prompt: Sequence[int], widths: int) -> list[list[int]]:
    """The drafts of one speculative round after ``prompt``: M = 1..widths rows."""
    return [list(prompt[1 : 1 + m]) for m in range(1, widths + 1)]


def speculative_round(engine: Any, drafts: list[list[int]]) -> Callable[[], Any]:
    """One speculative round on ``engine``'s warm cache: a verify step per draft."""
    return lambda: [engine.verify(draft) for draft in drafts]


def speculative_round_pair(ctx: Any, *, route: str, verify_route: str,
                           prompt: list[int]) -> Any:
    """Timing-worker builder of the engine-level validation_cost gate: one speculative round
    (verify M = 1..validation_max_m after a prefill of the prompt) with the candidate on and
    off, captured as a CUDA graph where the engine allows it (a deployment replays its verify
    steps as graphs; an engine that cannot be captured is timed eagerly, and says why)."""
    from pytest_dflash.measure.timing_pool import TimedPair

    enabled, disabled = ctx.engine(route), ctx.engine(verify_route)
    for engine in (enabled, disabled):
        engine.prefill(prompt)
    drafts = verify_drafts(prompt, ctx.policy.validation_max_m)
    return TimedPair(speculative_round(enabled, drafts), speculative_round(disabled, drafts),
                     graph=True)
