"""Support for the attn.d256 gates: seeded inputs, paged caches, and contract calls that prove
what ran (one route hit on the candidate itself) into poisoned output buffers.

Every candidate is called through the family contract (``pytest_dflash.routes.families.AttnD256``):
``dense`` / ``paged`` write into a caller-owned ``out``, so another project's route is gated
exactly like the shipped one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from dflash_suites.support import no_zeros
from pytest_dflash.measure.numerics import ParityResult, check_parity, poison_
from pytest_dflash.native import hits

if TYPE_CHECKING:
    from pytest_dflash.measure.gate import GateContext

D = 256
SCALE = D ** -0.5


def make_qkv(tq: int, tk: int, hq: int, hkv: int, *, seed: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded inputs without exact zeros (a zero hides a wrong index)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return no_zeros(torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

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


class AttnCalls:
    """The gate's candidate, oracle and same-dtype reference (the baseline), called through
    the contract into poisoned buffers."""

    def __init__(self, gate: GateContext) -> None:
        self.name = gate.route.name
        self.impl, self.oracle, self.reference = gate.impl, gate.oracle, gate.baseline

    @staticmethod
    def call(obj: Any, op: str, q: torch.Tensor, *args: Any) -> torch.Tensor:
        """``obj.op(q, *args)`` with a poisoned ``out`` inserted before (softmax_scale, causal),
        which is where both contract calls take it."""
        out = poison_(torch.empty_like(q))
        getattr(obj, op)(q, *args[:-2], out, *args[-2:])
        return out

    def candidate(self, op: str, q: torch.Tensor, *args: Any, label: str) -> torch.Tensor:
        """The candidate's call; it must record exactly one hit, on itself."""
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


class CaseGrounds:
    """The oracle's and the baseline's outputs of dense cases, computed once per session.

    A case's inputs come from its seed alone (``make_qkv``), so every candidate of the family
    that a session judges is compared with the same two outputs: computed before the first
    candidate's call (on inputs no candidate has touched) and kept for the others. The fp64
    oracle at the profile's long prefills is most of a route's parity time, and judging several
    routes paid it once per route. At most ``max_bytes`` are kept, the oldest case dropped
    first."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor, torch.Tensor]] = (
            OrderedDict())

    def get(self, calls: AttnCalls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool, case: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(oracle, reference)`` of ``case`` (its seed, shape and dtype) on these inputs."""
        # the implementations by identity (a route's object need not be hashable), kept alive
        # with the entry so that no other object takes their ids while it is kept
        key = (id(calls.oracle), id(calls.reference), str(q.device), causal, *case)
        if key not in self._kept:
            self._kept[key] = ((calls.oracle, calls.reference), calls.oracle_of(q, k, v, causal),
                               calls.call(calls.reference, "dense", q, k, v, SCALE, causal))
            while len(self._kept) > 1 and self._bytes() > self.max_bytes:
                self._kept.popitem(last=False)
        _, oracle, ref = self._kept[key]
        return oracle, ref

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, *pair in self._kept.values()
                   for t in pair)


GROUNDS = CaseGrounds()


def dense_case(gate: GateContext, calls: AttnCalls, shape: tuple[int, int, int, int],
               dtype: torch.dtype, causal: bool) -> ParityResult:
    """One dense case judged against the oracle with the three-way rule."""
    tq, tk, hq, hkv = shape
    seed = gate.seed("dense", *shape)
    q, k, v = make_qkv(tq, tk, hq, hkv, seed=seed, dtype=dtype, device=gate.device)
    label = f"dense Tq={tq} Tk={tk} Hq={hq} Hkv={hkv} causal={causal}"
    oracle, ref = GROUNDS.get(calls, q, k, v, causal, (seed, shape, dtype))
    out = calls.candidate("dense", q, k, v, SCALE, causal, label=label)
    return check_parity(out, oracle, ref, policy=gate.policy, dtype=dtype, label=label)


class SpeedPair:
    """The speed gate's causal prefill of ``t`` tokens (Hq=4, Hkv=1, D=256), candidate and
    baseline writing into their own output buffers, built alike in the gate's process (output
    check) and in each timing worker (timing)."""

    HQ, HKV = 4, 1  # the target deployment's attention layer: GQA 4

    def __init__(self, gate: GateContext, t: int) -> None:
        self.impl, self.base = gate.impl, gate.baseline
        self.dtype = gate.dtype
        gen = torch.Generator().manual_seed(gate.seed("speed", t))
        device = gate.device
        self.q = torch.randn(t, self.HQ, D, generator=gen).to(device, self.dtype)
        self.k = torch.randn(t, self.HKV, D, generator=gen).to(device, self.dtype)
        self.v = torch.randn(t, self.HKV, D, generator=gen).to(device, self.dtype)
        self.out_c, self.out_b = torch.empty_like(self.q), torch.empty_like(self.q)
        self.label = (f"causal prefill T={t} Hq={self.HQ} Hkv={self.HKV} D={D} "
                      f"{str(self.dtype).removeprefix('torch.')}")

    def candidate(self) -> None:
        self.impl.dense(self.q, self.k, self.v, self.out_c, SCALE, True)

    def baseline(self) -> None:
        self.base.dense(self.q, self.k, self.v, self.out_b, SCALE, True)

    def check_output(self, policy: Any) -> None:
        """What is timed is the attention: one call of each into poisoned buffers, compared."""
        poison_(self.out_c)
        poison_(self.out_b)
        self.candidate()
        self.baseline()
        parity = check_parity(self.out_c, self.out_b.double(), None, policy=policy,
                              dtype=self.dtype, label=f"{self.label}: candidate vs baseline")
        assert parity.ok, parity.message()


def speed_pair(ctx: Any, *, route: str, t: int) -> Any:
    """Timing-worker builder of the attn.d256 speed gate: one causal prefill of ``t`` tokens,
    candidate and baseline (eager: a prefill is not a graph replay)."""
    from pytest_dflash.measure.timing_pool import TimedPair

    pair = SpeedPair(ctx.gate(route, "speed"), t)
    return TimedPair(pair.candidate, pair.baseline)
