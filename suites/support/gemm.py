"""Support for the gemm.nvfp4 gates: target shapes per profile, seeded inputs, one parity case,
the candidate/baseline pair of the speed gates, and the op-level validation-cost gate.

Every candidate is called through the family contract (``pytest_dflash.routes.families.GemmNvfp4``),
so a route registered by another project is gated exactly like a shipped one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash_kernels.gemm import MAX_VERIFY_M, as_gemm_route, poisoned_buffers
from dflash_kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from dflash_suites.support import assert_route_ran, check_same_kernels, no_zeros
from pytest_dflash.measure.gate import case_seed, gate_dtype
from pytest_dflash.measure.numerics import ParityResult, check_parity
from pytest_dflash.native import hits
from pytest_dflash.policy.profiles import sizes
from pytest_dflash.policy.thresholds import Policy

if TYPE_CHECKING:
    from pytest_dflash.measure.gate import GateContext
    from pytest_dflash.measure.timing_pool import TimingSetup

# (K, N) of the target deployment's projections (docs/gates.md, "gemm.nvfp4") and its prefill
# chunk M (Q3296); profiles divide them by ProfileSizes.gemm_divisor.
TARGET_LAYERS: dict[str, tuple[int, int]] = {
    "gate_up": (5120, 8704),
    "down": (4352, 5120),
    "qkv": (5120, 3584),
    "o": (1536, 5120),
}
TARGET_M = 3296
# Odd M at the contract edges: every verify width, one past it, one past the QPN2 block of 32.
ODD_M = (*range(1, MAX_VERIFY_M + 1), MAX_VERIFY_M + 1, 33)
# A padded, fused-able N (45 + 45 rows, padded to 96) for the odd-M cases.
ODD_SHAPE = (128, 90)


def layer_shape(layer: str, profile: str) -> tuple[int, int]:
    """(K, N) of a target layer scaled for ``profile``: K rounded up to the QPN K % 64
    contract, N scaled down; the fused gate/up N stays twice the down projection's K, so
    the MLP still chains (full: 8704 = 2 x 4352)."""
    if layer == "gate_up":
        k = layer_shape("qkv", profile)[0]
        return k, 2 * layer_shape("down", profile)[0]
    k, n = TARGET_LAYERS[layer]
    div = sizes(profile).gemm_divisor
    return math.ceil(k / div / 64) * 64, n // div


def large_m(profile: str) -> int:
    """The prefill chunk M of ``profile``."""
    return TARGET_M // sizes(profile).gemm_divisor


def make_weight(
    n: int, k: int, *, seed: int, device: torch.device, magnitude: float = 0.05
) -> NVFP4Weight:
    """A seeded ``[n, k]`` weight quantized to NVFP4."""
    gen = torch.Generator().manual_seed(seed)
    return quantize((torch.randn(n, k, generator=gen) * magnitude).to(device))


def make_x(
    m: int, k: int, *, seed: int, dtype: torch.dtype, device: torch.device,
    magnitude: float = 1.0,
) -> torch.Tensor:
    """Seeded activations with no exact zeros (a zero hides a wrong weight)."""
    gen = torch.Generator().manual_seed(seed)
    x = no_zeros(torch.randn(m, k, generator=gen)) * magnitude
    return x.to(device=device, dtype=dtype)


def parity_case(
    route_name: str,
    impl: Any,
    oracle: Any,
    reference: Any,
    w: NVFP4Weight,
    x: torch.Tensor,
    *,
    gated: bool,
    policy: Policy,
    label: str,
) -> ParityResult:
    """Run one case through the family contract and judge it (type B: three-way rule).

    Raises AssertionError when the candidate recorded no route hits or returned the wrong
    shape or dtype; returns the ParityResult otherwise (the caller decides and records).
    """
    call = "gate_up" if gated else "linear"
    prepared = impl.prepare(w)
    with hits.counting() as delta, poisoned_buffers():
        out = getattr(impl, call)(x, prepared)
    assert_route_ran(delta, route_name, label)
    n_out = w.n // 2 if gated else w.n
    if tuple(out.shape) != (x.shape[0], n_out) or out.dtype != x.dtype:
        raise AssertionError(
            f"{label}: {call} returned {tuple(out.shape)} {out.dtype}, expected "
            f"{(x.shape[0], n_out)} {x.dtype}"
        )
    expected = getattr(oracle, call)(x.double(), oracle.prepare(w))
    ref = getattr(reference, call)(x, reference.prepare(w))
    return check_parity(out, expected, ref, policy=policy, dtype=x.dtype, label=label)


def gate_parity_case(gate: GateContext, w: NVFP4Weight, x: torch.Tensor, *, gated: bool,
                     label: str) -> ParityResult:
    """:func:`parity_case` for the gate's candidate, its family oracle and its baseline."""
    return parity_case(gate.route.name, gate.impl, gate.oracle, gate.baseline, w, x,
                       gated=gated, policy=gate.policy, label=label)


class ScaledReference:
    """Same-dtype reference for weights far from 1: the exactly dequantized weight and the
    activations are scaled by powers of two to unit size, multiplied in the input dtype, and
    scaled back (exact). The family baseline dequantizes straight into fp16, which underflows
    for tiny global scales (the very defect the QPN 2^14 bias exists to avoid), so there it is
    no reference: the parity check would rightly call it unreliable."""

    def prepare(self, w: NVFP4Weight) -> tuple[torch.Tensor, int]:
        dense = dequantize(w, torch.float64)
        return _unit_scaled(dense)

    def linear(self, x: torch.Tensor, prepared: tuple[torch.Tensor, int]) -> torch.Tensor:
        dense, w_shift = prepared
        xs, x_shift = _unit_scaled(x.double())
        y = xs.to(x.dtype) @ dense.to(device=x.device, dtype=x.dtype).T
        return (y.double() * 2.0 ** -(w_shift + x_shift)).to(x.dtype)


def _unit_scaled(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t * 2**shift`` with its largest magnitude in [0.5, 1), and ``shift``."""
    amax = float(t.abs().max())
    shift = -math.frexp(amax)[1] if amax > 0 else 0
    return t * 2.0 ** shift, shift


class GemmPair:
    """Candidate and baseline of one target layer, prepared once, as zero-argument calls."""

    def __init__(self, gate: GateContext, layer: str) -> None:
        self.gate = gate
        self.k, self.n = layer_shape(layer, gate.profile)
        self.m = large_m(gate.profile)
        self.gated = layer == "gate_up"
        self.label = f"{layer} M={self.m} K={self.k} N={self.n}"
        self.w = make_weight(self.n, self.k, seed=gate.seed("speed", layer), device=gate.device)
        self.x = make_x(self.m, self.k, seed=gate.seed("speed", layer, "x"), dtype=gate.dtype,
                        device=gate.device)
        call = "gate_up" if self.gated else "linear"
        impl, baseline = gate.impl, gate.baseline
        cand_w, base_w = impl.prepare(self.w), baseline.prepare(self.w)
        impl_call, base_call = getattr(impl, call), getattr(baseline, call)
        self.candidate = lambda: impl_call(self.x, cand_w)
        self.reference = lambda: base_call(self.x, base_w)

    def check_output(self) -> None:
        """A fast wrong kernel is not a faster route: judge the output before timing it."""
        result = gate_parity_case(self.gate, self.w, self.x, gated=self.gated, label=self.label)
        if not result.ok:
            raise AssertionError(f"wrong output, speed not measured: {result.message()}")

    def workspace(self) -> dict[str, Any]:
        """Peak and bound of the candidate's workspace, when it has one."""
        peak = getattr(self.gate.impl, "workspace_peak_bytes", None)
        if peak is None:
            return {}
        return {"workspace_peak_bytes": peak(self.gate.device),
                "workspace_bound_bytes": self.gate.impl.workspace_bytes}


def check_workspace(measured: dict[str, Any]) -> None:
    """A candidate's workspace peak must lie in (0, its declared bound]."""
    if measured and not 0 < measured["workspace_peak_bytes"] <= measured["workspace_bound_bytes"]:
        raise AssertionError(f"workspace peak outside (0, bound]: {measured}")


def shares_resident_weights(candidate: Any, disabled: Any) -> bool:
    """True when both routes prepare weights with the very same function.

    Their prepared (resident) forms are then the same bytes, and in a stack the candidate reads
    the buffer the verify route already holds: that is the deployment the gate must judge. Two
    separately allocated copies differ in memory placement, a difference that is not the
    candidate's but would be charged to it.
    """
    ours = getattr(getattr(candidate, "prepare", None), "__func__", None)
    theirs = getattr(getattr(disabled, "prepare", None), "__func__", None)
    return ours is not None and ours is theirs


def _verify_step(impl: Any, x: torch.Tensor, gate_up: Any, down: Any) -> Callable[[], Any]:
    return lambda: impl.linear(impl.gate_up(x, gate_up), down)


class VerifySteps:
    """The weights of both routes' verify steps and the step of each width, built alike in the
    gate's process (hit checks) and in each timing worker (timing)."""

    def __init__(self, candidate_name: str, candidate: Any, disabled: Any, *, policy: Policy,
                 profile: str, device: torch.device) -> None:
        self.candidate = as_gemm_route(candidate, candidate_name)
        self.disabled, self.policy, self.device = disabled, policy, device
        self.k_gu, n_gu = layer_shape("gate_up", profile)
        k_down, n_down = layer_shape("down", profile)
        w_gu = make_weight(n_gu, self.k_gu, seed=case_seed(policy, "vc", "gate_up"),
                           device=device)
        w_down = make_weight(n_down, k_down, seed=case_seed(policy, "vc", "down"),
                             device=device)
        self.off = (disabled.prepare(w_gu), disabled.prepare(w_down))
        self.shared = shares_resident_weights(self.candidate, disabled)
        self.on = self.off if self.shared else (self.candidate.prepare(w_gu),
                                                self.candidate.prepare(w_down))

    def steps(self, m: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """(enabled, disabled) verify steps of width ``m``, on the same seeded activations."""
        x = make_x(m, self.k_gu, seed=case_seed(self.policy, "vc", m),
                   dtype=gate_dtype(self.device), device=self.device)
        return (_verify_step(self.candidate, x, *self.on),
                _verify_step(self.disabled, x, *self.off))


def verify_step_pair(ctx: Any, *, candidate: str, disabled: str, m: int) -> Any:
    """Timing-worker builder of the op-level validation-cost gate: the verify step of width
    ``m`` with ``candidate`` on and off, captured as a CUDA graph where it can be (a deployment
    replays its M <= 8 steps as graphs)."""
    from pytest_dflash.measure.timing_pool import TimedPair

    key = (candidate, disabled, ctx.profile, str(ctx.device))
    if _LAST_STEPS.get("key") != key:  # the widths of one gate share their weights
        _LAST_STEPS.clear()
        _LAST_STEPS.update(key=key, built=VerifySteps(
            candidate, ctx.implementation(candidate), ctx.implementation(disabled),
            policy=ctx.policy, profile=ctx.profile, device=ctx.device))
    step_on, step_off = _LAST_STEPS["built"].steps(m)
    return TimedPair(step_on, step_off, graph=True)


# the last gate's prepared weights in a timing worker (one entry: memory stays bounded)
_LAST_STEPS: dict[str, Any] = {}


def speed_pair(ctx: Any, *, route: str, layer: str) -> Any:
    """Timing-worker builder of the gemm.nvfp4 speed gate: one projection at the prefill M,
    candidate and baseline (eager: a prefill chunk is not a graph replay)."""
    from pytest_dflash.measure.timing_pool import TimedPair

    pair = GemmPair(ctx.gate(route, "speed"), layer)
    return TimedPair(pair.candidate, pair.reference)


def run_validation_cost(candidate_name: str, candidate: Any, disabled: Any, *, policy: Policy,
                        profile: str, device: torch.device,
                        record: Callable[..., None],
                        disabled_name: str | None = None,
                        timing: TimingSetup | None = None) -> dict[str, Any]:
    """The op-level validation-cost gate for one candidate (docs/gates.md, "validation_cost").

    ``disabled`` is the family's verify route, what serves M <= 8 with the candidate off. For
    each verify width M one MLP step (gate/up, then down) runs with the candidate on and off:
    the kernels that served it must be identical apart from the candidate's own dispatch
    records, then paired timing must show no regression beyond the noise floor, and the shared
    prefill workspace must not grow. Raises AssertionError naming every failing M, and
    ``TimingInconclusive`` when none fails but some M's interval straddles the noise floor.

    With ``disabled_name`` (the verify route's registry name) each M is timed in the run's
    timing worker processes (``verify_step_pair``); without it, in this process.
    """
    from pytest_dflash.measure.timing import TimingInconclusive, speed_gate
    from pytest_dflash.measure.timing_pool import TimingJob

    built = VerifySteps(candidate_name, candidate, disabled, policy=policy, profile=profile,
                        device=device)
    candidate, shared = built.candidate, built.shared
    peak_fn = getattr(candidate, "workspace_peak_bytes", None)
    peak_before = peak_fn(device) if peak_fn else None

    steps = {}
    route_hits = {}
    for m in range(1, policy.validation_max_m + 1):
        step_on, step_off = built.steps(m)
        # one untimed, uncounted call of each side first: what a route does once per shape
        # (building op arguments, the self-test's per-signature slowdown calibration) is not
        # part of the verify step whose kernels are compared
        step_on()
        step_off()
        with hits.counting() as enabled:
            step_on()
        with hits.counting() as without:
            step_off()
        route_hits[m] = check_same_kernels(candidate_name, enabled, without, f"verify M={m}")
        steps[m] = (step_on, step_off)

    figures, failures, pending, worst = {}, [], [], None
    for m, (step_on, step_off) in steps.items():
        per_m: dict[str, Any] = {}
        job = None if disabled_name is None else TimingJob(
            "dflash_suites.support.gemm:verify_step_pair",
            {"candidate": candidate_name, "disabled": disabled_name, "m": m})
        try:
            result = speed_gate(step_on, step_off, policy=policy, device=device,
                                record=per_m.update, label=f"verify M={m}",
                                rule="no_regression", job=job, timing=timing)
            if worst is None or result.ci_high > worst[1].ci_high:
                worst = (m, result)
        except AssertionError as exc:
            failures.append(str(exc))
        except TimingInconclusive as exc:
            pending.append(str(exc))
        figures[f"m{m}"] = per_m
    peak_after = peak_fn(device) if peak_fn else None
    measurements: dict[str, Any] = {
        "per_m": figures,
        "weights": "one resident copy" if shared else "a copy per route",
        "route_hits": route_hits,
        "workspace_peak_bytes_before": peak_before,
        "workspace_peak_bytes_after": peak_after,
    }
    if failures:
        measurements["figure"] = f"{len(failures)}/{len(steps)} verify widths regressed"
        measurements["decision"] = "fail"
    elif pending:
        measurements["figure"] = (f"{len(pending)}/{len(steps)} verify widths inconclusive, "
                                  "none regressed")
        measurements["decision"] = "inconclusive"
    else:
        m, result = worst
        measurements["figure"] = f"worst M={m}: {result.figure()} (hits identical, M=1..8)"
        measurements["decision"] = "pass"
    record(**measurements)
    if failures:
        raise AssertionError("validation cost exceeded:\n" + "\n".join(failures + pending))
    if peak_before != peak_after:
        raise AssertionError(f"verify steps grew the prefill workspace from {peak_before} to "
                             f"{peak_after} bytes: M <= 8 touched the large-M path")
    if pending:
        raise TimingInconclusive("validation cost inconclusive, route left pending:\n"
                                 + "\n".join(pending))
    return measurements
