"""Parity gate of family attn.d256 (DESIGN 5 "attn.d256", DESIGN 6 "parity").

Every candidate is called through the family contract (``dense`` / ``paged`` writing into a
caller-owned ``out``, see ``dflash_kernels.attention``), so another project's route is gated
exactly like the shipped one. Judged against the fp64 oracle with the three-way rule, the
reference being the family baseline (torch SDPA) in the same dtype, and by relative L2:

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

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pytest_dflash import hits
from pytest_dflash.numerics import ParityResult, check_parity, poison_
from pytest_dflash.policy import Policy

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"
D = 256
SCALE = D ** -0.5
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
LONG_T = {"quick": (512,), "ci": (1024, 4096), "full": (2048, 8192)}
PAGED = {"quick": (97, 203), "ci": (301, 1001), "full": (1031, 4099)}  # (Tq, kv_len)
BLOCK_SIZES = (16, 32)


def case_seed(policy: Policy, *parts: object) -> int:
    return (policy.seed + zlib.crc32("/".join(map(str, parts)).encode())) % 2**31


def make_qkv(tq: int, tk: int, hq: int, hkv: int, *, seed: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded inputs without exact zeros (a zero hides a wrong index)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen)
        return torch.where(x == 0, torch.full_like(x, 0.5), x).to(device=device, dtype=dtype)

    return draw(tq, hq, D), draw(tk, hkv, D), draw(tk, hkv, D)


def to_pages(k: torch.Tensor, v: torch.Tensor, block_size: int, *, seed: int):
    """k/v scattered over a paged cache with spare blocks and a shuffled block table."""
    tk, hkv, _ = k.shape
    used = -(-tk // block_size)
    num_blocks = used + 3
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, D, generator=gen).to(k)
    v_cache = torch.randn(num_blocks, block_size, hkv, D, generator=gen).to(v)
    for i, block in enumerate(table.tolist()):
        n = min(block_size, tk - i * block_size)
        k_cache[block, :n] = k[i * block_size : i * block_size + n]
        v_cache[block, :n] = v[i * block_size : i * block_size + n]
    return k_cache, v_cache, table.to(k.device)


class Family:
    """The candidate, the oracle and the same-dtype reference (the family baseline)."""

    def __init__(self, route, registry) -> None:
        self.name = route.name
        self.impl = route.implementation()
        self.oracle = registry.role(FAMILY, "oracle").implementation()
        self.reference = registry.role(FAMILY, "baseline").implementation()
        for obj, what in ((self.impl, route.name), (self.oracle, "oracle"),
                          (self.reference, "baseline")):
            if not all(callable(getattr(obj, op, None)) for op in ("dense", "paged")):
                raise TypeError(f"{what} does not implement the {FAMILY} contract "
                                "(dense(q, k, v, out, scale, causal) and paged(...))")

    def call(self, obj: Any, op: str, q: torch.Tensor, *args: Any) -> torch.Tensor:
        """``obj.op(q, *args)`` with a poisoned ``out`` inserted before (softmax_scale, causal),
        which is where both contract calls take it."""
        out = poison_(torch.empty_like(q))
        getattr(obj, op)(q, *args[:-2], out, *args[-2:])
        return out

    def candidate(self, op: str, q: torch.Tensor, *args: Any, label: str) -> torch.Tensor:
        with hits.counting() as delta:
            out = self.call(self.impl, op, q, *args)
        if delta.as_json() != {f"{self.name}/{op}": 1}:
            raise AssertionError(
                f"{label}: {self.name}.{op} must record exactly one hit on itself, got "
                f"{delta.as_json()} (silent fallback or uncounted call?)")
        return out

    def oracle_of(self, q, k, v, causal) -> torch.Tensor:
        """fp64 attention: the oracle called in fp64 (so nothing is rounded to the test dtype)."""
        return self.call(self.oracle, "dense", q.double(), k.double(), v.double(), SCALE, causal)


class ParityLog:
    """Collects a test's cases; fails with every failing case's message; records the worst."""

    def __init__(self, record: Callable[..., None]) -> None:
        self.record = record
        self.results: list[ParityResult] = []
        self.extra: dict[str, Any] = {}

    def add(self, result: ParityResult) -> None:
        self.results.append(result)

    def finish(self) -> None:
        worst = max(self.results, key=lambda r: r.rel_l2 / r.rel_l2_limit)
        self.record(figure=f"worst {worst.label}: {worst.figure()}", worst=worst.measurements(),
                    cases=[r.measurements() for r in self.results], **self.extra)
        failed = [r.message() for r in self.results if not r.ok]
        if failed:
            raise AssertionError(
                f"{len(failed)}/{len(self.results)} parity cases failed:\n" + "\n".join(failed))


def dense_case(fam: Family, shape: tuple[int, int, int, int], dtype: torch.dtype, causal: bool,
               *, policy: Policy, device: torch.device) -> ParityResult:
    tq, tk, hq, hkv = shape
    q, k, v = make_qkv(tq, tk, hq, hkv, seed=case_seed(policy, "dense", *shape), dtype=dtype,
                       device=device)
    label = f"dense Tq={tq} Tk={tk} Hq={hq} Hkv={hkv} causal={causal}"
    out = fam.candidate("dense", q, k, v, SCALE, causal, label=label)
    ref = fam.call(fam.reference, "dense", q, k, v, SCALE, causal)
    return check_parity(out, fam.oracle_of(q, k, v, causal), ref, policy=policy, dtype=dtype,
                        label=label)


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_parity_edges(dflash_route, dflash_registry, dflash_policy, dflash_device,
                            dflash_record, dtype):
    """Contract edges: GQA 1/2/4, Tq < Tk, odd lengths, a single token, causal and not."""
    fam = Family(dflash_route, dflash_registry)
    log = ParityLog(dflash_record)
    for shape in EDGE_SHAPES:
        log.add(dense_case(fam, shape, dtype, True, policy=dflash_policy, device=dflash_device))
    log.add(dense_case(fam, (65, 200, 4, 2), dtype, False, policy=dflash_policy,
                       device=dflash_device))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_parity_long_prefill(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                                   dflash_device, dflash_record, dtype):
    """Causal prefills at the profile's lengths (Hq=4, Hkv=1): the error must stay within the
    dtype's bound at every length, i.e. not grow with T."""
    fam = Family(dflash_route, dflash_registry)
    log = ParityLog(dflash_record)
    for t in LONG_T[dflash_profile]:
        log.add(dense_case(fam, (t, t, 4, 1), dtype, True, policy=dflash_policy,
                           device=dflash_device))
    log.extra["rel_l2_by_T"] = {str(r.label): r.rel_l2 for r in log.results}
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_parity(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                      dflash_device, dflash_record, dtype, block_size):
    """Paged vs the oracle (three-way rule) and vs the candidate's own dense call on the same
    keys (the paged path must not change the numerics beyond the dense path's bound)."""
    fam = Family(dflash_route, dflash_registry)
    log = ParityLog(dflash_record)
    tq, kv_len = PAGED[dflash_profile]
    for hq, hkv in ((4, 4), (4, 2), (4, 1)):
        seed = case_seed(dflash_policy, "paged", tq, kv_len, hq, hkv, block_size)
        q, k, v = make_qkv(tq, kv_len, hq, hkv, seed=seed, dtype=dtype, device=dflash_device)
        k_cache, v_cache, table = to_pages(k, v, block_size, seed=seed)
        label = f"paged Tq={tq} kv_len={kv_len} Hq={hq} Hkv={hkv} block={block_size}"
        out = fam.candidate("paged", q, k_cache, v_cache, table, kv_len, SCALE, True, label=label)
        dense = fam.candidate("dense", q, k, v, SCALE, True, label=label)
        ref = fam.call(fam.reference, "paged", q, k_cache, v_cache, table, kv_len, SCALE, True)
        oracle = fam.oracle_of(q, k, v, True)
        log.add(check_parity(out, oracle, ref, policy=dflash_policy, dtype=dtype, label=label))
        log.add(check_parity(out, dense.double(), None, policy=dflash_policy, dtype=dtype,
                             label=label + " vs own dense"))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
def test_opcheck(dflash_route, dflash_registry, dflash_policy, dflash_device, dflash_record):
    """``torch.library.opcheck`` (schema incl. the mutated ``out``, fake tensors, dispatch) on
    the dense and paged ops of a route that exposes torch ops; for a route without torch ops the
    contract call itself is checked (exactly one hit, every output element written)."""
    fam = Family(dflash_route, dflash_registry)
    q, k, v = make_qkv(9, 40, 4, 2, seed=case_seed(dflash_policy, "opcheck"),
                       dtype=torch.float32, device=dflash_device)
    k_cache, v_cache, table = to_pages(k, v, 16, seed=1)
    out = poison_(torch.empty_like(q))
    ops = fam.impl.ops() if callable(getattr(fam.impl, "ops", None)) else None
    if ops is None:
        out = fam.candidate("paged", q, k_cache, v_cache, table, 40, SCALE, True, label="opcheck")
        assert torch.isfinite(out).all(), f"{fam.name}.paged left output elements unwritten"
        dflash_record(figure="opcheck n/a (route exposes no torch ops)")
        return
    missing = {"dense", "paged"} - set(ops)
    assert not missing, f"{fam.name}.ops() lacks {sorted(missing)}"
    torch.library.opcheck(ops["dense"].default, (q, k, v, out, SCALE, True))
    torch.library.opcheck(ops["paged"].default, (q, k_cache, v_cache, table, 40, out, SCALE, True))
    dflash_record(figure="opcheck passed: dense, paged")
