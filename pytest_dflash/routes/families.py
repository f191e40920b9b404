"""Family contracts: how a gate calls a route of a family, and which routes play which part.

A *family* is one job of the inference stack (causal attention with head dim 256, a linear layer
over NVFP4 weights, the prefill chunk geometry). Every route of a family offers the same calling
contract, written here as a ``typing.Protocol``, so a gate calls a route registered by another
project exactly as it calls a shipped one. A :class:`Family` record declares, once, the routes a
family's gates need besides the candidate:

- ``oracle``: the high-precision reference every candidate is judged against (parity);
- ``baseline``: what runs when no candidate is enabled (speed, ppl and quality compare to it);
- ``verify_route``: the route that serves speculative verification (M <= 8 rows) when a
  candidate is disabled; validation-cost gates compare against it. None: the family has no
  verify path of its own;
- ``gates``: the gate kinds the family's gate tests offer. A route can only be judged on a kind
  some test measures for its family, so the registry refuses a route that declares any other
  (``RouteRegistry.validate``) before a test runs; otherwise that gate would stay pending forever.

Families are declared from the ``pytest_dflash_routes`` hook (``registry.declare(Family(...))``),
the shipped ones in ``pytest_dflash/routes/shipped.py``; generic gates read them through
``dflash_gate.family`` and never name a route. docs/families.md has the contracts in prose.
This module is import-light: the tensor types are annotations only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pytest_dflash.routes.vocabulary import check_kind

if TYPE_CHECKING:  # annotations only: no torch at plugin import time
    from torch import Tensor, dtype


@runtime_checkable
class AttnD256(Protocol):
    """Family ``attn.d256``: causal prefill attention, head dim 256, GQA, bottom-right mask.

    q ``[Tq, Hq, 256]``, k/v ``[Tk, Hkv, 256]`` (Hq a multiple of Hkv, Tq <= Tk); the result is
    written into the caller-owned ``out`` (shape and dtype of q). Every call records one route hit
    ``hits.record(route_name, "dense" | "paged")`` so gates can prove what ran.
    """

    def dense(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_scale: float,
              causal: bool) -> None: ...

    def paged(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
              kv_len: int, out: Tensor, softmax_scale: float, causal: bool) -> None: ...


@runtime_checkable
class GemmNvfp4(Protocol):
    """Family ``gemm.nvfp4``: ``y = x @ W^T`` with W in NVFP4 (e2m1 codes, e4m3 group scales).

    ``prepare(w)`` converts a ``dflash_kernels.nvfp4.NVFP4Weight`` once into the route's resident
    form; ``linear(x, prepared)`` returns ``[M, N]`` in x's dtype; ``gate_up`` is the fused MLP
    input projection returning ``silu(gate) * up`` of shape ``[M, N/2]``. Every call records
    route hits naming the path it took (e.g. ``small_m``, ``large_m``).
    """

    name: str

    def prepare(self, w: Any) -> Any: ...

    def linear(self, x: Tensor, prepared: Any) -> Tensor: ...

    def gate_up(self, x: Tensor, prepared: Any) -> Tensor: ...


@runtime_checkable
class PrefillGeometry(Protocol):
    """Family ``prefill.geometry``: the SSM state dtype and the prefill chunk size of an engine.

    Model-level gates switch it in the engine (``Route.engine`` / the engine selection); the
    reference engine reads ``state_dtype`` and ``chunk(profile)``.
    """

    name: str
    state_dtype: dtype

    def chunk(self, profile: str) -> int: ...


@runtime_checkable
class GatedDeltaRule(Protocol):
    """Family ``linear.gdn``: the gated delta rule of a gated-DeltaNet layer and its output norm
    (Qwen3.5; flash-linear-attention's calling convention).

    ``chunk`` (a prefill chunk or any block of tokens) and ``recurrent`` (a decode step over
    the cached state) take q/k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]`` (Hv a multiple of Hk),
    the log decay ``g`` and ``beta`` ``[B, T, Hv]``, an optional ``initial_state`` ``[B, Hv,
    Dk, Dv]``, and return the output ``[B, T, Hv, Dv]`` and, when ``output_final_state``, the
    final state; ``use_qk_l2norm_in_kernel`` L2-normalises q and k first. ``gated_norm(x,
    gate, weight, eps)`` is ``rmsnorm(x) * weight * silu(gate)`` over the last dim. Every call
    records a route hit naming what served it.
    """

    def chunk(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Tensor | None, output_final_state: bool,
              use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor | None]: ...

    def recurrent(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor | None, output_final_state: bool,
                  use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor | None]: ...

    def gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor: ...


@runtime_checkable
class NormMlp(Protocol):
    """Family ``norm_mlp``: a decoder layer's RMSNorm (Qwen3.5's zero-centred weight:
    ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``) and the SwiGLU activation of its MLP
    (``silu(gate) * up``), both in the input's dtype. Every call records a route hit."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor: ...


def contract_calls(contract: type) -> tuple[str, ...]:
    """The methods a contract Protocol requires, in declaration order."""
    return tuple(name for name, value in vars(contract).items()
                 if callable(value) and not name.startswith("_"))


@dataclass(frozen=True)
class Family:
    """One family: its calling contract and the routes its gates need besides the candidate.

    Route names, not objects: a family is declared before (or alongside) its routes and the
    registry checks the names once every plugin has registered (``RouteRegistry.validate``).
    """

    name: str
    contract: type | None
    baseline: str
    oracle: str | None = None
    verify_route: str | None = None
    description: str = ""
    gates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "gates", tuple(self.gates))
        for kind in self.gates:
            check_kind(kind)

    def check(self, impl: Any, route_name: str) -> Any:
        """Return ``impl`` if it offers every call of the contract, else raise TypeError that
        names the missing calls and the contract to implement."""
        if self.contract is None:
            return impl
        missing = [c for c in contract_calls(self.contract)
                   if not callable(getattr(impl, c, None))]
        if missing:
            raise TypeError(
                f"route {route_name!r}: implementation {impl!r:.60} lacks {', '.join(missing)}; "
                f"a {self.name} route must implement pytest_dflash.routes.families."
                f"{self.contract.__name__} ({', '.join(contract_calls(self.contract))})")
        return impl

