"""Implementations of the self-test routes: the served route's code with one defect planted.

Each wrapper offers its family's calling contract and records the served route's hits under its
own name (``hits.renamed``), so the gates' route-hit checks see the planted route as the one
that ran, exactly as they see any candidate; hits of shared kernels keep their own names. The
served route's implementation is resolved on first use, so registering the self-test imports
nothing heavy.

A pass-through (``Planted.pass_through``) is the same wrapper with no defect around a verify
route, renaming that route's hits to its own name: it pays the very per-call path a planted
route pays (the ``renamed`` block, the defect checks), so a validation_cost gate comparing a
planted route with it measures the planted defect, not the wrapper.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_dflash.native import hits
from pytest_dflash.routes.registry import Route
from pytest_dflash.selftest.catalogue import (
    ATTN,
    GDN,
    GEMM,
    GEOMETRY,
    PARITY_SCALE,
    SLIP_FACTOR,
    SLIP_SHAPE,
    Planted,
    pass_through_of,
)
from pytest_dflash.selftest.slowdown import Slowdown

if TYPE_CHECKING:
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.routes.registry import RouteRegistry

GROUP_K = 16  # NVFP4 block-scale group: the K granularity a kernel's K loop steps by
MAX_VERIFY_M = 8


class _Wrapper:
    def __init__(self, planted: Planted, registry: RouteRegistry) -> None:
        self.name = planted.name
        self.planted = planted
        self.defect = planted.defect.key if planted.defect else None
        # every wrapper runs its calls through a Slowdown, 0 when nothing is planted: the
        # same host path on both sides of a comparison (slowdown.py)
        self.slowdown = Slowdown((planted.defect.slowdown if planted.defect else None) or 0.0)
        self._registry = registry
        self._impl: Any = None
        self._hits = (planted.serves.name, planted.hits_as)  # read on every call

    @property
    def impl(self) -> Any:
        if self._impl is None:
            self._impl = self.planted.serves.implementation()
        return self._impl

    def _served(self) -> hits.renamed:
        return hits.renamed(*self._hits)

    def __repr__(self) -> str:
        return f"<self-test {self.name}: {self.planted.what}>"


class AttnSelftest(_Wrapper):
    """attn.d256 contract: ``dense`` and ``paged`` writing into ``out``."""

    def dense(self, q, k, v, out, softmax_scale, causal) -> None:
        self._call(q, out, k.shape[1],
                   lambda qq, oo: self.impl.dense(qq, k, v, oo, softmax_scale, causal))

    def paged(self, q, k_cache, v_cache, block_table, kv_len, out, softmax_scale,
              causal) -> None:
        if self.defect == "paged_block_off":
            block_size = k_cache.shape[1]
            last = (int(kv_len) - 1) // block_size
            if kv_len > 0 and last < block_table.shape[0]:
                block_table = block_table.clone()
                block_table[last] = (block_table[last] + 1) % k_cache.shape[0]
        self._call(q, out, k_cache.shape[2],
                   lambda qq, oo: self.impl.paged(qq, k_cache, v_cache, block_table, kv_len, oo,
                                                  softmax_scale, causal))

    def _call(self, q, out, hkv: int, run) -> None:
        saved = out[-1].clone() if self.defect == "row_unwritten" and out.shape[0] else None
        with self._served():
            if self.defect == "gqa_heads":
                self._wrong_heads(q, out, hkv, run)
            else:
                self.slowdown.run(lambda: run(q, out), device=q.device,
                                  signature=(tuple(q.shape), q.dtype))
        if self.defect == "out_scaled":
            out.copy_((out.double() * PARITY_SCALE).to(out.dtype))
        if saved is not None:
            out[-1].copy_(saved)

    @staticmethod
    def _wrong_heads(q, out, hkv: int, run) -> None:
        """Query head h attends with KV head h % Hkv: q's heads are placed in the slots the
        served route maps to that KV head, and the results moved back."""
        import torch

        hq = q.shape[1]
        group = hq // hkv
        slots = torch.tensor([(h % hkv) * group + h // hkv for h in range(hq)], device=q.device)
        q_perm = torch.empty_like(q)
        q_perm[:, slots] = q
        tmp = torch.empty_like(out)
        run(q_perm, tmp)
        out.copy_(tmp[:, slots])


class GdnSelftest(_Wrapper):
    """linear.gdn contract: ``chunk``, ``recurrent``, ``gated_norm``; the gated-delta-rule
    defects act on the arguments the served route gets."""

    def chunk(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False):
        return self._rule("chunk", q, k, v, g, beta, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel)

    def recurrent(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False):
        return self._rule("recurrent", q, k, v, g, beta, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel)

    def gated_norm(self, x, gate, weight, eps):
        with self._served():
            return self.impl.gated_norm(x, gate, weight, eps)

    @property
    def own(self) -> frozenset[str]:
        """The ops the served route serves itself (the engine replaces the gated norm only
        for a route that does)."""
        return frozenset(getattr(self.impl, "own", ("chunk", "recurrent", "gated_norm")))

    @property
    def last_served(self) -> bool:
        return bool(getattr(self.impl, "last_served", True))

    def _rule(self, op, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        if self.defect == "state_not_carried":
            initial_state = None
        if self.defect == "qk_l2norm_dropped":
            l2norm = False
        with self._served():
            run = getattr(self.impl, op)
            return self.slowdown.run(
                lambda: run(q, k, v, g, beta, initial_state, output_final_state, l2norm),
                device=q.device, signature=(op, tuple(q.shape), q.dtype))


class _TwoPaths:
    """The prepared weight of the verify_path defect: the route's form and the other path's."""

    def __init__(self, own: Any, other: Any) -> None:
        self.own, self.other = own, other
        self.n, self.k = getattr(own, "n", None), getattr(own, "k", None)


class GemmSelftest(_Wrapper):
    """gemm.nvfp4 contract: ``prepare``, ``linear``, ``gate_up``."""

    _FORWARDED = ("min_prefill_m", "workspace_bytes", "workspace_peak_bytes", "input_dtypes")

    def __getattr__(self, attr: str) -> Any:
        # only the attributes gates read off a route; never ``ops`` (the wrapper is no torch op)
        if attr in self._FORWARDED:
            return getattr(self.impl, attr)
        raise AttributeError(attr)

    @property
    def other(self) -> Any:
        baseline = self.planted.original.baseline
        assert baseline is not None  # a candidate names its baseline
        return self._registry.get(baseline).implementation()

    @property
    def prepare(self) -> Callable[[Any], Any]:
        """The served route's own bound ``prepare``, unless the defect plants another resident
        form. Whether two routes share resident weights is judged by their prepare function
        (``shares_resident_weights`` in the gemm suites): the wrapper must not hide that the
        planted route keeps its served route's form, or a copy and the pass-through of the
        verify route would be gated with two weight copies where the route itself has one."""
        if self.defect == "verify_path":
            return self._prepare_two_paths
        if self.defect == "scale_slip":
            return self._prepare_slipped
        return self.impl.prepare

    def _prepare_slipped(self, w: Any) -> Any:
        """The served route's resident form of ``w``; the first weight of shape ``SLIP_SHAPE``
        (told apart by its global scale, so every engine, rebuilt anywhere, slips the same
        layer's) gets its block scales read ``SLIP_FACTOR`` times too high (the same as its
        global scale times that)."""
        import dataclasses

        if tuple(w.shape) == SLIP_SHAPE:
            first = self.__dict__.setdefault("_slipped", float(w.global_scale))
            if float(w.global_scale) == first:
                hits.record(self.name, "scale_slip")
                w = dataclasses.replace(w, global_scale=first * SLIP_FACTOR)
        return self.impl.prepare(w)

    def _prepare_two_paths(self, w: Any) -> _TwoPaths:
        return _TwoPaths(self.impl.prepare(w), self.other.prepare(w))

    def linear(self, x, prepared):
        return self._call("linear", x, prepared)

    def gate_up(self, x, prepared):
        return self._call("gate_up", x, prepared)

    def _call(self, call: str, x, prepared):
        import torch

        if self.defect == "verify_path":
            if x.shape[0] <= MAX_VERIFY_M:
                hits.record(self.name, "dispatch_other_path")
                return getattr(self.other, call)(x, prepared.other)
            prepared = prepared.own
        if self.defect == "k_group_dropped":
            x = x.clone()
            x[:, -GROUP_K:] = 0
        with self._served():
            run = getattr(self.impl, call)
            signature = (call, tuple(x.shape), x.dtype, getattr(prepared, "n", None))
            y = self.slowdown.run(lambda: run(x, prepared), device=x.device, signature=signature)
        if self.defect == "out_scaled":
            y = (y.double() * PARITY_SCALE).to(y.dtype)
        elif self.defect == "row_unwritten" and y.shape[0]:
            y = y.clone()
            y[-1] = torch.nan  # the gates poison outputs: an unwritten row reads NaN
        return y


def implementation_for(planted: Planted, registry: RouteRegistry, policy: Policy) -> Any:
    """The ``impl`` of a planted route's record.

    prefill.geometry routes act through the engine (``selftest.engine``), so their record keeps
    the served geometry itself: the planted behaviour is added by the engine wrapper.
    """
    del policy  # sizes are fixed in the catalogue entries
    family = planted.original.family
    if family == ATTN:
        return AttnSelftest(planted, registry)
    if family == GEMM:
        return GemmSelftest(planted, registry)
    if family == GDN:
        return GdnSelftest(planted, registry)
    if family == GEOMETRY:
        return planted.serves.impl
    raise ValueError(f"the self-test has no catalogue for family {family!r}")


def as_route(planted: Planted, registry: RouteRegistry, policy: Policy) -> Route:
    """The ordinary route record of a planted route (implementation wrapped lazily)."""
    original = planted.original
    if planted.defect is None and not planted.pass_through:
        # the unchanged copy is an A/A control: the very same implementation, nothing added to
        # its calls; its route hits are the original's, booked as the copy's per gate test
        return Route(
            planted.name, original.family, "candidate", baseline=original.baseline
            or registry.family_of(original.family).baseline, gates=planted.gates,
            impl=original.impl, engine={family: planted.name if name == original.name else name
                                        for family, name in original.engine.items()},
            probe=original.probe,
            switch=re.sub(r"\W", "_", f"DFLASH_SELFTEST_{planted.name}").upper(),
            description=f"self-test of {original.name}: {planted.what}",
            verify_route=original.verify_route, hit_source=original.name)
    if planted.pass_through:  # a comparator of the planted routes' gates, never judged itself
        return Route(planted.name, original.family, "baseline",
                     impl=implementation_for(planted, registry, policy), probe=original.probe,
                     description=f"self-test: {original.name} behind the planted routes' wrapper")
    engine = {family: planted.name if name == original.name else name
              for family, name in original.engine.items()}
    return Route(
        planted.name, original.family, "candidate",
        baseline=original.baseline or registry.family_of(original.family).baseline,
        gates=planted.gates, impl=implementation_for(planted, registry, policy), engine=engine,
        probe=original.probe, switch=re.sub(r"\W", "_", f"DFLASH_SELFTEST_{planted.name}").upper(),
        description=f"self-test of {original.name}: {planted.what}",
        verify_route=pass_through_of(planted, registry))
