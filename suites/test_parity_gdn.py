"""Parity gate of family linear.gdn (docs/library-routes.md): the gated delta rule and the gated
norm of the gated-DeltaNet layers, against the fp64 oracle (the naive recurrence).

Every candidate is called through the family contract
(``pytest_dflash.routes.families.GatedDeltaRule``) with the arguments Qwen3.5's layer passes
(q/k L2-normalised in the kernel, the final state asked for), in the dtypes the layers run in
(bf16 and fp16 on a GPU, fp32 on the CPU), and judged by the three-way rule with the baseline's
result in the same dtype as the reference; the output and the final state are both judged.
Each case also records flash-linear-attention's own measure (RMS of the difference over RMS of
the reference) next to our bound:

- prefill chunks at lengths around fla's 64-token chunks and at the profile's long lengths
  (capped where the token-by-token oracle gets slow), starting from a state;
- a prefill split at a point inside a 64-token chunk, the second call starting from the first
  call's final state: a route that loses the state at a chunk seam fails here;
- verify blocks and decode steps (M = 1..8 tokens over a state), through ``chunk`` as
  transformers calls it for M > 1 and ``recurrent`` for M = 1;
- the gated RMSNorm of a layer's output.
"""

from __future__ import annotations

import pytest
import torch

from dflash_suites.support import ParityLog
from dflash_suites.support.gdn import (
    DV,
    FLA_ANCHOR,
    MAX_ORACLE_T,
    GdnCalls,
    fla_figures,
    gate_dtypes,
    judge,
    make_inputs,
    split,
)

pytestmark = pytest.mark.sm70

FAMILY = "linear.gdn"
EDGE_T = (63, 64, 65, 200)  # around fla's 64-token chunks
SEAM = (100, 77)  # (first call's tokens, second call's): the seam falls inside a chunk
VERIFY_M = (1, 2, 4, 8)


@pytest.mark.gate("parity", family=FAMILY)
def test_gdn_chunk_parity(dflash_gate):
    """Prefill chunks from a state: edge lengths and the profile's long lengths."""
    calls = GdnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    long_t = tuple(t for t in dflash_gate.sizes.attn_long_t if t <= MAX_ORACLE_T)
    for dtype in gate_dtypes(dflash_gate.device):
        for t in (*EDGE_T, *long_t):
            inputs = make_inputs(t, seed=dflash_gate.seed("gdn chunk", t), dtype=dtype,
                                 device=dflash_gate.device)
            label = f"chunk T={t} {str(dtype).removeprefix('torch.')}"
            got = calls.candidate("chunk", inputs, label=label)
            for result in judge(got, calls.call(calls.oracle, "chunk", inputs),
                                calls.call(calls.reference, "chunk", inputs),
                                gate=dflash_gate, dtype=dtype, label=label):
                log.add(result)
    log.extra.update(fla_figures(log.results, FLA_ANCHOR["chunk"]))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_gdn_state_carried_across_a_seam(dflash_gate):
    """A prefill in two calls, the second from the first's final state, against the oracle of
    the whole sequence in one: the state must be carried across the seam."""
    calls = GdnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    first_t, rest_t = SEAM
    for dtype in gate_dtypes(dflash_gate.device):
        whole = make_inputs(first_t + rest_t, seed=dflash_gate.seed("gdn seam"), dtype=dtype,
                            device=dflash_gate.device)
        first, rest = split(whole, first_t)
        label = f"seam at {first_t} of {first_t + rest_t} {str(dtype).removeprefix('torch.')}"
        out1, state1 = calls.candidate("chunk", first, label=label)
        assert state1 is not None, f"{label}: the candidate returned no final state"
        out2, state2 = calls.candidate("chunk", {**rest, "initial_state": state1}, label=label)
        got = (torch.cat([out1, out2], dim=1), state2)
        ref1, ref_state = calls.call(calls.reference, "chunk", first)
        ref2, ref_final = calls.call(calls.reference, "chunk",
                                     {**rest, "initial_state": ref_state})
        for result in judge(got, calls.call(calls.oracle, "chunk", whole),
                            (torch.cat([ref1, ref2], dim=1), ref_final),
                            gate=dflash_gate, dtype=dtype, label=label):
            log.add(result)
    log.extra.update(fla_figures(log.results, FLA_ANCHOR["chunk"]))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_gdn_verify_parity(dflash_gate):
    """Verify blocks and decode steps over a state: ``chunk`` for M = 2..8 (what transformers
    calls for a verify block) and ``recurrent`` for M = 1 (a decode step)."""
    calls = GdnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    for dtype in gate_dtypes(dflash_gate.device):
        for m in VERIFY_M:
            op = "recurrent" if m == 1 else "chunk"
            inputs = make_inputs(m, seed=dflash_gate.seed("gdn verify", m), dtype=dtype,
                                 device=dflash_gate.device)
            label = f"{op} M={m} {str(dtype).removeprefix('torch.')}"
            got = calls.candidate(op, inputs, label=label)
            for result in judge(got, calls.call(calls.oracle, op, inputs),
                                calls.call(calls.reference, op, inputs),
                                gate=dflash_gate, dtype=dtype, label=label):
                log.add(result)
    log.extra.update(fla_figures(log.results, FLA_ANCHOR["recurrent"]))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_gdn_gated_norm_parity(dflash_gate):
    """The layer's output norm ``rmsnorm(x) * weight * silu(gate)`` over rows of Dv."""
    from pytest_dflash.measure.numerics import check_parity
    from pytest_dflash.native import hits

    name = dflash_gate.route.name
    log = ParityLog(dflash_gate.record)
    gen = torch.Generator().manual_seed(dflash_gate.seed("gdn norm"))
    for dtype in gate_dtypes(dflash_gate.device):
        for rows in (1, 8, 1000):
            x, gate = (torch.randn(rows, DV, generator=gen).to(dflash_gate.device, dtype)
                       for _ in range(2))
            weight = (1 + 0.1 * torch.randn(DV, generator=gen)).to(dflash_gate.device)
            label = f"gated_norm rows={rows} {str(dtype).removeprefix('torch.')}"
            with hits.counting() as delta:
                got = dflash_gate.impl.gated_norm(x, gate, weight, 1e-6)
            assert delta.route(name) > 0, f"{label}: {name} recorded no hit ({delta.as_json()})"
            log.add(check_parity(got, dflash_gate.oracle.gated_norm(x, gate, weight, 1e-6),
                                 dflash_gate.baseline.gated_norm(x, gate, weight, 1e-6),
                                 policy=dflash_gate.policy, dtype=dtype, label=label))
    log.finish()
