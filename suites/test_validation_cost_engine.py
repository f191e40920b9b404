"""Model-level validation-cost gate of family gemm.nvfp4 (DESIGN 6 "validation_cost").

The op-level gate (test_validation_cost_gemm.py) times one MLP; this one times what speculative
decoding pays: after a prefill of the profile's prompt, whole-model verify steps of M = 1..8 draft
rows on the warm cache, with the candidate enabled vs disabled (disabled = the stack's small-M
route). The kernels that served each step must be identical apart from the candidate's own
dispatch records, and every M's CI upper bound must stay <= 1 + policy.validation_noise_floor.
"""

from __future__ import annotations

import pytest

from dflash_suites.test_validation_cost_gemm import SMALL_M_ROUTE, check_same_kernels

pytestmark = pytest.mark.sm70


@pytest.mark.gate("validation_cost", family="gemm.nvfp4")
def test_validation_cost_engine_verify(dflash_route, dflash_registry, dflash_engine,
                                       dflash_policy, dflash_profile, dflash_device,
                                       dflash_record):
    from pytest_dflash import hits
    from pytest_dflash.engines.data import prompt_ids, sizes
    from pytest_dflash.timing import speed_gate

    enabled = dflash_engine(dflash_registry.engine_selection([dflash_route.name]))
    disabled = dflash_engine(dflash_registry.engine_selection([SMALL_M_ROUTE]))
    prompt = prompt_ids(sizes(dflash_profile).verify_prompt)
    first = {e.prefill(prompt).first_token for e in (enabled, disabled)}
    draft_source = prompt[1 : 1 + dflash_policy.validation_max_m]
    per_m, route_hits, failures, worst = {}, {}, [], None
    for m in range(1, dflash_policy.validation_max_m + 1):
        draft = draft_source[:m]
        with hits.counting() as on:
            logits_on = enabled.verify(draft)
        with hits.counting() as off:
            logits_off = disabled.verify(draft)
        assert tuple(logits_on.shape) == tuple(logits_off.shape) == (m, logits_on.shape[1]), (
            f"verify M={m} returned logits of shape {tuple(logits_on.shape)} and "
            f"{tuple(logits_off.shape)}, expected ({m}, vocab)")
        route_hits[m] = check_same_kernels(dflash_route.name, on, off, f"engine verify M={m}")
        measured: dict = {}
        try:
            result = speed_gate(lambda d=draft: enabled.verify(d),
                                lambda d=draft: disabled.verify(d),
                                policy=dflash_policy, device=dflash_device,
                                record=measured.update, label=f"engine verify M={m}",
                                rule="no_regression")
            if worst is None or result.ci_high > worst[1].ci_high:
                worst = (m, result)
        except AssertionError as exc:
            failures.append(str(exc))
        per_m[f"m{m}"] = measured
    figure = (f"{len(failures)}/{dflash_policy.validation_max_m} verify widths regressed"
              if failures else
              f"worst M={worst[0]}: {worst[1].figure()} (whole-model verify, hits identical)")
    dflash_record(figure=figure, per_m=per_m, route_hits=route_hits,
                  prompt_tokens=len(prompt), same_first_token=len(first) == 1)
    if failures:
        raise AssertionError("engine validation cost exceeded:\n" + "\n".join(failures))
