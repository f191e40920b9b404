"""Numerical parity checks shared by every parity gate (docs/gates.md, "parity").

Why one module: every family compares a candidate against an oracle with the same rule, so a
kernel from another project is judged exactly like a shipped one, and every failure message has
the same shape (count and share of mismatches, max/mean abs and rel error, first bad indices).

Two parity classes exist (docs/vocabulary.md, "parity classes"):

* type A, same arithmetic in a different layout: :func:`assert_bitwise_equal` (raw bytes equal).
* type B, a different reduction order: :func:`check_parity`, the FlashAttention three-way rule
  ``max err(candidate) <= k * max err(reference) + floor(dtype)`` where ``reference`` is the
  same-dtype torch computation, plus relative L2 ``<= rel_l2(dtype)``. NaN/Inf never pass. The
  reference is checked first: outside the policy's limits of the oracle it raises
  :class:`ReferenceUnreliable` instead of widening the bound.

All error arithmetic runs in fp64 on the CPU so the check itself adds no rounding of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_dflash.policy.thresholds import Policy

_FIRST_BAD = 5  # how many offending indices a message names


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN in place and return it.

    Output buffers are poisoned before a kernel writes them so that an element the kernel forgot
    to write shows up as NaN (which never passes parity) instead of a stale plausible value.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"poison_ needs a torch.Tensor, got {type(t).__name__}")
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(
            f"poison_ needs a floating-point tensor, got {t.dtype}: integer dtypes have no NaN; "
            f"fill the buffer with a sentinel instead, e.g. t.fill_(torch.iinfo({t.dtype}).min)"
        )
    t.fill_(float("nan"))
    return t


class ReferenceUnreliable(ValueError):
    """The same-dtype reference is itself outside the policy's limits of the oracle.

    Its error calibrates the candidate's bound (k x ref error + floor), so a wrong reference
    would loosen the gate exactly where it should be strictest; such a case is an error that
    names the reference, never a pass under a looser bound.
    """


@dataclass
class ParityResult:
    """Outcome of one parity comparison; every figure a reviewer needs to judge it."""

    ok: bool
    label: str
    dtype: str
    max_abs: float  # over elements where both sides are finite
    mean_abs: float
    max_rel: float  # |cand - oracle| / max(|oracle|, floor): informative, not a pass criterion
    rel_l2: float  # ||cand - oracle||_2 / ||oracle||_2 (inf when the candidate has NaN/Inf)
    rel_l2_limit: float
    ref_max_abs: float | None  # max |reference - oracle|, None without a reference
    bound: float  # elementwise abs-error bound: mismatches are elements above it
    mismatches: int  # elements above the bound, non-finite ones included
    nonfinite: int  # candidate NaN/Inf where the oracle is finite
    total: int
    share: float
    first_bad: list[tuple[int, ...]] = field(default_factory=list)
    first_bad_values: list[tuple[float, float]] = field(default_factory=list)  # (cand, oracle)
    bound_rule: str = ""

    def figure(self) -> str:
        """One short line for the verdict table, e.g. ``rel L2 3.1e-06, max abs 2e-05 (...)``."""
        text = f"rel L2 {self.rel_l2:.2g}, max abs {self.max_abs:.2g} (bound {self.bound:.2g})"
        if self.nonfinite:
            text += f", {self.nonfinite} non-finite"
        return text

    def message(self) -> str:
        """A failure (or success) message that lets one fix the kernel without rerunning."""
        status = "parity ok" if self.ok else "parity FAILED"
        lines = [
            f"{self.label} [{self.dtype}]: {status}: {self.mismatches}/{self.total} elements "
            f"({self.share:.3%}) beyond bound {self.bound:.3g} ({self.bound_rule})",
        ]
        if self.nonfinite:
            lines.append(
                f"  {self.nonfinite} candidate elements are NaN/Inf where the oracle is "
                "finite (NaN never passes; an unwritten output buffer stays NaN)"
            )
        verdict_l2 = "<=" if self.rel_l2 <= self.rel_l2_limit else ">"
        lines.append(
            f"  max abs {self.max_abs:.3g}, mean abs {self.mean_abs:.3g}, "
            f"max rel {self.max_rel:.3g}, "
            f"rel L2 {self.rel_l2:.3g} {verdict_l2} limit {self.rel_l2_limit:.3g}"
        )
        if self.ref_max_abs is not None:
            lines.append(f"  reference (same-dtype torch) max abs error {self.ref_max_abs:.3g}")
        if self.first_bad:
            shown = ", ".join(
                f"{idx}: cand {c:.6g} vs oracle {o:.6g}"
                for idx, (c, o) in zip(self.first_bad, self.first_bad_values, strict=True)
            )
            lines.append(f"  first bad indices: {shown}")
        return "\n".join(lines)

    def measurements(self) -> dict[str, Any]:
        """JSON-able figures for ``dflash_record`` (non-finite floats become None)."""
        return {
            "figure": self.figure(),
            "ok": self.ok,
            "label": self.label,
            "dtype": self.dtype,
            "max_abs": _json_float(self.max_abs),
            "mean_abs": _json_float(self.mean_abs),
            "max_rel": _json_float(self.max_rel),
            "rel_l2": _json_float(self.rel_l2),
            "rel_l2_limit": self.rel_l2_limit,
            "ref_max_abs": _json_float(self.ref_max_abs),
            "bound": _json_float(self.bound),
            "mismatches": self.mismatches,
            "nonfinite": self.nonfinite,
            "total": self.total,
            "share": self.share,
            "first_bad": [list(i) for i in self.first_bad],
        }


def check_parity(
    candidate: torch.Tensor,
    oracle: torch.Tensor,
    reference: torch.Tensor | None = None,
    *,
    policy: Policy,
    dtype: torch.dtype | str,
    label: str,
) -> ParityResult:
    """Compare ``candidate`` with ``oracle`` under the policy's rule for ``dtype``.

    ``dtype`` names the compute dtype whose floor and relative-L2 limit apply (fp16 inputs get the
    fp16 row even when the oracle is fp64). With a ``reference`` (the same-dtype torch result),
    the elementwise bound is ``policy.parity_k * max|reference - oracle| + policy.floor(dtype)``:
    a candidate may be at most k times as wrong as the stack it replaces. Without one there is
    nothing to calibrate against, so the bound scales with the oracle like the L2 criterion does:
    ``policy.rel_l2(dtype) * max|oracle| + policy.floor(dtype)``.

    Passes iff no element exceeds the bound, no candidate element is NaN/Inf, and the relative
    L2 error is within ``policy.rel_l2(dtype)``.
    """
    key = _policy_dtype(policy, dtype)
    cand = _as_fp64(candidate, "candidate", label)
    orc = _as_fp64(oracle, "oracle", label)
    if cand.shape != orc.shape:
        raise ValueError(
            f"{label}: candidate shape {tuple(cand.shape)} != oracle shape {tuple(orc.shape)}; "
            "compare outputs of the same contract (slice padding off first)"
        )
    if cand.numel() == 0:
        raise ValueError(
            f"{label}: empty tensors (shape {tuple(cand.shape)}) prove nothing; "
            "use a non-empty case"
        )
    oracle_bad = int((~torch.isfinite(orc)).sum())
    if oracle_bad:
        raise ValueError(
            f"{label}: the oracle has {oracle_bad} NaN/Inf elements; an oracle must be finite "
            "(fix the inputs, e.g. no fully masked rows, or the oracle itself)"
        )
    floor = policy.floor(key)
    limit = policy.rel_l2(key)

    ref_max: float | None = None
    if reference is not None:
        ref = _as_fp64(reference, "reference", label)
        if ref.shape != orc.shape:
            raise ValueError(
                f"{label}: reference shape {tuple(ref.shape)} != oracle shape {tuple(orc.shape)}"
            )
        ref_err = (ref - orc).abs()
        if not bool(torch.isfinite(ref_err).all()):
            raise ValueError(
                f"{label}: the same-dtype reference has NaN/Inf elements, so it cannot "
                "calibrate the bound; fix the inputs (e.g. scale them into the dtype's range)"
            )
        ref_max = float(ref_err.max())
        _check_reference(ref, orc, ref_max, limit=limit, floor=floor, key=key, label=label)
        bound = policy.parity_k * ref_max + floor
        rule = f"{policy.parity_k:g} x ref max err {ref_max:.3g} + floor {floor:g}"
    else:
        orc_max = float(orc.abs().max())
        bound = limit * orc_max + floor
        rule = f"rel_l2 limit {limit:g} x max|oracle| {orc_max:.3g} + floor {floor:g}"

    err = (cand - orc).abs()
    finite = torch.isfinite(err)
    nonfinite = int((~finite).sum())
    err_f = torch.where(finite, err, torch.zeros_like(err))
    bad = (~finite) | (err > bound)
    mismatches = int(bad.sum())
    total = cand.numel()
    max_abs = float(err_f.max())
    mean_abs = float(err_f.sum()) / max(total - nonfinite, 1)
    max_rel = float((err_f / orc.abs().clamp_min(floor)).max())
    orc_norm = float(torch.linalg.vector_norm(orc))
    if nonfinite:
        rel_l2 = math.inf
    else:
        diff_norm = float(torch.linalg.vector_norm(cand - orc))
        rel_l2 = diff_norm / orc_norm if orc_norm > 0 else (0.0 if diff_norm == 0 else math.inf)

    first_bad: list[tuple[int, ...]] = []
    first_vals: list[tuple[float, float]] = []
    if mismatches:
        idx = torch.nonzero(bad)[:_FIRST_BAD]
        for row in idx.tolist():
            pos = tuple(int(i) for i in row)
            first_bad.append(pos)
            first_vals.append((float(cand[pos]), float(orc[pos])))

    return ParityResult(
        ok=mismatches == 0 and rel_l2 <= limit,
        label=label,
        dtype=key,
        max_abs=max_abs,
        mean_abs=mean_abs,
        max_rel=max_rel,
        rel_l2=rel_l2,
        rel_l2_limit=limit,
        ref_max_abs=ref_max,
        bound=bound,
        mismatches=mismatches,
        nonfinite=nonfinite,
        total=total,
        share=mismatches / total,
        first_bad=first_bad,
        first_bad_values=first_vals,
        bound_rule=rule,
    )


def _check_reference(ref: torch.Tensor, orc: torch.Tensor, ref_max: float, *, limit: float,
                     floor: float, key: str, label: str) -> None:
    """Raise :class:`ReferenceUnreliable` unless the reference meets the oracle-only rule (rel
    L2 <= limit, every element within ``limit * max|oracle| + floor``)."""
    orc_norm = float(torch.linalg.vector_norm(orc))
    ref_l2 = float(torch.linalg.vector_norm(ref - orc)) / orc_norm if orc_norm > 0 else 0.0
    elem_bound = limit * float(orc.abs().max()) + floor
    if ref_l2 <= limit and ref_max <= elem_bound:
        return
    raise ReferenceUnreliable(
        f"{label}: reference unreliable: the same-dtype reference is outside the policy's "
        f"{key} limits of the oracle (rel L2 {ref_l2:.3g} vs limit {limit:g}, max abs error "
        f"{ref_max:.3g} vs {elem_bound:.3g}); it cannot calibrate the candidate's bound, so "
        "this case is an error, not a looser bound: fix the reference route (the family "
        "baseline) on this device"
    )


def assert_parity(
    candidate: torch.Tensor,
    oracle: torch.Tensor,
    reference: torch.Tensor | None = None,
    *,
    policy: Policy,
    dtype: torch.dtype | str,
    label: str,
) -> ParityResult:
    """:func:`check_parity`, raising ``AssertionError(result.message())`` unless it passes."""
    result = check_parity(candidate, oracle, reference, policy=policy, dtype=dtype, label=label)
    if not result.ok:
        raise AssertionError(result.message())
    return result


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, label: str) -> dict[str, Any]:
    """Type-A parity: same dtype, same shape, identical raw bytes (NaN payloads and -0.0 too).

    Bytes are compared, not values, because "same arithmetic in another layout" must reproduce
    every bit; ``torch.equal`` alone would treat NaN != NaN and -0.0 == 0.0.
    Returns JSON-able measurements (``max_abs`` is 0.0 on success).
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(
            f"{label}: assert_bitwise_equal needs two torch.Tensors, got "
            f"{type(a).__name__} and {type(b).__name__}"
        )
    if a.dtype != b.dtype:
        raise AssertionError(
            f"{label}: dtype {a.dtype} != {b.dtype}; bitwise parity needs the same output dtype"
        )
    if a.shape != b.shape:
        raise AssertionError(f"{label}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    total = a.numel()
    width = a.element_size()
    ab = _raw_bytes(a).reshape(total, width)
    bb = _raw_bytes(b).reshape(total, width)
    differ = (ab != bb).any(dim=1) if total else torch.zeros(0, dtype=torch.bool)
    mismatches = int(differ.sum())
    if mismatches == 0:
        return {
            "figure": f"bitwise equal ({total} elements)",
            "max_abs": 0.0,
            "mismatches": 0,
            "total": total,
        }
    flat = torch.nonzero(differ).flatten()[:_FIRST_BAD].tolist()
    shape = tuple(a.shape)
    first = [tuple(int(i) for i in _unravel(f, shape)) for f in flat]
    max_abs = _max_abs_diff(a, b)
    raise AssertionError(
        f"{label}: not bitwise equal: {mismatches}/{total} elements ({mismatches / total:.3%}) "
        f"differ; max abs diff {max_abs:.6g}; first differing indices {first}"
    )


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for dim in reversed(shape):
        out.append(flat % dim)
        flat //= dim
    return list(reversed(out))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over elements finite on both sides (0 when only NaN payloads differ)."""
    if a.dtype == torch.bool:
        return float((a.cpu() != b.cpu()).any())
    x = a.detach().cpu()
    y = b.detach().cpu()
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    x, y = x.to(torch.float64), y.to(torch.float64)
    d = (x - y).abs()
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    return float(d.max()) if d.numel() else 0.0


def _as_fp64(t: Any, what: str, label: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{label}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(
            f"{label}: {what} is complex ({t.dtype}); compare real and imaginary "
            "parts separately (torch.view_as_real)"
        )
    return t.detach().to(device="cpu", dtype=torch.float64)


def _policy_dtype(policy: Policy, dtype: torch.dtype | str) -> str:
    key = str(dtype).removeprefix("torch.")
    if key not in policy.parity_floor or key not in policy.parity_rel_l2:
        known = sorted(set(policy.parity_floor) & set(policy.parity_rel_l2))
        raise ValueError(
            f"no parity tolerance for dtype {key!r}; the policy has floors and rel-L2 limits for "
            f"{', '.join(known)} (pass the compute dtype, or add it to [tool.pytest-dflash])"
        )
    return key


def _json_float(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
