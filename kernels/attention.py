"""Family ``attn.d256``: causal prefill attention with head dim 256 (docs/families.md).

Every route is an object with the same two calls, writing into a caller-owned ``out``:

* ``dense(q, k, v, out, softmax_scale, causal)``: q ``[Tq, Hq, 256]``, k/v ``[Tk, Hkv, 256]``,
  Tk >= Tq, the queries being the LAST Tq positions (so with ``causal`` row r sees keys
  ``0 .. Tk - Tq + r``: a bottom-right aligned mask, which is what a prefill continuing a cached
  prefix needs);
* ``paged(q, k_cache, v_cache, block_table, kv_len, out, softmax_scale, causal)``: keys/values in
  a paged cache ``[num_blocks, block_size, Hkv, 256]``, position p at block
  ``block_table[p // block_size]``, row ``p % block_size``.

Routes: ``ORACLE`` (fp64 math, cast to the output dtype), ``SDPA`` (the baseline every engine
has: torch ``scaled_dot_product_attention``), ``FA2`` (the native ``dflash_d256`` ops through the
loader; raises if they are not real, because choosing the fallback is the route selection's job,
never a silent decision inside the call). Each call records a route hit, so gates can prove which
route ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from pytest_dflash.native import hits
from pytest_dflash.native.loader import NAMESPACE, LoaderStatus, current_status

FAMILY = "attn.d256"
HEAD_DIM = 256
_ORACLE_ROWS = 1024  # query rows per fp64 chunk: bounds the score matrix to rows x Tk doubles


def _check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [Tq, Hq, {HEAD_DIM}], got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[2] != HEAD_DIM or v.shape != k.shape:
        raise ValueError(f"k and v must both be [Tk, Hkv, {HEAD_DIM}], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    if k.shape[0] < q.shape[0]:
        raise ValueError(f"Tk ({k.shape[0]}) must be >= Tq ({q.shape[0]}): the queries are the "
                         "last Tq of the Tk positions")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")


def gather_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``kv_len`` positions of a paged K/V cache as dense ``[kv_len, Hkv, 256]``."""
    if k_cache.dim() != 4 or k_cache.shape[3] != HEAD_DIM or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, "
                         f"{HEAD_DIM}], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if block_table.dim() != 1 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be a 1-D int32 tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    num_blocks, block_size = k_cache.shape[:2]
    if not 0 <= kv_len <= block_table.shape[0] * block_size:
        raise ValueError(f"kv_len ({kv_len}) must be in [0, len(block_table) * block_size] = "
                         f"[0, {block_table.shape[0] * block_size}]")
    used = block_table[: -(-kv_len // block_size)].long()
    # one device-to-host read for both bounds: an engine calls this every decode step. Not
    # while a CUDA graph is captured (a capture refuses the read): a step is captured only
    # after eager calls of the very same step, which made the check
    capturing = used.is_cuda and torch.cuda.is_current_stream_capturing()
    if used.numel() and not capturing and bool(((used < 0) | (used >= num_blocks)).any()):
        raise ValueError(f"block_table holds block ids outside [0, {num_blocks}): "
                         f"{used.tolist()}")
    k = k_cache.index_select(0, used).flatten(0, 1)[:kv_len]
    v = v_cache.index_select(0, used).flatten(0, 1)[:kv_len]
    return k, v


def causal_mask(tq: int, tk: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[Tq, Tk]``, True where query row r may see key c: ``c <= Tk - Tq + r``."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> torch.Tensor:
    """Attention in fp64 on q's device, ``[Tq, Hq, 256]`` float64: the oracle's arithmetic.

    Chunked over query rows so a long prefix does not need a full fp64 score matrix.
    """
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    qd = q.double().permute(1, 0, 2)  # [Hq, Tq, D]
    kd = k.double().permute(1, 0, 2).repeat_interleave(group, 0)  # [Hq, Tk, D]
    vd = v.double().permute(1, 0, 2).repeat_interleave(group, 0)
    out = torch.empty(hq, tq, HEAD_DIM, dtype=torch.float64, device=q.device)
    for r0 in range(0, tq, _ORACLE_ROWS):
        r1 = min(tq, r0 + _ORACLE_ROWS)
        scores = torch.matmul(qd[:, r0:r1], kd.transpose(1, 2)) * softmax_scale
        if causal:  # rows r0..r1 of the bottom-right mask (never the whole [Tq, Tk] matrix)
            visible = torch.ones(r1 - r0, tk, dtype=torch.bool, device=q.device).tril(tk - tq + r0)
            scores.masked_fill_(~visible, float("-inf"))
        out[:, r0:r1] = torch.matmul(scores.softmax(-1), vd)
    return out.permute(1, 0, 2)


class _Route:
    """Shared calling contract; subclasses implement ``_dense``."""

    route = ""

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_scale: float, causal: bool) -> None:
        _check_dense(q, k, v, out)
        hits.record(self.route, "dense")
        self._dense(q, k, v, out, softmax_scale, causal)

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_table: torch.Tensor, kv_len: int, out: torch.Tensor,
              softmax_scale: float, causal: bool) -> None:
        k, v = gather_pages(k_cache, v_cache, block_table, kv_len)
        _check_dense(q, k, v, out)
        hits.record(self.route, "paged")
        self._dense(q, k, v, out, softmax_scale, causal)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               softmax_scale: float, causal: bool) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.route}>"


class OracleAttention(_Route):
    """fp64 math in torch, cast to the output dtype: the reference every route is judged by."""

    route = f"{FAMILY}.oracle"

    def _dense(self, q, k, v, out, softmax_scale, causal) -> None:
        out.copy_(reference_attention(q, k, v, softmax_scale, causal))


class SdpaAttention(_Route):
    """torch ``scaled_dot_product_attention``: the fallback every engine has (baseline).

    GQA without copies where that is right: q is viewed as batch = Hkv, heads = G = Hq / Hkv,
    and k/v are expanded over G with stride 0. Causal with Tq < Tk needs a bottom-right aligned
    mask, which SDPA's ``is_causal`` (top-left aligned) is not, so an explicit mask is passed
    there. On CUDA that combination (stride-0 expanded K/V with an explicit mask) returns wrong
    values in torch (docs/cuda.md has the reproduction), so there K/V are expanded to Hq
    heads by copy instead; the CPU keeps the copy-free view.

    Masked calls on CUDA (a prefix: every paged call, every prefill chunk after the first, every
    decode step) leave cuDNN out of the backends SDPA may choose: cuDNN builds an execution plan
    for each new (Tq, Tk), about 20 ms of host time per call on an H200, and a decoding engine's
    Tk grows by one every step (measured: a decode step of the reference engine took 48 ms, 39 of
    them in cuDNN planning). Unmasked calls (a whole causal prefill, the speed gate's shape)
    keep every backend, so the baseline is still the fastest torch has for that card there.
    """

    route = f"{FAMILY}.sdpa"

    def _dense(self, q, k, v, out, softmax_scale, causal) -> None:
        sdpa_dense(q, k, v, out, softmax_scale, causal)


def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               softmax_scale: float, causal: bool, backends: Sequence[str] | None = None) -> None:
    """The route ``attn.d256.sdpa``'s SDPA call, into ``out``: the grouped heads as zero-copy
    views (K/V expanded over each group), ``is_causal`` for a whole causal prefill, an explicit
    bottom-right mask over a prefix (K/V then repeated per query head on CUDA, which the masked
    kernels need). ``backends`` (``SDPBackend`` member names) forces the backends SDPA may
    choose; None chooses as the baseline does (``_backends``). Forced-backend routes call this
    too, so they differ from the baseline only in the backend."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    mask = None
    if causal and tq != tk:
        mask = causal_mask(tq, tk, q.device)
    with _backends(q.device, masked=mask is not None, forced=backends):
        if mask is not None and group > 1 and q.device.type != "cpu":
            qh = q.permute(1, 0, 2).unsqueeze(0)  # [1, Hq, Tq, D]
            kh = k.permute(1, 0, 2).repeat_interleave(group, 0).unsqueeze(0)  # [1, Hq, Tk, D]
            vh = v.permute(1, 0, 2).repeat_interleave(group, 0).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                               scale=softmax_scale)
            out.copy_(o[0].permute(1, 0, 2))
            return
        qh = q.view(tq, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
        kh = k.permute(1, 0, 2).unsqueeze(1).expand(hkv, group, tk, d)
        vh = v.permute(1, 0, 2).unsqueeze(1).expand(hkv, group, tk, d)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                           is_causal=causal and tq == tk, scale=softmax_scale)
        out.view(tq, hkv, group, d).copy_(o.permute(2, 0, 1, 3))


# SDPA backends a masked CUDA call may use (SdpaAttention's docstring says why not cuDNN).
_MASKED_CUDA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


# SDPBackend member -> the suffix of torch's flag getter and setter (``_get_<s>_sdp_enabled``,
# ``_set_sdp_use_<s>``): the flags ``torch.nn.attention.sdpa_kernel`` sets
_SDP_FLAGS = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "mem_efficient",
              "MATH": "math", "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}
# (member, getter, setter) of every flag this torch has, looked up once
_SDP_SWITCHES = [(member, getattr(torch._C, f"_get_{name}_sdp_enabled", None),
                  getattr(torch._C, f"_set_sdp_use_{name}", None))
                 for member, name in _SDP_FLAGS.items()]
_SDP_SWITCHES = [(m, get, put) for m, get, put in _SDP_SWITCHES
                 if get is not None and put is not None]


@contextmanager
def forced_backends(backends: Sequence[str]) -> Iterator[None]:
    """Only ``backends`` (``SDPBackend`` member names) enabled for SDPA, as
    ``torch.nn.attention.sdpa_kernel(backends)`` enables them, through the same flags set
    directly.

    Why not ``sdpa_kernel`` itself: it costs about 10 us of Python per call (it rebuilds its
    backend lists on entry and exit), a sixth or so of a 2048-token D256 prefill's eager call
    on a Hopper card, and an op-level speed gate would time that as the forced backend's cost;
    a stack picks its backend once, not per call. Flags this torch lacks are left alone."""
    unknown = set(backends) - set(_SDP_FLAGS)
    if unknown:
        raise ValueError(f"unknown SDPA backends {sorted(unknown)}; known: "
                         f"{', '.join(_SDP_FLAGS)}")
    before = [get() for _, get, _ in _SDP_SWITCHES]
    try:
        for member, _, put in _SDP_SWITCHES:
            put(member in backends)
        yield
    finally:
        for (_, _, put), was in zip(_SDP_SWITCHES, before, strict=True):
            put(was)


@contextmanager
def _backends(device: torch.device, masked: bool,
              forced: Sequence[str] | None = None) -> Iterator[None]:
    """SDPA's backend choice for one call: ``forced`` when given, else unrestricted, except
    masked calls on CUDA."""
    if forced is not None:
        with forced_backends(forced):
            yield
        return
    if not masked or device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name) for name in _MASKED_CUDA_BACKENDS]):
        yield


class Fa2Attention(_Route):
    """The native ``dflash_d256`` ops (tiled online softmax, fp32 accumulation), via the loader.

    Calls fail with the loader's status when the ops are not real: a benchmark or an engine run
    of a silent fallback would be evidence for the wrong code.
    """

    route = f"{FAMILY}.fa2"

    def status(self) -> LoaderStatus:
        return fa2_status()

    def ops(self) -> dict[str, Any]:
        """The op handles (``torch.ops.dflash_d256.*``) for ``torch.library.opcheck``."""
        self._require()
        ns = getattr(torch.ops, NAMESPACE)
        return {"dense": ns.dense, "paged": ns.paged}

    def _require(self, device: torch.device | None = None) -> Any:
        status = fa2_status(device.type if device is not None else "cpu")
        if not status.ok:
            raise RuntimeError(
                f"{self.route}: the native ops are not real here ({status.summary()}). Select "
                f"the fallback route {FAMILY}.sdpa instead; {self.route} never falls back itself"
            )
        return getattr(torch.ops, NAMESPACE)

    def dense(self, q, k, v, out, softmax_scale, causal) -> None:
        ops = self._require(q.device)
        hits.record(self.route, "dense")
        with _contiguous_out(out) as dst:
            ops.dense(q.contiguous(), k.contiguous(), v.contiguous(), dst, float(softmax_scale),
                      bool(causal))

    def paged(self, q, k_cache, v_cache, block_table, kv_len, out, softmax_scale,
              causal) -> None:
        ops = self._require(q.device)
        hits.record(self.route, "paged")
        with _contiguous_out(out) as dst:
            ops.paged(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                      block_table.contiguous(), int(kv_len), dst, float(softmax_scale),
                      bool(causal))

    def dense_splitkv(self, q, k, v, out, softmax_scale, causal, num_splits: int) -> None:
        """Optional variant for very long KV: keys split ``num_splits`` ways, merged exactly."""
        ops = self._require(q.device)
        hits.record(self.route, "dense_splitkv")
        with _contiguous_out(out) as dst:
            ops.dense_splitkv(q.contiguous(), k.contiguous(), v.contiguous(), dst,
                              float(softmax_scale), bool(causal), int(num_splits))


@contextmanager
def _contiguous_out(out: torch.Tensor) -> Iterator[torch.Tensor]:
    """The native ops take contiguous tensors (they check it); callers such as an engine may
    hold strided views (q split off a fused projection, out a slice of a bigger buffer), so
    inputs are made contiguous and a strided ``out`` is written through a temporary."""
    if out.is_contiguous():
        yield out
        return
    tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    yield tmp
    out.copy_(tmp)


def fa2_status(device: str = "cpu") -> LoaderStatus:
    """The loader's status for the native ops: the process's current one (see
    :func:`pytest_dflash.native.loader.current_status`): the bundled build, or the sidecar given to
    the loader or in ``$DFLASH_D256_LIBRARY``."""
    return current_status(device)


ORACLE = OracleAttention()
SDPA = SdpaAttention()
FA2 = Fa2Attention()
