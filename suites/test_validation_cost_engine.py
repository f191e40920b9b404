"""Model-level validation-cost gate of families gemm.nvfp4 and linear.gdn (docs/gates.md,
"validation_cost").

The op-level gate (test_validation_cost_gemm.py) times one MLP per verify width; this one times
what speculative decoding pays end to end: after a prefill of the profile's prompt, one
speculative round = whole-model verify steps of M = 1..8 draft rows on the warm cache, with the
candidate enabled vs disabled (disabled = the family's verify route). For every M the kernels
that served the step must be identical apart from the candidate's own dispatch records, the
logits must be finite, and (full profile) the round's CI upper bound, across the run's timing
worker processes (each rebuilds the session's in-process engine; a server engine is timed in
this process), must stay <= 1 + policy.validation_noise_floor. The quick and ci profiles leave
the timing to the op-level gate: bounding whole speculative rounds within 1% on a 2-core CPU
takes minutes.
"""

from __future__ import annotations

import pytest

from dflash_suites.support import check_same_kernels
from dflash_suites.support.engine import speculative_round, verify_drafts

pytestmark = pytest.mark.sm70


# gemm.nvfp4: a prefill GEMM route must leave the M <= 8 verify GEMMs as they were; linear.gdn:
# a prefill route of the gated delta rule must leave verify blocks on the baseline's code
@pytest.mark.gate("validation_cost", family=("gemm.nvfp4", "linear.gdn"))
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
    drafts = verify_drafts(prompt, policy.validation_max_m)
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

    if dflash_gate.profile != "full":
        # a whole speculative round costs ~0.1 s a side on a 2-core CPU and varies by a few
        # percent a round: bounding it within 1% takes 18 processes x dozens of rounds, minutes
        # of the ci main job, so quick/ci leave the timing of every M to the op-level gate and
        # check the whole-model path here
        dflash_gate.record(figure=f"verify M=1..{len(drafts)}: hits identical, logits finite; "
                                  "round timing in the full profile (op-level gate times every M)")
        return
    job = dflash_gate.engine_job("dflash_suites.support.engine:speculative_round_pair",
                                 (enabled, disabled), route=route.name,
                                 verify_route=dflash_gate.verify_route.name, prompt=prompt)
    measured: dict = {}
    try:
        speed_gate(speculative_round(enabled, drafts), speculative_round(disabled, drafts),
                   policy=policy, device=dflash_gate.device, record=measured.update,
                   label=f"speculative round M=1..{len(drafts)}", rule="no_regression",
                   job=job, timing=dflash_gate.timing)
    finally:
        figure = measured.get("figure", "not measured")
        dflash_gate.record(**measured)
        dflash_gate.record(figure=f"speculative round (verify M=1..{len(drafts)}): {figure}; "
                                  f"hits identical")
