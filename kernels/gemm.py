"""The gemm.nvfp4 routes: linear layers whose weights are NVFP4 (DESIGN 5, "gemm.nvfp4 routes").

Every route offers the same calling contract (:class:`GemmRoute`), which the gate suites and the
reference engine use and an outside route of this family must offer too:

- ``prepare(w: NVFP4Weight) -> prepared``: the route's resident form of the weight; call it
  once per weight and keep the result (it is the only place a route may copy the weight);
- ``linear(x [M, K], prepared) -> [M, N]``: ``x @ W^T``; x fp32 or fp16, output in x's dtype;
- ``gate_up(x, prepared) -> [M, N/2]``: ``silu(x @ Wg^T) * (x @ Wu^T)`` for a fused weight
  whose first N/2 rows are the gate and last N/2 rows the up projection.

Every call records route hits (``pytest_dflash.hits.record(route, path)``) under the name of the
route whose *code path* ran, so a gate can prove which kernel served a call: the qpn2_packed
dispatch op records its branch under its own name, and the shared kernel it ran records under
``gemm.nvfp4.qpn2`` (``small_m``) or ``gemm.nvfp4.qpn4_bounded`` (``large_m``).

Two paths are registered torch ops, as they are in the shipped stack: the small-M path
``dflash_gemm::qpn2_linear`` (route qpn2) and the dispatch op ``dflash_gemm::qpn2_packed_linear``
(route qpn2_packed), whose M branch lives inside the op. Both are Python kernels registered
with ``torch.library.Library`` (about 6-10 us of dispatcher cost per call on this CPU).

This is a torch reference implementation for every device. The QPN routes' dequantized values
and matmuls are fp32 on every device (a GPU kernel would hold fp16 in the workspace and remove the
2^14 bias from its fp32 accumulators; on this CPU an fp16 GEMM is about 6x slower than fp32,
which would only measure torch's fp16 CPU kernels). Accumulation is fp32 for both input
dtypes; the output is cast to x's dtype once, at the end. On a GPU the speed gates therefore
time this reference, not a native kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_kernels.nvfp4 import GROUP_K, NVFP4Weight, dequantize, e2m1_table, validate
from dflash_kernels.qpn import (
    BYTES_PER_GROUP_COLUMN,
    FP16_SCALE_BIAS,
    TILE_N,
    QPNWeight,
    prepare_qpn2,
    tile_view,
)
from pytest_dflash import hits

FAMILY = "gemm.nvfp4"
# Largest projection of the target deployment in fp16: 5120 x 8704 x 2 bytes = 85 MiB.
DEFAULT_WORKSPACE_BYTES = 5120 * 8704 * 2
# The small-M kernel's row limit, and the verify width (draft 7 + 1) that must never leave it.
QPN2_MAX_M = 32
MAX_VERIFY_M = 8
DEFAULT_MIN_PREFILL_M = QPN2_MAX_M + 1
# K elements per split of the small-M path: partial sums of 256 K are reduced in a fixed order.
SPLIT_K = 256
# Workspace bytes per (tile, group): 32 x 16 fp32 values + 32 x 8 int32 byte indices.
_WORKSPACE_BYTES_PER_TILE_GROUP = TILE_N * GROUP_K * 4 + TILE_N * BYTES_PER_GROUP_COLUMN * 4


@runtime_checkable
class GemmRoute(Protocol):
    """The calling contract of family gemm.nvfp4 (see the module docstring)."""

    name: str

    def prepare(self, w: NVFP4Weight) -> Any: ...

    def linear(self, x: Tensor, prepared: Any) -> Tensor: ...

    def gate_up(self, x: Tensor, prepared: Any) -> Tensor: ...


def as_gemm_route(impl: object, route_name: str) -> GemmRoute:
    """Return ``impl`` if it offers the family contract, else raise TypeError naming the gap."""
    missing = [m for m in ("prepare", "linear", "gate_up") if not callable(getattr(impl, m, None))]
    if missing:
        raise TypeError(
            f"route {route_name!r}: implementation {impl!r:.60} lacks {', '.join(missing)}; a "
            f"{FAMILY} route must offer prepare(w), linear(x, prepared), gate_up(x, prepared)"
        )
    return impl  # type: ignore[return-value]


class Workspace:
    """Scratch bytes of the bounded prefill path; grows lazily, never beyond ``bound_bytes``.

    ``peak_bytes`` is the largest storage ever held, so a gate can assert the bound from a real
    run instead of trusting the chunking arithmetic.
    """

    def __init__(self, bound_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        self.bound_bytes = _check_bound(bound_bytes)
        self.peak_bytes = 0
        self._storage: Tensor | None = None

    def set_bound(self, bound_bytes: int) -> None:
        self.bound_bytes = _check_bound(bound_bytes)
        if self._storage is not None and self._storage.numel() > self.bound_bytes:
            self._storage = None

    def take(self, nbytes: int, device: torch.device) -> Tensor:
        """uint8 ``[nbytes]`` scratch; contents are garbage."""
        if nbytes > self.bound_bytes:
            raise RuntimeError(
                f"workspace request of {nbytes} bytes exceeds its bound {self.bound_bytes}: "
                "the chunking must be derived from the bound (this is a bug in the route)"
            )
        storage = self._storage
        if storage is None or storage.numel() < nbytes or storage.device != device:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._storage = storage
            self.peak_bytes = max(self.peak_bytes, nbytes)
        return storage[:nbytes]

    def reset_peak(self) -> None:
        self.peak_bytes = self._storage.numel() if self._storage is not None else 0


def _check_bound(bound_bytes: int) -> int:
    if isinstance(bound_bytes, bool) or not isinstance(bound_bytes, int) or bound_bytes <= 0:
        raise ValueError(f"workspace bound must be a positive int of bytes, got {bound_bytes!r}")
    return bound_bytes


def workspace_bytes_per_tile(k: int) -> int:
    """Workspace bytes one 32-column tile of a K-deep weight needs (the smallest valid bound)."""
    return (k // GROUP_K) * _WORKSPACE_BYTES_PER_TILE_GROUP


# ----------------------------------------------------------------------------------------------
# shared kernels


_poison_buffers = False


@contextmanager
def poisoned_buffers() -> Iterator[None]:
    """Inside this block, every scratch, workspace and output buffer the QPN kernels take is
    filled with 0xFF bytes first (NaN as fp32, -1 as an index) before use.

    Parity gates run candidates inside it (DESIGN 6: output buffers poisoned before the call),
    so an element a kernel forgot to write fails parity as NaN, and a stale index raises,
    instead of passing with a plausible value left over from the previous call.
    """
    global _poison_buffers
    previous, _poison_buffers = _poison_buffers, True
    try:
        yield
    finally:
        _poison_buffers = previous


def _poisoned(buffer: Tensor) -> Tensor:
    if _poison_buffers:
        buffer.view(torch.uint8).fill_(0xFF)
    return buffer


_lut_lock = threading.Lock()
_LUT_PAIRS: dict[torch.device, Tensor] = {}
_E4M3_VALUES: dict[torch.device, Tensor] = {}


def _lut_pairs(device: torch.device) -> Tensor:
    """int64 ``[256]``: for every byte, its two E2M1 values (low nibble, high nibble) as an
    fp32 pair, reinterpreted as one 8-byte integer.

    One gather of 8 bytes per code byte replaces unpack + per-code lookup + interleave; a 1-D
    int64 table gathers about 4x faster on CPU than the same table as ``[256, 2]`` fp32 rows.
    """
    with _lut_lock:
        table = _LUT_PAIRS.get(device)
        if table is None:
            values = e2m1_table(torch.float32, device)
            byte = torch.arange(256, device=device)
            pairs = torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=1).contiguous()
            table = pairs.view(torch.int64).view(256)
            _LUT_PAIRS[device] = table
        return table


def _e4m3_fp32(raw: Tensor) -> Tensor:
    """fp32 values of raw E4M3 scale bytes (any shape), through a 256-entry table.

    The table is torch's own float8_e4m3fn conversion of every byte; a gather through it is
    about 10x faster on CPU than converting a float8 tensor, which matters at M <= 8.
    """
    with _lut_lock:
        table = _E4M3_VALUES.get(raw.device)
        if table is None:
            byte = torch.arange(256, dtype=torch.uint8, device=raw.device)
            table = byte.view(torch.float8_e4m3fn).float()
            _E4M3_VALUES[raw.device] = table
    return torch.index_select(table, 0, raw.reshape(-1).int()).view(raw.shape)


def _decode_tiles(codes: Tensor, scales: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """Dequantize tiles ``codes [t, g, 32, 8]`` with ``scales [t, g, 32]`` (fp32) into
    ``values`` and return them as ``[t * 32, g * 16]`` (row = column n, K contiguous).

    ``index`` (int32) and ``values`` (fp32) are caller-owned scratch of the exact sizes, so the
    bounded path can place them in its workspace. ``code value * scale`` is exact in fp32.
    """
    t, g = codes.shape[0], codes.shape[1]
    index.view(t, TILE_N, g, BYTES_PER_GROUP_COLUMN).copy_(codes.permute(0, 2, 1, 3))
    torch.index_select(_lut_pairs(codes.device), 0, index, out=values.view(torch.int64))
    values.view(t, TILE_N, g, GROUP_K).mul_(scales.permute(0, 2, 1).unsqueeze(-1))
    return values.view(t * TILE_N, g * GROUP_K)


_scratch_local = threading.local()


def _small_m_scratch(nbytes: int, device: torch.device) -> Tensor:
    """Per-thread, per-device scratch of the small-M path, kept between calls.

    Allocating a fresh megabyte or two per call costs page faults that are a visible share
    of an M <= 8 call on CPU and make its time jitter; the split-K slice is bounded by
    ``SPLIT_K``, so this stays at most ``Np * SPLIT_K * 6`` bytes.
    """
    buffers = getattr(_scratch_local, "buffers", None)
    if buffers is None:
        buffers = _scratch_local.buffers = {}
    buf = buffers.get(device)
    if buf is None or buf.numel() < nbytes:
        buf = buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]


def _qpn2_small_m(x32: Tensor, codes: Tensor, scales: Tensor, global_scale: float) -> Tensor:
    """The small-M kernel: fp32 ``[M, Np]`` from QPN2 codes and raw E4M3 scale bytes.

    ``codes``: the QPN2 view as tiles ``[T, G, 32, 8]``; ``scales``: raw bytes ``[T, G, 32]``.
    Rows are served in blocks of at most 32 (the kernel's M contract). K is split into
    ``SPLIT_K`` slices; each slice's partial product is accumulated into the output in slice
    order, a fixed reduction order, so the result is deterministic. The global scale is
    applied in fp32 at the end. Plain tensors in, no wrapper objects: this is the verify path,
    where every microsecond of overhead shows in the validation_cost gate.
    """
    m, device = x32.shape[0], x32.device
    tiles, groups = codes.shape[0], codes.shape[1]
    n_padded = tiles * TILE_N
    scales32 = _e4m3_fp32(scales)
    split_groups = SPLIT_K // GROUP_K
    width = min(split_groups, groups)
    n_index = n_padded * width * BYTES_PER_GROUP_COLUMN
    scratch = _poisoned(_small_m_scratch(6 * 4 * n_index // 2, device))  # int32 idx + fp32 values
    index = scratch[: 4 * n_index].view(torch.int32)
    values = scratch[4 * n_index :].view(torch.float32)
    out = torch.zeros(m, n_padded, dtype=torch.float32, device=device)
    for r0 in range(0, m, QPN2_MAX_M):
        hits.record(QPN2.name, "small_m")
        rows = x32[r0 : r0 + QPN2_MAX_M]
        acc = out[r0 : r0 + QPN2_MAX_M]
        for g0 in range(0, groups, split_groups):
            g1 = min(groups, g0 + split_groups)
            n_idx = n_padded * (g1 - g0) * BYTES_PER_GROUP_COLUMN
            part = _decode_tiles(codes[:, g0:g1], scales32[:, g0:g1], index[:n_idx],
                                 values[: 2 * n_idx])
            acc.addmm_(rows[:, g0 * GROUP_K : g1 * GROUP_K], part.T)
    return out.mul_(global_scale)


def _prefill_scales(x: Tensor, w: QPNWeight) -> Tensor | None:
    """fp16 inputs use the fp16 pre-scaled scales (what an fp16 kernel consumes) when they are
    representable; otherwise (fp32 inputs, or weights whose scales overflow fp16) None: raw E4M3
    with the global scale in fp32."""
    return w.fp16_prescaled_or_none() if x.dtype == torch.float16 else None


def _qpn4_bounded_large_m(
    x32: Tensor,
    codes: Tensor,
    scales: Tensor,
    scales_fp16: Tensor | None,
    global_scale: float,
    workspace: Workspace,
) -> Tensor:
    """The large-M kernel: fp32 ``[M, Np]`` from the QPN4 view, chunk of tiles by chunk.

    ``codes``: the QPN4 view as tiles ``[T, G, 32, 8]``; ``scales``: raw E4M3 bytes
    ``[T, G, 32]``, used with the global scale unless ``scales_fp16`` (pre-scaled, 2^14 bias)
    is given. A chunk is as many whole 32-column tiles as the workspace bound holds (values and
    byte indices both live in the workspace); each chunk is dequantized and multiplied straight
    into its output columns. The bias or the global scale is removed in fp32 at the end.
    """
    hits.record(QPN4_BOUNDED.name, "large_m")
    tiles, groups = codes.shape[0], codes.shape[1]
    k = groups * GROUP_K
    per_tile = workspace_bytes_per_tile(k)
    tiles_per_chunk = min(tiles, workspace.bound_bytes // per_tile)
    if tiles_per_chunk < 1:
        raise ValueError(
            f"workspace bound {workspace.bound_bytes} bytes is below one 32-column tile of this "
            f"K = {k} weight ({per_tile} bytes); raise workspace_bytes to at least {per_tile}"
        )
    if scales_fp16 is not None:
        scales32, unscale = scales_fp16.float(), 1.0 / FP16_SCALE_BIAS
    else:
        scales32, unscale = _e4m3_fp32(scales), global_scale
    n_values = tiles_per_chunk * TILE_N * k
    storage = _poisoned(workspace.take(tiles_per_chunk * per_tile, x32.device))
    values_all = storage[: 4 * n_values].view(torch.float32)
    index_all = storage[4 * n_values :].view(torch.int32)
    out = _poisoned(torch.empty(x32.shape[0], tiles * TILE_N, dtype=torch.float32,
                                device=x32.device))
    for t0 in range(0, tiles, tiles_per_chunk):
        t1 = min(tiles, t0 + tiles_per_chunk)
        count = (t1 - t0) * TILE_N * k
        chunk = _decode_tiles(codes[t0:t1], scales32[t0:t1], index_all[: count // 2],
                              values_all[:count])
        torch.mm(x32, chunk.T, out=out[:, t0 * TILE_N : t1 * TILE_N])
    return out.mul_(unscale)


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


class QPN2Route(_Route):
    """The small-M path over QPN2 codes (rows served in blocks of 32), called as the
    registered op ``dflash_gemm::qpn2_linear``, as the stack ships its decode/verify GEMV:
    the validation_cost gate then compares op against op, not op against a bare function."""

    name = f"{FAMILY}.qpn2"

    def prepare(self, w: NVFP4Weight) -> QPNWeight:
        return prepare_qpn2(super().prepare(w))

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        return _QPN2_OP(x, w.buffer, w.scales, w.global_scale, w.n, w.k, gated)


class QPN4BoundedRoute(_Route):
    """N-tiled dequantize of the QPN4 view into a bounded workspace, matmul per chunk.

    Each route object owns one workspace per device; ``workspace_bytes`` is its bound.
    """

    name = f"{FAMILY}.qpn4_bounded"

    def __init__(self, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        self.workspace_bytes = _check_bound(workspace_bytes)
        self._workspaces: dict[torch.device, Workspace] = {}

    def prepare(self, w: NVFP4Weight) -> QPNWeight:
        return prepare_qpn2(super().prepare(w))

    def workspace(self, device: torch.device | str = "cpu") -> Workspace:
        device = torch.device(device)
        if device not in self._workspaces:
            self._workspaces[device] = Workspace(self.workspace_bytes)
        return self._workspaces[device]

    def workspace_peak_bytes(self, device: torch.device | str = "cpu") -> int:
        return self.workspace(device).peak_bytes

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        codes = tile_view(w.qpn4, w.tiles, w.groups)
        y = _qpn4_bounded_large_m(x.float(), codes, w.scales, _prefill_scales(x, w),
                                  w.global_scale, self.workspace(x.device))
        return _finish(y, w.n, gated, x.dtype)


# ----------------------------------------------------------------------------------------------
# qpn2_packed: one dispatch op with the M branch inside


_SHARED_WORKSPACES: dict[torch.device, Workspace] = {}
_dispatch_checked = True


def shared_workspace(device: torch.device | str = "cpu") -> Workspace:
    """The one prefill workspace of ``device`` that every qpn2_packed call shares."""
    device = torch.device(device)
    if device not in _SHARED_WORKSPACES:
        _SHARED_WORKSPACES[device] = Workspace(DEFAULT_WORKSPACE_BYTES)
    return _SHARED_WORKSPACES[device]


def _check_min_prefill_m(min_prefill_m: int) -> int:
    if not _dispatch_checked:
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
    that the validation_cost gate must catch. Never used outside tests."""
    global _dispatch_checked
    previous, _dispatch_checked = _dispatch_checked, False
    try:
        yield
    finally:
        _dispatch_checked = previous


def _qpn2_packed_linear(
    x: Tensor,
    buffer: Tensor,
    scales: Tensor,
    scales_fp16: Tensor | None,
    global_scale: float,
    n: int,
    k: int,
    min_prefill_m: int,
    workspace_bytes: int,
    gated: bool,
) -> Tensor:
    """The dispatch op's implementation: the M branch and nothing else of its own.

    ``buffer`` is the resident tile-ordered code buffer; each branch takes its zero-copy view
    of it (QPN4 ``[K, Np/2]`` for prefill, QPN2 ``[Np, K/2]`` for verify/decode) and calls the
    very kernel the qpn4_bounded / qpn2 routes call, so type-A parity holds by construction.
    """
    _check_min_prefill_m(min_prefill_m)
    if x.shape[0] < min_prefill_m:
        hits.record(QPN2_PACKED.name, "small_m")
        return _qpn2_linear(x, buffer, scales, global_scale, n, k, gated)
    hits.record(QPN2_PACKED.name, "large_m")
    workspace = shared_workspace(x.device)
    if workspace.bound_bytes != workspace_bytes:
        workspace.set_bound(workspace_bytes)
    tiles, groups = scales.shape[0], scales.shape[1]
    codes = tile_view(buffer.view(k, tiles * TILE_N // 2), tiles, groups)
    y = _qpn4_bounded_large_m(x.float(), codes, scales, scales_fp16, global_scale, workspace)
    return _finish(y, n, gated, x.dtype)


def _qpn2_packed_fake(
    x: Tensor,
    buffer: Tensor,
    scales: Tensor,
    scales_fp16: Tensor | None,
    global_scale: float,
    n: int,
    k: int,
    min_prefill_m: int,
    workspace_bytes: int,
    gated: bool,
) -> Tensor:
    return x.new_empty(x.shape[0], n // 2 if gated else n)


def _qpn2_linear(
    x: Tensor, buffer: Tensor, scales: Tensor, global_scale: float, n: int, k: int, gated: bool
) -> Tensor:
    """The qpn2 op's implementation (and the qpn2_packed op's small-M branch): the QPN2 view
    ``[Np, K/2]`` of the buffer, the small-M kernel, slice and cast."""
    tiles, groups = scales.shape[0], scales.shape[1]
    codes = tile_view(buffer.view(tiles * TILE_N, k // 2), tiles, groups)
    return _finish(_qpn2_small_m(x.float(), codes, scales, global_scale), n, gated, x.dtype)


def _qpn2_linear_fake(
    x: Tensor, buffer: Tensor, scales: Tensor, global_scale: float, n: int, k: int, gated: bool
) -> Tensor:
    return x.new_empty(x.shape[0], n // 2 if gated else n)


# torch.library.Library + impl rather than torch.library.custom_op: same registration in the
# dispatcher, but about 6-10 us per call instead of about 20 us, which matters at M <= 8 where
# the validation_cost gate allows 1%.
_LIB = torch.library.Library("dflash_gemm", "DEF")
_LIB.define(
    "qpn2_linear(Tensor x, Tensor buffer, Tensor scales, float global_scale, int n, int k, "
    "bool gated) -> Tensor"
)
_LIB.define(
    "qpn2_packed_linear(Tensor x, Tensor buffer, Tensor scales, Tensor? scales_fp16, "
    "float global_scale, int n, int k, int min_prefill_m, int workspace_bytes, bool gated) "
    "-> Tensor"
)
_LIB.impl("qpn2_linear", _qpn2_linear, "CompositeExplicitAutograd")
_LIB.impl("qpn2_packed_linear", _qpn2_packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("dflash_gemm::qpn2_linear", _qpn2_linear_fake, lib=_LIB)
torch.library.register_fake("dflash_gemm::qpn2_packed_linear", _qpn2_packed_fake, lib=_LIB)
_QPN2_OP = torch.ops.dflash_gemm.qpn2_linear.default
_QPN2_PACKED_OP = torch.ops.dflash_gemm.qpn2_packed_linear.default


class QPN2PackedRoute(_Route):
    """One dispatch op over the resident QPN2 buffer: M >= min_prefill_m takes the bounded QPN4
    path (zero-copy view, one shared per-device workspace), smaller M the unchanged QPN2 path.

    The M branch lives inside ``torch.ops.dflash_gemm.qpn2_packed_linear``, never in Python
    around it, so a captured decode graph cannot freeze one branch.
    """

    name = f"{FAMILY}.qpn2_packed"

    def __init__(
        self,
        min_prefill_m: int = DEFAULT_MIN_PREFILL_M,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        self.min_prefill_m = _check_min_prefill_m(min_prefill_m)
        self.workspace_bytes = _check_bound(workspace_bytes)

    def prepare(self, w: NVFP4Weight) -> QPNWeight:
        return prepare_qpn2(super().prepare(w))

    def workspace_peak_bytes(self, device: torch.device | str = "cpu") -> int:
        return shared_workspace(device).peak_bytes

    def _run(self, x: Tensor, w: QPNWeight, gated: bool) -> Tensor:
        return _QPN2_PACKED_OP(
            x, w.buffer, w.scales, _prefill_scales(x, w), w.global_scale, w.n, w.k,
            self.min_prefill_m, self.workspace_bytes, gated,
        )


ORACLE = OracleRoute()
TURBOMIND = TurbomindRoute()
QPN2 = QPN2Route()
QPN4_BOUNDED = QPN4BoundedRoute()
QPN2_PACKED = QPN2PackedRoute()
