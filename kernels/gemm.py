"""The gemm.nvfp4 routes: linear layers whose weights are NVFP4 (docs/families.md).

Every route offers the same calling contract (``GemmRoute``, which is
``pytest_dflash.routes.families.GemmNvfp4``), which the gate suites and the
reference engine use and an outside route of this family must offer too:

- ``prepare(w: NVFP4Weight) -> prepared``: the route's resident form of the weight; call it
  once per weight and keep the result (it is the only place a route may copy the weight);
- ``linear(x [M, K], prepared) -> [M, N]``: ``x @ W^T``; x fp32 or fp16, output in x's dtype;
- ``gate_up(x, prepared) -> [M, N/2]``: ``silu(x @ Wg^T) * (x @ Wu^T)`` for a fused weight
  whose first N/2 rows are the gate and last N/2 rows the up projection.

Every call records route hits under the name of the route whose *code path* ran, so a gate can
prove which kernel served a call. The QPN routes are native ops of the bundled library
(``torch.ops.dflash_qpn``, see ``kernels/csrc/qpn_gemm.cpp`` and :mod:`dflash_kernels.qpn_native`),
called straight from the route with no Python between the dispatcher and the kernel; the ops
count their own hits: ``qpn2_packed_linear`` records its branch under its own name, and the
shared kernel it ran records under ``gemm.nvfp4.qpn2`` (``small_m``) or
``gemm.nvfp4.qpn4_bounded`` (``large_m``):

- ``dflash_qpn::qpn2_linear`` (route qpn2): the small-M kernel, M <= 32 per pass, deterministic
  split-K, fp32 accumulation;
- ``dflash_qpn::qpn4_bounded_linear`` (route qpn4_bounded): N-chunks of the QPN4 view
  dequantized into a bounded workspace, one vendor GEMM per chunk;
- ``dflash_qpn::qpn2_packed_linear`` (route qpn2_packed): the M branch inside the op, calling
  the very functions of the two above, so type-A parity holds by construction.

The torch implementation of the same kernels is :mod:`dflash_kernels.qpn_reference`, used by
tests only. Oracle and turbomind stay torch code: they are the references.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_kernels import qpn_native
from dflash_kernels.nvfp4 import NVFP4Weight, dequantize, validate
from dflash_kernels.qpn import TILE_N, QPNWeight, prepare_qpn2
from dflash_kernels.qpn_native import Workspace, device_key
from pytest_dflash.native import hits
from pytest_dflash.routes.families import GemmNvfp4

FAMILY = "gemm.nvfp4"
# Largest projection of the target deployment in fp16: 5120 x 8704 x 2 bytes = 85 MiB.
DEFAULT_WORKSPACE_BYTES = 5120 * 8704 * 2
# The small-M kernel's row limit, and the verify width (draft 7 + 1) that must never leave it.
QPN2_MAX_M = 32
MAX_VERIFY_M = 8
DEFAULT_MIN_PREFILL_M = QPN2_MAX_M + 1
# K elements per split of the small-M kernel: partial sums of 256 K are reduced in a fixed order.
SPLIT_K = 256


# The calling contract of family gemm.nvfp4, declared with the other family contracts.
GemmRoute = GemmNvfp4


def as_gemm_route(impl: object, route_name: str) -> GemmRoute:
    """Return ``impl`` if it offers the family contract, else raise TypeError naming the gap."""
    missing = [m for m in ("prepare", "linear", "gate_up") if not callable(getattr(impl, m, None))]
    if missing:
        raise TypeError(
            f"route {route_name!r}: implementation {impl!r:.60} lacks {', '.join(missing)}; a "
            f"{FAMILY} route must offer prepare(w), linear(x, prepared), gate_up(x, prepared)"
        )
    return impl  # type: ignore[return-value]


def _check_bound(bound_bytes: int) -> int:
    return qpn_native.check_bound(bound_bytes)


def workspace_bytes_per_tile(k: int, value_bytes: int = 4) -> int:
    """Workspace bytes one 32-column tile of a K-deep weight needs (the smallest valid bound):
    32 x K dequantized values of ``value_bytes`` (4: fp32, what the CPU kernel holds and the
    CUDA kernel for fp32 inputs; 2: fp16, the CUDA kernel for fp16 inputs)."""
    return TILE_N * k * value_bytes


def _check_bound_holds_a_tile(bound_bytes: int, k: int) -> None:
    """Refuse, at prepare time, a bound below one fp32 tile of this weight (the largest tile a
    call can need), so the op never has to raise for it."""
    need = workspace_bytes_per_tile(k)
    if bound_bytes < need:
        raise ValueError(
            f"workspace bound {bound_bytes} bytes is below one 32-column tile of this K = {k} "
            f"weight ({need} bytes); raise workspace_bytes to at least {need}"
        )


@contextmanager
def poisoned_buffers() -> Iterator[None]:
    """Inside this block, every scratch, workspace and output buffer the QPN kernels take is
    filled with 0xFF bytes first (NaN as fp32 and fp16) before use.

    Parity gates run candidates inside it (docs/gates.md, "parity": output buffers poisoned
    before the call),
    so an element a kernel forgot to write fails parity as NaN instead of passing with a
    plausible value left over from the previous call. The flag lives in the native library.
    """
    previous = qpn_native.poison_enabled()
    qpn_native.set_poison(True)
    try:
        yield
    finally:
        qpn_native.set_poison(previous)


def _finish(y: Tensor, n: int, gated: bool, dtype: torch.dtype) -> Tensor:
    """Slice padding away, apply the SiLU gate in y's (high) precision, cast once."""
    y = y[:, :n]
    if gated:
        half = n // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    return y.to(dtype).contiguous()


# ----------------------------------------------------------------------------------------------
# routes


class _Route:
    name: str
    input_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)

    def prepare(self, w: NVFP4Weight) -> Any:
        if not isinstance(w, NVFP4Weight):
            raise TypeError(
                f"{self.name}.prepare takes an NVFP4Weight, got {type(w).__name__}; build one "
                "with dflash_kernels.nvfp4.quantize(weight) or NVFP4Weight(packed, scales, ...)"
            )
        return validate(w)

    def linear(self, x: Tensor, prepared: Any) -> Tensor:
        """``x @ W^T`` as ``[M, N]`` in x's dtype."""
        return self._run(self._check_x(x, prepared), prepared, gated=False)

    def gate_up(self, x: Tensor, prepared: Any) -> Tensor:
        """``silu(x @ Wg^T) * (x @ Wu^T)`` as ``[M, N/2]`` for a fused gate/up weight."""
        _check_gated(self.name, prepared)
        return self._run(self._check_x(x, prepared), prepared, gated=True)

    def _check_x(self, x: Tensor, prepared: Any) -> Tensor:
        return _check_x(self.name, x, prepared, self.input_dtypes)

    def _run(self, x: Tensor, prepared: Any, gated: bool) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _dims(prepared: Any) -> tuple[int, int, torch.device]:
    if isinstance(prepared, NVFP4Weight):
        return prepared.n, prepared.k, prepared.device
    if isinstance(prepared, QPNWeight):
        return prepared.n, prepared.k, prepared.device
    raise TypeError(
        f"prepared weight of type {type(prepared).__name__} is not from this family's "
        "prepare(); call route.prepare(w) once and pass its result"
    )


def _check_x(
    route: str, x: Tensor, prepared: Any, dtypes: tuple[torch.dtype, ...]
) -> Tensor:
    n, k, device = _dims(prepared)
    if not isinstance(x, Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{route}: x must be a 2-D tensor [M, K], got {shape}")
    if x.dtype not in dtypes:
        raise ValueError(
            f"{route}: x has dtype {x.dtype}; this family takes fp32 or fp16 (SM70 has no "
            "bf16): convert with x.float() or x.half()"
        )
    if x.shape[1] != k:
        raise ValueError(f"{route}: x has K = {x.shape[1]} but the weight has K = {k}")
    if x.device != device:
        raise ValueError(f"{route}: x is on {x.device}, the weight on {device}: move one")
    return x


def _check_gated(route: str, prepared: Any) -> int:
    n = _dims(prepared)[0]
    if n % 2:
        raise ValueError(
            f"{route}: gate_up needs a fused weight with even N (first N/2 rows gate, last N/2 "
            f"up), got N = {n}"
        )
    return n


class OracleRoute(_Route):
    """Dequantize exactly (fp64) and multiply in fp64: the reference, never promoted.

    Also takes fp64 x (and then returns fp64), so parity gates compare against an oracle that
    was not rounded to the candidate's output dtype.
    """

    name = f"{FAMILY}.oracle"
    input_dtypes = (torch.float32, torch.float16, torch.float64)

    def _run(self, x: Tensor, w: NVFP4Weight, gated: bool) -> Tensor:
        hits.record(self.name, "fp64")
        y = x.double() @ dequantize(w, torch.float64).T
        return _finish(y, w.n, gated, x.dtype)


class TurbomindRoute(_Route):
    """The baseline: dequantize the whole weight per call into a fresh buffer, then matmul.

    The buffer is fp16 for fp16 inputs (what ships) and fp32 for fp32 inputs. On CPU the fp16
    weights are multiplied in fp32 (same fp16-rounded weights, hence the same numerics as the
    shipped route up to accumulation order): CPU fp16 GEMM is about 6x slower than fp32 and
    would make every candidate look fast for the wrong reason.
    """

    name = f"{FAMILY}.turbomind"

    def _run(self, x: Tensor, w: NVFP4Weight, gated: bool) -> Tensor:
        hits.record(self.name, "dequant")
        if x.dtype != torch.float16:
            y = x @ dequantize(w, torch.float32).T
        elif x.is_cuda:
            y = (x @ dequantize(w, torch.float16).T).float()
        else:
            y = x.float() @ dequantize(w, torch.float16).float().T
        return _finish(y, w.n, gated, x.dtype)


class _NativeOps:
    """The three QPN op handles, bound once the library is loaded (see :func:`_native`)."""

    qpn2: Any = None
    qpn4_bounded: Any = None
    qpn2_packed: Any = None


def _native(device: torch.device) -> type[_NativeOps]:
    """Load the dflash_qpn ops and check they have a kernel for ``device`` (once per weight)."""
    ns = qpn_native.require(device)
    _NativeOps.qpn2 = ns.qpn2_linear.default
    _NativeOps.qpn4_bounded = ns.qpn4_bounded_linear.default
    _NativeOps.qpn2_packed = ns.qpn2_packed_linear.default
    return _NativeOps


class _QPNRoute(_Route):
    def prepare(self, w: NVFP4Weight) -> QPNWeight:
        prepared = prepare_qpn2(super().prepare(w))
        self._op_args(prepared)
        return prepared

    def _op_args(self, w: QPNWeight) -> tuple[Any, ...]:
        """The op's arguments after x and before gated, built once per (route, weight) and
        kept in the weight, so a call pays one dict lookup and the native dispatch."""
        args = w._cache.get(self)
        if args is None:
            _native(w.device)
            args = w._cache[self] = self._build_args(w)
        return args

    def _build_args(self, w: QPNWeight) -> tuple[Any, ...]:
        raise NotImplementedError


class QPN2Route(_QPNRoute):
    """The small-M kernel over QPN2 codes (rows served in passes of 32), the native op
    ``dflash_qpn::qpn2_linear``, as the stack ships its decode/verify GEMV."""

    name = f"{FAMILY}.qpn2"

    def _build_args(self, w: QPNWeight) -> tuple[Any, ...]:
        return (w.buffer, w.scales, w.global_scale, w.n, w.k)

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        return _NativeOps.qpn2(x, *(w._cache.get(self) or self._op_args(w)), gated)


class QPN4BoundedRoute(_QPNRoute):
    """N-chunks of the QPN4 view dequantized into a bounded workspace, one vendor GEMM per
    chunk: the native op ``dflash_qpn::qpn4_bounded_linear``.

    Each route object owns one workspace per device; ``workspace_bytes`` is its bound.
    """

    name = f"{FAMILY}.qpn4_bounded"

    def __init__(self, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        self.workspace_bytes = _check_bound(workspace_bytes)
        self._workspaces: dict[torch.device, Workspace] = {}

    def workspace(self, device: torch.device | str = "cpu") -> Workspace:
        return _workspace_for(self._workspaces, device, self.workspace_bytes)

    def workspace_peak_bytes(self, device: torch.device | str = "cpu") -> int:
        return self.workspace(device).peak_bytes

    def _build_args(self, w: QPNWeight) -> tuple[Any, ...]:
        _check_bound_holds_a_tile(self.workspace_bytes, w.k)
        return (w.buffer, w.scales, w.fp16_prescaled_or_none(), w.global_scale, w.n, w.k,
                self.workspace(w.device).id, self.workspace_bytes)

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        return _NativeOps.qpn4_bounded(x, *(w._cache.get(self) or self._op_args(w)), gated)


def _workspace_for(table: dict[torch.device, Workspace], device: torch.device | str,
                   bound: int) -> Workspace:
    """The workspace of ``device`` in ``table``, created on first use.

    Keyed by the normalised device (``cuda`` and ``cuda:0`` are one device), and also cached
    under the caller's spelling so the per-call lookup by ``x.device`` stays a dict hit.
    """
    raw = torch.device(device)
    found = table.get(raw)
    if found is None:
        key = device_key(raw)
        found = table.get(key)
        if found is None:
            found = table[key] = Workspace(bound, key)
        table[raw] = found
    return found


# ----------------------------------------------------------------------------------------------
# qpn2_packed: one dispatch op with the M branch inside


_SHARED_WORKSPACES: dict[torch.device, Workspace] = {}


def shared_workspace(device: torch.device | str = "cpu") -> Workspace:
    """The one prefill workspace of ``device`` that every qpn2_packed call shares."""
    return _workspace_for(_SHARED_WORKSPACES, device, DEFAULT_WORKSPACE_BYTES)


def _check_min_prefill_m(min_prefill_m: int) -> int:
    if not qpn_native.dispatch_checked():
        return min_prefill_m
    if isinstance(min_prefill_m, bool) or not isinstance(min_prefill_m, int):
        raise ValueError(f"min_prefill_m must be an int, got {min_prefill_m!r}")
    if min_prefill_m <= MAX_VERIFY_M:
        raise ValueError(
            f"min_prefill_m = {min_prefill_m} would send verify steps (M <= {MAX_VERIFY_M}: draft "
            f"width 7 + 1) to the large-M path and change the speculative verification cost; "
            f"use min_prefill_m > {MAX_VERIFY_M} (default {DEFAULT_MIN_PREFILL_M})"
        )
    return min_prefill_m


@contextmanager
def _unchecked_dispatch_for_testing() -> Iterator[None]:
    """Private testing hook: lets a test build the broken dispatch (e.g. min_prefill_m = 1)
    that the validation_cost gate must catch; switches the op's own check off too. Never used
    outside tests."""
    previous = qpn_native.dispatch_checked()
    qpn_native.set_dispatch_checked(False)
    try:
        yield
    finally:
        qpn_native.set_dispatch_checked(previous)


def packed_plan(k: int, min_prefill_m: int, workspace_id: int, workspace_bytes: int,
                global_scale: float) -> Tensor:
    """The ``plan`` argument of ``dflash_qpn::qpn2_packed_linear``: its static dispatch fields in
    one CPU int64 tensor, built once per weight (the global scale as its float64 bits).

    Each argument that crosses ``torch.ops`` costs host time on every call (about 0.2 us each,
    measured); as separate arguments these fields made a verify step through this op cost more
    than through ``qpn2_linear``, which the validation_cost gate then measured as the route's
    regression. With the plan, the op takes as many arguments as ``qpn2_linear`` (7).
    """
    bits = torch.tensor([float(global_scale)], dtype=torch.float64).view(torch.int64)
    fields = torch.tensor([k, min_prefill_m, workspace_id, workspace_bytes], dtype=torch.int64)
    return torch.cat([fields, bits])


class QPN2PackedRoute(_QPNRoute):
    """One dispatch op over the resident QPN2 buffer: M >= min_prefill_m takes the bounded QPN4
    path (zero-copy view, one shared per-device workspace), smaller M the unchanged QPN2 path.

    The M branch lives inside ``torch.ops.dflash_qpn.qpn2_packed_linear`` (C++), never in
    Python around it, so a captured decode graph cannot freeze one branch and a verify step
    pays one native dispatch, as qpn2 does.
    """

    name = f"{FAMILY}.qpn2_packed"

    def __init__(
        self,
        min_prefill_m: int = DEFAULT_MIN_PREFILL_M,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        self.min_prefill_m = _check_min_prefill_m(min_prefill_m)
        self.workspace_bytes = _check_bound(workspace_bytes)

    def workspace_peak_bytes(self, device: torch.device | str = "cpu") -> int:
        return shared_workspace(device).peak_bytes

    def _build_args(self, w: QPNWeight) -> tuple[Any, ...]:
        _check_bound_holds_a_tile(self.workspace_bytes, w.k)
        plan = packed_plan(w.k, self.min_prefill_m, shared_workspace(w.device).id,
                           self.workspace_bytes, w.global_scale)
        return (w.buffer, w.scales, w.fp16_prescaled_or_none(), w.n, plan)

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        return _NativeOps.qpn2_packed(x, *(w._cache.get(self) or self._op_args(w)), gated)


ORACLE = OracleRoute()
TURBOMIND = TurbomindRoute()
QPN2 = QPN2Route()
QPN4_BOUNDED = QPN4BoundedRoute()
QPN2_PACKED = QPN2PackedRoute()
