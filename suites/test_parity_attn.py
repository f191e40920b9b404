"""Parity gate of family attn.d256 (docs/gates.md, "parity").

Every candidate is called through the family contract (``dense`` / ``paged`` writing into a
caller-owned ``out``, ``pytest_dflash.routes.families.AttnD256``), so another project's route is
gated
exactly like the shipped one. Judged against the fp64 oracle with the three-way rule, the
reference being the candidate's baseline in the same dtype, and by relative L2:

- GQA ratios 1, 2 and 4; Tq < Tk (a prefill continuing a cached prefix, bottom-right causal);
  odd lengths at the tile edges; fp32 and fp16; a non-causal case;
- paged caches with block sizes 16 and 32 (shuffled block tables, last block partly used),
  judged like dense and compared with the candidate's own dense result on the same keys;
- long causal prefills whose error must stay at the dtype's level as T grows;
- ``torch.library.opcheck`` on both ops for routes that expose torch ops.

Output buffers are poisoned (NaN) before every call, inputs are seeded and have no zeros, and
every call must record a route hit on the candidate itself.
"""

from __future__ import annotations

import pytest
import torch

from dflash_suites.support import ParityLog
from dflash_suites.support.attn import SCALE, AttnCalls, dense_case, make_qkv, to_pages
from pytest_dflash.measure.numerics import check_parity, poison_

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"
DTYPES = (torch.float32, torch.float16)
# (Tq, Tk, Hq, Hkv): GQA 1/2/4, prefix (Tq < Tk), odd lengths around the 64-row query tile
# and the key tiles, a single token.
EDGE_SHAPES = (
    (1, 1, 4, 1),
    (1, 77, 4, 2),
    (17, 17, 4, 4),
    (63, 130, 4, 2),
    (65, 65, 4, 1),
    (129, 700, 8, 2),
    (257, 257, 4, 4),
)
BLOCK_SIZES = (16, 32)


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_parity_edges(dflash_gate, dtype):
    """Contract edges: GQA 1/2/4, Tq < Tk, odd lengths, a single token, causal and not."""
    calls = AttnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    for shape in EDGE_SHAPES:
        log.add(dense_case(dflash_gate, calls, shape, dtype, True))
    log.add(dense_case(dflash_gate, calls, (65, 200, 4, 2), dtype, False))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_parity_long_prefill(dflash_gate, dtype):
    """Causal prefills at the profile's lengths (Hq=4, Hkv=1): the error must stay within the
    dtype's bound at every length, i.e. not grow with T."""
    calls = AttnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    for t in dflash_gate.sizes.attn_long_t:
        log.add(dense_case(dflash_gate, calls, (t, t, 4, 1), dtype, True))
    log.extra["rel_l2_by_T"] = {str(r.label): r.rel_l2 for r in log.results}
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_parity(dflash_gate, dtype, block_size):
    """Paged vs the oracle (three-way rule) and vs the candidate's own dense call on the same
    keys (the paged path must not change the numerics beyond the dense path's bound)."""
    calls = AttnCalls(dflash_gate)
    log = ParityLog(dflash_gate.record)
    policy = dflash_gate.policy
    tq, kv_len = dflash_gate.sizes.attn_paged
    for hq, hkv in ((4, 4), (4, 2), (4, 1)):
        seed = dflash_gate.seed("paged", tq, kv_len, hq, hkv, block_size)
        q, k, v = make_qkv(tq, kv_len, hq, hkv, seed=seed, dtype=dtype, device=dflash_gate.device)
        k_cache, v_cache, table = to_pages(k, v, block_size, seed=seed)
        label = f"paged Tq={tq} kv_len={kv_len} Hq={hq} Hkv={hkv} block={block_size}"
        out = calls.candidate("paged", q, k_cache, v_cache, table, kv_len, SCALE, True,
                              label=label)
        dense = calls.candidate("dense", q, k, v, SCALE, True, label=label)
        ref = calls.call(calls.reference, "paged", q, k_cache, v_cache, table, kv_len, SCALE,
                         True)
        oracle = calls.oracle_of(q, k, v, True)
        log.add(check_parity(out, oracle, ref, policy=policy, dtype=dtype, label=label))
        # the candidate's own dense result is the yardstick here: a NaN in it is the candidate's
        # failure (judged below against the oracle by the dense tests), not a broken oracle
        assert torch.isfinite(dense).all(), (
            f"{label}: the candidate's own dense output has "
            f"{int((~torch.isfinite(dense)).sum())} NaN/Inf elements")
        log.add(check_parity(out, dense.double(), None, policy=policy, dtype=dtype,
                             label=label + " vs own dense"))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_opcheck(dflash_gate):
    """``torch.library.opcheck`` (schema incl. the mutated ``out``, fake tensors, dispatch) on
    the dense and paged ops of a route that exposes torch ops; for a route without torch ops the
    contract call itself is checked (exactly one hit, every output element written)."""
    calls = AttnCalls(dflash_gate)
    q, k, v = make_qkv(9, 40, 4, 2, seed=dflash_gate.seed("opcheck"), dtype=torch.float32,
                       device=dflash_gate.device)
    k_cache, v_cache, table = to_pages(k, v, 16, seed=1)
    out = poison_(torch.empty_like(q))
    ops = calls.impl.ops() if callable(getattr(calls.impl, "ops", None)) else None
    if ops is None:
        out = calls.candidate("paged", q, k_cache, v_cache, table, 40, SCALE, True,
                              label="opcheck")
        assert torch.isfinite(out).all(), f"{calls.name}.paged left output elements unwritten"
        dflash_gate.record(figure="opcheck n/a (route exposes no torch ops)")
        return
    missing = {"dense", "paged"} - set(ops)
    assert not missing, f"{calls.name}.ops() lacks {sorted(missing)}"
    torch.library.opcheck(ops["dense"].default, (q, k, v, out, SCALE, True))
    torch.library.opcheck(ops["paged"].default, (q, k_cache, v_cache, table, 40, out, SCALE, True))
    dflash_gate.record(figure="opcheck passed: dense, paged")
