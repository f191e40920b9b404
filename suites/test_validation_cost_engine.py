"""Model-level validation-cost gate of family gemm.nvfp4 (docs/gates.md, "validation_cost").

The op-level gate (test_validation_cost_gemm.py) times one MLP per verify width; this one times
what speculative decoding pays end to end: after a prefill of the profile's prompt, one
speculative round = whole-model verify steps of M = 1..8 draft rows on the warm cache, with the
candidate enabled vs disabled (disabled = the family's verify route). For every M the kernels
that served the step must be identical apart from the candidate's own dispatch records, the
logits must be finite, and (full profile) the round's CI upper bound must stay <= 1 +
policy.validation_noise_floor. The quick and ci profiles leave the timing to the op-level gate:
a no-regression proof needs up to policy.validation_max_rounds paired rounds, which for whole
speculative rounds would take tens of minutes on a 2-core CPU.
"""

from __future__ import annotations

import pytest

from dflash_suites.support import check_same_kernels

pytestmark = pytest.mark.sm70


@pytest.mark.gate("validation_cost", family="gemm.nvfp4")
def test_validation_cost_engine_verify(dflash_gate):
    import torch

    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.measure.timing import speed_gate
    from pytest_dflash.native import hits

    route, policy = dflash_gate.route, dflash_gate.policy
    enabled = dflash_gate.engine(route.name)
    disabled = dflash_gate.engine(dflash_gate.verify_route.name)
    dflash_gate.require("verify_logits", "route_hits", engines=(enabled, disabled))
    prompt = prompt_ids(dflash_gate.sizes.verify_prompt, enabled.encode)
    for engine in (enabled, disabled):
        engine.prefill(prompt)
    widths = range(1, policy.validation_max_m + 1)
    drafts = [prompt[1 : 1 + m] for m in widths]
    route_hits, max_diff = {}, 0.0
    for draft in drafts:
        m = len(draft)
        with hits.counting() as on:
            logits_on = enabled.verify(draft)
        with hits.counting() as off:
            logits_off = disabled.verify(draft)
        assert tuple(logits_on.shape) == tuple(logits_off.shape) and logits_on.shape[0] == m, (
            f"verify M={m} returned logits of shape {tuple(logits_on.shape)} and "
            f"{tuple(logits_off.shape)}, expected ({m}, vocab)")
        route_hits[f"m{m}"] = check_same_kernels(route.name, on, off, f"engine verify M={m}")
        max_diff = max(max_diff, float((logits_on - logits_off).abs().max()))
    dflash_gate.record(route_hits=route_hits, max_abs_logit_diff=max_diff,
                       prompt_tokens=len(prompt))
    assert torch.isfinite(torch.tensor(max_diff)), f"verify logits are not finite ({max_diff})"

    def round_with(engine):
        return lambda: [engine.verify(d) for d in drafts]

    if dflash_gate.profile != "full":
        # proving "<= 1% slower" takes up to policy.validation_max_rounds paired rounds; of whole
        # speculative rounds that is tens of minutes on a 2-core CPU, so quick/ci rely on the
        # op-level gate for the timing of every M and check the whole-model path here
        dflash_gate.record(figure=f"verify M=1..{len(drafts)}: hits identical, logits finite; "
                                  "round timing in the full profile (op-level gate times every M)")
        return
    measured: dict = {}
    try:
        speed_gate(round_with(enabled), round_with(disabled), policy=policy,
                   device=dflash_gate.device, record=measured.update,
                   label=f"speculative round M=1..{len(drafts)}", rule="no_regression")
    finally:
        figure = measured.get("figure", "not measured")
        dflash_gate.record(**measured)
        dflash_gate.record(figure=f"speculative round (verify M=1..{len(drafts)}): {figure}; "
                                  f"hits identical")
