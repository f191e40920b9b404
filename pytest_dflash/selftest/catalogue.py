"""The predeclared defect catalogue of the gate self-test (``docs/selftest.md``).

For every selected candidate route the self-test registers ordinary routes next to it: an
unchanged copy, which must be judged like the route itself, and one route per planted defect,
which requires exactly the gate kind meant to catch it. The same shipped gate suites judge them;
nothing in a gate knows it is being tested. A defect is *caught* when its gate fails it.

The catalogue is fixed here, not chosen per run, and its sizes derive from the predeclared
policy, so a self-test on one machine is comparable with one on another:

* parity (attn.d256, gemm.nvfp4): output scaled by 1 + 2^-9 (one fp16 ulp at 1.0 is 2^-10); the
  last output row left unwritten (the gates poison outputs, so it reads NaN); gemm: the last
  16-element K group dropped; attention: GQA query heads mapped to the wrong KV head
  (``h % Hkv`` instead of ``h // (Hq/Hkv)``), and a paged cache read one physical block off
  for the last logical block.
* speed (op level: attn.d256, gemm.nvfp4) and prefill (model level: every family an engine
  applies): a candidate with no gain that is *slower* than its baseline by the policy's min gain,
  by 3% and by 10%: the baseline's own code plus a busy wait (CPU) or spin kernel (GPU) of that
  fraction of each call's measured time (``slowdown.py``): each op call for speed, each cold
  prefill of the baseline's engine for prefill. Planting the slowdown on the baseline's code
  makes the true ratio exactly 1 + fraction; on the candidate's code it would depend on the
  candidate's unknown gain.
* validation_cost (gemm.nvfp4): verify widths M <= 8 sent to another kernel path (the family
  baseline's), and every call made 2% slower (twice the default noise floor).
* ppl (every engine family): every token's log-probability lowered by the amount that raises
  each segment's perplexity by twice the policy's tolerance.
* quality (every engine family): every fourth completion degenerated (a run of one repeated
  character, no natural stop), as a broken kernel's output looks.
* ppl and prefill (gemm.nvfp4): the block scales of one projection of one layer read one binade
  high (x2): the first weight of the reference model's down-projection shape (N 256, K 512)
  that the route prepares, which is layer 0's. Like a kernel bug of one tile configuration, it
  never fires on the shapes the op-level parity cases use, so parity passes it
  (tests/test_selftest_catalogue.py runs them); only the model's predictions show it, which
  the ppl gate and the prefill gate's cross-route agreement check must catch.

Engine-level defects (``Defect.level == "engine"``) act on the engine the served selection
builds (``engine.py``); op-level ones on the route's calls (``wrappers.py``), which an engine
then runs like any route's.

Route names: ``<route>~copy`` and ``<route>~<defect>``. The planted routes are candidates of the
route's family with the route's baseline, so verdicts, figures and reports treat them like any
other route.

The unchanged copy is an A/A control: its record names the route's own implementation and
verify route, with ``hit_source`` set to the route, so the gates time the very same calls and
book the route's hits as the copy's per test (``hits.attributed``), not per call. Every planted
defect serves its calls through a Python wrapper (``wrappers.py``), which costs a few
microseconds per call. A validation_cost gate compares its candidate with the family's
verify route, and a quick-size verify step is tens of microseconds, so that cost alone would
read as a regression. The planted routes of such a gate are therefore compared with
``<verify route>~passthrough``: the verify route behind the same wrapper, with no defect, whose
hits keep the verify route's own name (``Planted.hits_as``), so the gate's route-hit comparison
is the same as for the route itself. Only the planted defect differs between the two sides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_dflash.evidence.catch import COPY
from pytest_dflash.routes.registry import Route
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS as TIMING_KINDS

if TYPE_CHECKING:
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.routes.registry import RouteRegistry

SEPARATOR = "~"
PASS_THROUGH = "passthrough"  # the verify route behind the planted routes' wrapper, no defect
ATTN, GEMM, GEOMETRY = "attn.d256", "gemm.nvfp4", "prefill.geometry"
GDN = "linear.gdn"  # flash-linear-attention's routes (pytest_dflash.routes.library)
PARITY_SCALE = 1.0 + 2.0**-9
DEGENERATE_EVERY = 4
VERIFY_COST = 0.02
SPEED_RUNGS = (0.03, 0.10)  # besides the policy's min gain, which is always the first rung
# ``--dflash-selftest-calibrate`` (``pytest-dflash selftest --repeat K``): every timing gate's
# copy and these planted slowdowns, to count pass / inconclusive / fail over repeated runs
CALIBRATION_RUNGS = (0.01, 0.02, 0.05, 0.10)
# the scale slip's weight: the first prepared of the reference model's down-projection shape
# (N = d_model, K = d_ff of fixtures/model/config.json), i.e. layer 0's down projection
SLIP_SHAPE = (256, 512)
SLIP_FACTOR = 2.0  # one binade: the block scales' E4M3 exponent read one step high
# Gate kinds with planted defects; the loader gate's scenarios are real library files already.
KINDS = ("parity", "speed", "prefill", "validation_cost", "ppl", "quality")
ENGINE_FAMILIES = frozenset({ATTN, GEMM, GEOMETRY})


@dataclass(frozen=True)
class Defect:
    """One planted defect: the gate kind meant to catch it and what it does."""

    key: str
    kind: str
    families: frozenset[str]
    what: str
    serves: str = "route"  # whose code serves the calls: "route" or "baseline"
    slowdown: float | None = None  # planted extra time per call (timing defects)
    level: str = "op"  # "op": in the route's calls (wrappers.py); "engine": engine.py
    also: tuple[str, ...] = ()  # more gate kinds meant to catch it, besides ``kind``

    def applies_to(self, route: Route) -> bool:
        return route.family in self.families and bool(self.kinds(route))

    def kinds(self, route: Route) -> tuple[str, ...]:
        """The kinds of this defect that ``route`` requires: the gates it is planted for."""
        return tuple(k for k in (self.kind, *self.also) if k in route.gates)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:g}pct".replace(".", "p")


def calibration(policy: Any) -> tuple[Defect, ...]:
    """The timing calibration set: planted slowdowns of ``CALIBRATION_RUNGS`` for the speed
    gates (the baseline's code slowed) and the validation_cost gates (every call slowed). A
    1% slowdown sits on the validation_cost noise floor: it is counted, not expected caught."""
    del policy
    defects = []
    for fraction in CALIBRATION_RUNGS:
        defects.append(Defect(f"slow_{_pct(fraction)}", "speed", frozenset({ATTN, GEMM}),
                              f"no gain: the baseline's code slowed by {fraction:.0%}",
                              serves="baseline", slowdown=fraction))
        defects.append(Defect(f"prefill_slow_{_pct(fraction)}", "prefill", ENGINE_FAMILIES,
                              f"no gain: the baseline's cold prefills slowed by {fraction:.0%}",
                              serves="baseline", slowdown=fraction, level="engine"))
        defects.append(Defect(f"verify_cost_{_pct(fraction)}", "validation_cost",
                              frozenset({GEMM}), f"every call {fraction:.0%} slower",
                              slowdown=fraction))
    return tuple(defects)


def catalogue(policy: Any) -> tuple[Defect, ...]:
    """Every defect of the catalogue, sized from ``policy`` (a
    ``pytest_dflash.policy.thresholds.Policy``)."""
    ops = frozenset({ATTN, GEMM})
    defects = [
        Defect("out_scaled", "parity", ops, "output scaled by 1 + 2^-9"),
        Defect("row_unwritten", "parity", ops, "last output row left unwritten"),
        Defect("k_group_dropped", "parity", frozenset({GEMM}),
               "last 16-element K group dropped from the dot products"),
        Defect("gqa_heads", "parity", frozenset({ATTN}),
               "GQA query head h reads KV head h % Hkv instead of h // (Hq / Hkv)"),
        Defect("paged_block_off", "parity", frozenset({ATTN}),
               "paged cache: the last logical block read one physical block off"),
        # a copy of a gated-delta-rule route with one classic kernel bug each: the op-level
        # parity gate must reject it, and inside the model the ppl gate
        Defect("state_not_carried", "parity", frozenset({GDN}),
               "gated delta rule: the starting state ignored (not carried across a chunk seam)",
               also=("ppl",)),
        Defect("qk_l2norm_dropped", "parity", frozenset({GDN}),
               "gated delta rule: the query/key L2 norm asked for is not applied",
               also=("ppl",)),
    ]
    rungs = sorted({float(policy.speed_min_gain), *SPEED_RUNGS})
    for fraction in rungs:
        label = "the policy's min gain" if fraction == policy.speed_min_gain else f"{fraction:.0%}"
        defects.append(Defect(
            f"slow_{_pct(fraction)}", "speed", ops,
            f"no gain: the baseline's code slowed by {fraction:.1%} ({label})",
            serves="baseline", slowdown=fraction))
        defects.append(Defect(
            f"prefill_slow_{_pct(fraction)}", "prefill", ENGINE_FAMILIES,
            f"no gain: the baseline's cold prefills slowed by {fraction:.1%} ({label})",
            serves="baseline", slowdown=fraction, level="engine"))
    defects += [
        Defect("verify_path", "validation_cost", frozenset({GEMM}),
               "verify widths M <= 8 served by another kernel path (the family baseline's)"),
        Defect(f"verify_cost_{_pct(VERIFY_COST)}", "validation_cost", frozenset({GEMM}),
               f"every call {VERIFY_COST:.0%} slower", slowdown=VERIFY_COST),
        Defect("ppl_shift", "ppl", ENGINE_FAMILIES,
               f"log-probs shifted so each segment's perplexity rises by 2 x the relative "
               f"tolerance ({2 * policy.ppl_rel_tolerance:.2%})", level="engine"),
        Defect("degenerate", "quality", ENGINE_FAMILIES,
               f"every {DEGENERATE_EVERY}th completion degenerated (repeated character, no stop)",
               level="engine"),
        Defect("scale_slip", "ppl", frozenset({GEMM}),
               f"block scales of one projection of one layer x{SLIP_FACTOR:g} (the first "
               f"{SLIP_SHAPE[0]}x{SLIP_SHAPE[1]} weight: layer 0's down projection; no parity "
               "case has that shape)", also=("prefill",)),
    ]
    return tuple(defects)


@dataclass(frozen=True)
class Planted:
    """A self-test route: the copy (``defect`` None) or one planted defect of ``original``; or,
    with ``pass_through``, the verify route ``original`` behind the same wrapper (no defect),
    which the planted routes' validation_cost gates compare them with."""

    name: str
    original: Route
    serves: Route  # the route whose code serves the calls
    defect: Defect | None
    pass_through: bool = False
    only: Collection[str] = KINDS  # the copy's gate kinds (the calibration: timing only)

    @property
    def key(self) -> str:
        if self.pass_through:
            return PASS_THROUGH
        return COPY if self.defect is None else self.defect.key

    @property
    def gates(self) -> tuple[str, ...]:
        if self.pass_through:
            return ()  # never judged itself: it is the other side of its planted routes' gates
        if self.defect is not None:
            return self.defect.kinds(self.original)
        return tuple(k for k in self.original.gates if k in self.only)

    @property
    def engine_level(self) -> bool:
        """Whether the planted behaviour lives in the engine (``engine.py``): every planted
        prefill.geometry route (a geometry acts through the engine), and the engine-level
        defects of the other families."""
        if self.pass_through:
            return False
        if self.original.family == GEOMETRY:
            return True
        return self.defect is not None and self.defect.level == "engine"

    @property
    def what(self) -> str:
        if self.pass_through:
            return (f"{self.serves.name} behind the self-test wrapper, no defect: the verify "
                    "side of planted routes' validation_cost gates")
        return "unchanged copy" if self.defect is None else self.defect.what

    @property
    def hits_as(self) -> str:
        """The name the served route's hits are recorded under. A planted route records them
        as itself, so the gates see it as the route that ran. A pass-through records them as
        the served verify route, so the gate's "same kernels with the candidate on and off"
        check compares the candidate's hits with the verify route's, as for the route itself."""
        return self.serves.name if self.pass_through else self.name

    def record(self) -> dict[str, Any]:
        """The report's ``planted`` field of this route, which marks it as planted for every
        output (``pytest_dflash.evidence.catch`` builds the catch table from it)."""
        return {"from": self.original.name, "defect": self.key, "what": self.what,
                "slowdown": self.defect.slowdown if self.defect is not None else None}


def planted_name(route_name: str, key: str) -> str:
    return f"{route_name}{SEPARATOR}{key}"


def original_of(name: str) -> str | None:
    """The route a self-test route was planted from, or None for an ordinary route."""
    original, sep, _ = name.rpartition(SEPARATOR)
    return original if sep else None


def plan(candidates: Iterable[Route], registry: RouteRegistry, policy: Policy, *,
         calibrate: bool = False) -> list[Planted]:
    """The copy and the applicable defects of every candidate that has a catalogued gate, then
    the pass-through of each verify route that a planted validation_cost gate compares with.
    ``calibrate``: only the timing gates, with the calibration set (:func:`calibration`)."""
    defects = calibration(policy) if calibrate else catalogue(policy)
    kinds = TIMING_KINDS if calibrate else KINDS
    planted: list[Planted] = []
    for route in candidates:
        if original_of(route.name) is not None or not any(k in kinds for k in route.gates):
            continue
        copy = Planted(planted_name(route.name, COPY), route, route, None)
        if calibrate:
            copy = Planted(copy.name, route, route, None, only=TIMING_KINDS)
        planted.append(copy)
        for defect in defects:
            if not defect.applies_to(route):
                continue
            serves = route
            if defect.serves == "baseline":
                assert route.baseline is not None  # a candidate names its baseline
                serves = registry.get(route.baseline)
            planted.append(Planted(planted_name(route.name, defect.key), route, serves, defect))
    for name in dict.fromkeys(filter(None, (pass_through_of(p, registry) for p in planted))):
        original = original_of(name)
        assert original is not None  # a planted name, made by planted_name
        verify = registry.get(original)
        planted.append(Planted(name, verify, verify, None, pass_through=True))
    return planted


def pass_through_of(planted: Planted, registry: RouteRegistry) -> str | None:
    """The name of the pass-through that ``planted``'s validation_cost gate compares it with,
    or None when it has no such gate (or its family declares no verify route). The unchanged
    copy has none: it runs the route's own code, so it is compared with the route's own verify
    route, exactly as the route is."""
    if planted.pass_through or planted.defect is None or "validation_cost" not in planted.gates:
        return None
    verify = registry.family_of(planted.original.family).verify_route
    return planted_name(verify, PASS_THROUGH) if verify is not None else None
