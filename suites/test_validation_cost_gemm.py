"""Validation-cost gate of family gemm.nvfp4 (DESIGN 6 "validation_cost").

A large-M prefill route must leave speculative verification untouched: verify steps have
M = 1..8 rows (draft width 7 + 1), and the stack serves them with the QPN2 small-M path. For
each M, one verify step through the MLP (fused gate/up, then down) is run with the candidate
enabled and disabled (disabled = the QPN2 small-M route, the behaviour it must not change):

1. route hits: the kernels that served the step must be identical in both runs. The candidate's
   own dispatch records are set aside (they prove it ran); every other hit must match, so a
   dispatch that sends M <= 8 to the large-M path shows up as ``qpn4_bounded/large_m`` hits
   and fails, before any timing;
2. cost: paired interleaved timing per M, passing only if every M's CI upper bound is
   <= 1 + policy.validation_noise_floor.

The shared prefill workspace's peak is recorded too: at M <= 8 it must not grow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dflash_kernels.gemm import FAMILY, as_gemm_route
from dflash_suites.test_parity_gemm import case_seed, layer_shape, make_weight, make_x
from pytest_dflash import hits
from pytest_dflash.policy import Policy

pytestmark = pytest.mark.sm70

# The route that serves M <= 8 when the candidate is disabled.
SMALL_M_ROUTE = f"{FAMILY}.qpn2"


def _verify_step(impl: Any, x: torch.Tensor, gate_up: Any, down: Any) -> Callable[[], Any]:
    return lambda: impl.linear(impl.gate_up(x, gate_up), down)


def check_same_kernels(candidate: str, enabled: hits.HitDelta, disabled: hits.HitDelta,
                       label: str) -> dict[str, int]:
    """Hits of a verify step with the candidate on must equal those with it off, apart from
    the candidate's own dispatch records (which must exist: it has to have run)."""
    if enabled.route(candidate) == 0:
        raise AssertionError(f"{label}: {candidate} recorded no route hits: it did not run "
                             f"(hits {enabled.as_json()})")
    kernels_on = {key: n for key, n in enabled.counts.items() if key[0] != candidate}
    if kernels_on != disabled.counts:
        on = {f"{r}/{p}": n for (r, p), n in sorted(kernels_on.items())}
        raise AssertionError(
            f"{label}: route hits differ with {candidate} enabled: the verify path changed. "
            f"enabled (own dispatch records aside) {on} vs disabled {disabled.as_json()}"
        )
    return enabled.as_json()


def run_validation_cost(candidate_name: str, candidate: Any, disabled: Any, *, policy: Policy,
                        profile: str, device: torch.device,
                        record: Callable[..., None]) -> dict[str, Any]:
    """The whole gate for one candidate; raises AssertionError naming every failing M."""
    from pytest_dflash.timing import speed_gate

    candidate = as_gemm_route(candidate, candidate_name)
    k_gu, n_gu = layer_shape("gate_up", profile)
    k_down, n_down = layer_shape("down", profile)
    w_gu = make_weight(n_gu, k_gu, seed=case_seed(policy, "vc", "gate_up"), device=device)
    w_down = make_weight(n_down, k_down, seed=case_seed(policy, "vc", "down"), device=device)
    on = (candidate.prepare(w_gu), candidate.prepare(w_down))
    off = (disabled.prepare(w_gu), disabled.prepare(w_down))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    peak_fn = getattr(candidate, "workspace_peak_bytes", None)
    peak_before = peak_fn(device) if peak_fn else None

    steps = {}
    route_hits = {}
    for m in range(1, policy.validation_max_m + 1):
        x = make_x(m, k_gu, seed=case_seed(policy, "vc", m), dtype=dtype, device=device)
        step_on = _verify_step(candidate, x, *on)
        step_off = _verify_step(disabled, x, *off)
        with hits.counting() as enabled:
            step_on()
        with hits.counting() as without:
            step_off()
        route_hits[m] = check_same_kernels(candidate_name, enabled, without, f"verify M={m}")
        steps[m] = (step_on, step_off)

    figures, failures, worst = {}, [], None
    for m, (step_on, step_off) in steps.items():
        per_m: dict[str, Any] = {}
        try:
            result = speed_gate(step_on, step_off, policy=policy, device=device,
                                record=per_m.update, label=f"verify M={m}",
                                rule="no_regression")
            if worst is None or result.ci_high > worst[1].ci_high:
                worst = (m, result)
        except AssertionError as exc:
            failures.append(str(exc))
        figures[f"m{m}"] = per_m
    peak_after = peak_fn(device) if peak_fn else None
    measurements: dict[str, Any] = {
        "per_m": figures,
        "route_hits": route_hits,
        "workspace_peak_bytes_before": peak_before,
        "workspace_peak_bytes_after": peak_after,
    }
    if failures:
        measurements["figure"] = f"{len(failures)}/{len(steps)} verify widths regressed"
    else:
        m, result = worst
        measurements["figure"] = f"worst M={m}: {result.figure()} (hits identical, M=1..8)"
    record(**measurements)
    if failures:
        raise AssertionError("validation cost exceeded:\n" + "\n".join(failures))
    if peak_before != peak_after:
        raise AssertionError(f"verify steps grew the prefill workspace from {peak_before} to "
                             f"{peak_after} bytes: M <= 8 touched the large-M path")
    return measurements


@pytest.mark.gate("validation_cost", family=FAMILY)
def test_gemm_validation_cost_verify_m(dflash_route, dflash_registry, dflash_policy,
                                       dflash_profile, dflash_device, dflash_record):
    """M = 1..8 verify steps: same kernels and no cost regression with the candidate on."""
    disabled = dflash_registry.get(SMALL_M_ROUTE).implementation()
    run_validation_cost(dflash_route.name, dflash_route.implementation(), disabled,
                        policy=dflash_policy, profile=dflash_profile, device=dflash_device,
                        record=dflash_record)
