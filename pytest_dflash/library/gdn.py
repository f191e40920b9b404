"""Routes of family ``linear.gdn``: the gated delta rule of Qwen3.5's gated-DeltaNet layers and
the gated RMSNorm after it (contract ``pytest_dflash.routes.families.GatedDeltaRule``).

- ``linear.gdn.oracle``: the naive recurrence in fp64 (what flash-linear-attention's own tests
  compare against), one token at a time;
- ``linear.gdn.torch`` (baseline): the torch code transformers' Qwen3.5 modelling falls back to
  without flash-linear-attention, taken from transformers' own dispatch point
  (:func:`pytest_dflash.library.dispatch_points.torch_fallbacks`), and its ``Qwen3_5RMSNormGated``;
- ``linear.gdn.fla_chunk``: fla's ``chunk_gated_delta_rule`` for prefill chunks of more than
  :data:`MAX_VERIFY_ROWS` tokens; verify blocks (M <= 8) and single-token steps stay on the
  baseline, so it must leave the verify path as it was (validation_cost);
- ``linear.gdn.fla_recurrent``: fla's ``fused_recurrent_gated_delta_rule`` for every step of at
  most :data:`MAX_VERIFY_ROWS` tokens (decode, verify); longer chunks stay on the baseline;
- ``linear.gdn.fla_norm``: fla's fused gated RMSNorm (``rms_norm_gated``, the function
  ``FusedRMSNormGated`` calls) for the layers' output norm, the recurrence on the baseline.

Every call records one hit under the route that served it (``hits.record``); an op a route
leaves to the baseline records a ``*_dispatch`` hit on the route and the baseline's own hit, so
a gate sees both which route was asked and which code ran. Nothing imports torch, transformers
or fla until a call is made.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pytest_dflash.native import hits

if TYPE_CHECKING:
    from torch import Tensor

FAMILY = "linear.gdn"
MAX_VERIFY_ROWS = 8  # speculative verify blocks and decode steps: M <= 8 tokens
OPS = ("chunk", "recurrent", "gated_norm")


class GdnRoute:
    """The contract calls; a subclass serves the ops in :attr:`own` with its own code and
    leaves the others to the baseline (:data:`TORCH`)."""

    route = ""
    own: frozenset[str] = frozenset(OPS)
    # whether the last call ran this route's own code (False: it was left to the baseline);
    # the engine books the call on the layer under the route that served it
    last_served = True

    def chunk(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False) -> tuple[Tensor, Tensor | None]:
        """A prefill chunk (or any block of tokens): q/k ``[B, T, Hk, Dk]``, v ``[B, T, Hv,
        Dv]``, g (log decay) and beta ``[B, T, Hv]``, state ``[B, Hv, Dk, Dv]``; returns the
        output ``[B, T, Hv, Dv]`` and the final state when asked."""
        args = (q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)
        self.last_served = self._serves("chunk", q.shape[1])
        if not self.last_served:
            hits.record(self.route, "chunk_dispatch")
            return TORCH.chunk(*args)
        hits.record(self.route, "chunk")
        return self._chunk(*args)

    def recurrent(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  use_qk_l2norm_in_kernel: bool = False) -> tuple[Tensor, Tensor | None]:
        """A decode step over the cached state: the same shapes as :meth:`chunk`."""
        args = (q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)
        self.last_served = "recurrent" in self.own
        if not self.last_served:
            hits.record(self.route, "recurrent_dispatch")
            return TORCH.recurrent(*args)
        hits.record(self.route, "recurrent")
        return self._recurrent(*args)

    def gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``rmsnorm(x) * weight * silu(gate)`` over the last dim, in x's dtype: the output
        norm of a gated-DeltaNet layer (transformers' ``Qwen3_5RMSNormGated``)."""
        self.last_served = "gated_norm" in self.own
        if not self.last_served:
            hits.record(self.route, "gated_norm_dispatch")
            return TORCH.gated_norm(x, gate, weight, eps)
        hits.record(self.route, "gated_norm")
        return self._gated_norm(x, gate, weight, eps)

    def _serves(self, op: str, tokens: int) -> bool:
        return op in self.own

    def _chunk(self, *args: Any) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def _recurrent(self, *args: Any) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def _gated_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.route}>"


def naive_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     initial_state: Tensor | None, output_final_state: bool,
                     use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule one token at a time in fp64, the definition every kernel computes:
    ``S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(Dk)``,
    q and k L2-normalised first when asked, each q/k head serving Hv / Hk value heads."""
    import torch

    out_dtype = v.dtype
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, t, _, dk = k.shape
    state = (torch.zeros(b, hv, dk, v.shape[-1], dtype=torch.float64, device=v.device)
             if initial_state is None else initial_state.double().clone())
    out = torch.empty(b, t, hv, v.shape[-1], dtype=torch.float64, device=v.device)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        delta = (v[:, i] - predicted) * beta[:, i][..., None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], delta)
        out[:, i] = torch.einsum("bhkv,bhk->bhv", state, q[:, i])
    return out.to(out_dtype), (state if output_final_state else None)


class OracleGdn(GdnRoute):
    """fp64 reference: :func:`naive_recurrence` for both ops, the gated norm in fp64 (results
    in fp64: a gate compares in fp64 anyway)."""

    route = f"{FAMILY}.oracle"

    def _chunk(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        out, state = naive_recurrence(q, k, v.double(), g, beta, initial_state,
                                      output_final_state, l2norm)
        return out, state

    _recurrent = _chunk

    def _gated_norm(self, x, gate, weight, eps):
        import torch

        xd = x.double()
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        return normed * weight.double() * torch.nn.functional.silu(gate.double())


class TorchGdn(GdnRoute):
    """The baseline: transformers' own torch code for Qwen3.5 (the functions its dispatch
    point falls back to, and ``Qwen3_5RMSNormGated.forward``)."""

    route = f"{FAMILY}.torch"

    def _chunk(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        from pytest_dflash.library.dispatch_points import torch_fallbacks

        return torch_fallbacks().chunk(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=l2norm)

    def _recurrent(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        from pytest_dflash.library.dispatch_points import torch_fallbacks

        return torch_fallbacks().recurrent(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                           output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=l2norm)

    def _gated_norm(self, x, gate, weight, eps):
        from pytest_dflash.library.dispatch_points import torch_fallbacks

        norm = SimpleNamespace(weight=weight, variance_epsilon=eps, activation="silu")
        return torch_fallbacks().gated_norm(norm, x, gate)


class FlaChunk(GdnRoute):
    """fla's chunk kernel for prefill chunks longer than a verify block."""

    route = f"{FAMILY}.fla_chunk"
    own = frozenset({"chunk"})

    def _serves(self, op: str, tokens: int) -> bool:
        return op in self.own and tokens > MAX_VERIFY_ROWS

    def _chunk(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=l2norm)


class FlaRecurrent(GdnRoute):
    """fla's fused recurrent kernel for every step of at most a verify block's tokens."""

    route = f"{FAMILY}.fla_recurrent"
    own = frozenset({"chunk", "recurrent"})

    def _serves(self, op: str, tokens: int) -> bool:
        return op in self.own and (op == "recurrent" or tokens <= MAX_VERIFY_ROWS)

    def _recurrent(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm)

    _chunk = _recurrent


class FlaNorm(GdnRoute):
    """fla's fused gated RMSNorm (``FusedRMSNormGated``'s function) for the output norm."""

    route = f"{FAMILY}.fla_norm"
    own = frozenset({"gated_norm"})

    def _gated_norm(self, x, gate, weight, eps):
        from fla.modules.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


ORACLE = OracleGdn()
TORCH = TorchGdn()
FLA_CHUNK = FlaChunk()
FLA_RECURRENT = FlaRecurrent()
FLA_NORM = FlaNorm()
