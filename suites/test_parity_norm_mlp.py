"""Parity gate of family norm_mlp (docs/library-routes.md): a decoder layer's RMSNorm
(Qwen3.5's zero-centred weight) and the SwiGLU activation of its MLP, against fp64.

Every candidate is called through the family contract (``pytest_dflash.routes.families.NormMlp``)
in the dtypes the layers run in (bf16 and fp16 on a GPU, fp32 on the CPU), rows of a verify
step and of a prefill chunk, and judged by the three-way rule with the baseline's result in the
same dtype as the reference. Every call must record a hit on the candidate.
"""

from __future__ import annotations

import pytest
import torch

from dflash_suites.support import ParityLog, no_zeros
from dflash_suites.support.gdn import gate_dtypes
from pytest_dflash.measure.numerics import check_parity
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70

FAMILY = "norm_mlp"
HIDDEN, INTERMEDIATE = 1024, 3072  # a Qwen3.5 layer's widths, scaled down
ROWS = (1, 8, 513)  # a decode step, a verify block, a prefill chunk with a ragged tail


def _candidate(gate, op: str, *args):
    name = gate.route.name
    with hits.counting() as delta:
        out = getattr(gate.impl, op)(*args)
    assert delta.route(name) > 0, f"{name}.{op} recorded no hit on itself ({delta.as_json()})"
    return out


@pytest.mark.gate("parity", family=FAMILY)
def test_rms_norm_parity(dflash_gate):
    log = ParityLog(dflash_gate.record)
    gen = torch.Generator().manual_seed(dflash_gate.seed("rms_norm"))
    for dtype in gate_dtypes(dflash_gate.device):
        for rows in ROWS:
            x = no_zeros(torch.randn(rows, HIDDEN, generator=gen) * 3).to(dflash_gate.device,
                                                                         dtype)
            weight = (0.1 * torch.randn(HIDDEN, generator=gen)).to(dflash_gate.device, dtype)
            label = f"rms_norm rows={rows} {str(dtype).removeprefix('torch.')}"
            got = _candidate(dflash_gate, "rms_norm", x, weight, 1e-6)
            log.add(check_parity(got, dflash_gate.oracle.rms_norm(x, weight, 1e-6),
                                 dflash_gate.baseline.rms_norm(x, weight, 1e-6),
                                 policy=dflash_gate.policy, dtype=dtype, label=label))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_swiglu_parity(dflash_gate):
    log = ParityLog(dflash_gate.record)
    gen = torch.Generator().manual_seed(dflash_gate.seed("swiglu"))
    for dtype in gate_dtypes(dflash_gate.device):
        for rows in ROWS:
            gate, up = (no_zeros(torch.randn(rows, INTERMEDIATE, generator=gen) * 2)
                        .to(dflash_gate.device, dtype) for _ in range(2))
            label = f"swiglu rows={rows} {str(dtype).removeprefix('torch.')}"
            got = _candidate(dflash_gate, "swiglu", gate, up)
            log.add(check_parity(got, dflash_gate.oracle.swiglu(gate, up),
                                 dflash_gate.baseline.swiglu(gate, up),
                                 policy=dflash_gate.policy, dtype=dtype, label=label))
    log.finish()
