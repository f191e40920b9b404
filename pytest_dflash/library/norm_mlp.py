"""Routes of family ``norm_mlp``: the decoder layers' RMSNorm and the SwiGLU activation of their
MLP (contract ``pytest_dflash.routes.families.NormMlp``), served by Liger's Triton kernels as
``apply_liger_kernel_to_qwen3_5`` switches them into a Qwen3.5 model.

- ``norm_mlp.oracle``: both in fp64;
- ``norm_mlp.torch`` (baseline): transformers' own ``Qwen3_5RMSNorm.forward`` (zero-centred
  weight: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32) and ``silu(gate) * up``;
- ``norm_mlp.liger_rmsnorm``: ``LigerRMSNormFunction`` with the offset 1 and the "gemma"
  casting Liger's Qwen3.5 patch uses;
- ``norm_mlp.liger_swiglu``: ``LigerSiLUMulFunction``, the activation of Liger's SwiGLU MLP;
- ``norm_mlp.torch_mlp``: the baseline's code, naming the ground liger_swiglu is compared on.

``checkpoint_mlps``: the route serves the model's gated MLPs in the checkpoint's own weights,
so an engine leaves them unquantized instead of serving them through ``gemm.nvfp4`` (whose
``gate_up`` fuses ``silu(gate) * up`` into the GEMM, leaving no SiLU-mul to swap). Liger's
SwiGLU route and its baseline ``norm_mlp.torch_mlp`` both set it, so the two engines of its
gates differ in the SiLU-mul alone. In the model, Liger's route runs Liger's own MLP forward;
another such route that owns ``swiglu`` (one of your own) has each MLP call its ``swiglu``
between the checkpoint's projections; ``norm_mlp.torch_mlp`` owns nothing, so transformers'
own ``Qwen3_5MLP.forward`` runs.

``liger`` says which parts of ``apply_liger_kernel_to_qwen3_5`` a route switches on in a model
(``pytest_dflash.engines.transformers_library.apply_liger``). Every call records a hit under the
route that served it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pytest_dflash.native import hits

if TYPE_CHECKING:
    from torch import Tensor

FAMILY = "norm_mlp"


class NormMlpRoute:
    """The contract calls; ops not in :attr:`own` are left to the baseline (:data:`TORCH`)."""

    route = ""
    own: frozenset[str] = frozenset({"rms_norm", "swiglu"})
    liger: dict[str, bool] = {}
    checkpoint_mlps = False

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """Qwen3.5's RMSNorm of x over its last dim with a zero-centred weight, in x's dtype."""
        if "rms_norm" not in self.own:
            hits.record(self.route, "rms_norm_dispatch")
            return TORCH.rms_norm(x, weight, eps)
        hits.record(self.route, "rms_norm")
        return self._rms_norm(x, weight, eps)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up``: the activation between a gated MLP's projections."""
        if "swiglu" not in self.own:
            hits.record(self.route, "swiglu_dispatch")
            return TORCH.swiglu(gate, up)
        hits.record(self.route, "swiglu")
        return self._swiglu(gate, up)

    def _rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        raise NotImplementedError

    def _swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.route}>"


class OracleNormMlp(NormMlpRoute):
    route = f"{FAMILY}.oracle"

    def _rms_norm(self, x, weight, eps):
        import torch

        xd = x.double()
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())

    def _swiglu(self, gate, up):
        import torch

        return torch.nn.functional.silu(gate.double()) * up.double()


class TorchNormMlp(NormMlpRoute):
    """The baseline: transformers' own Qwen3.5 code."""

    route = f"{FAMILY}.torch"

    def _rms_norm(self, x, weight, eps):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        norm = SimpleNamespace(weight=weight, eps=eps)
        norm._norm = lambda t: Qwen3_5RMSNorm._norm(norm, t)
        return Qwen3_5RMSNorm.forward(norm, x)

    def _swiglu(self, gate, up):
        from transformers.activations import ACT2FN

        return ACT2FN["silu"](gate) * up


class TorchMlp(TorchNormMlp):
    """The baseline's code on the checkpoint's MLPs: transformers' own ``Qwen3_5MLP``."""

    route = f"{FAMILY}.torch_mlp"
    own = frozenset()  # transformers' own code serves: the ground, not a swap
    checkpoint_mlps = True


class LigerRmsNorm(NormMlpRoute):
    route = f"{FAMILY}.liger_rmsnorm"
    own = frozenset({"rms_norm"})
    liger = {"rms_norm": True, "swiglu": False}

    def _rms_norm(self, x, weight, eps):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False, None)


class LigerSwiglu(NormMlpRoute):
    route = f"{FAMILY}.liger_swiglu"
    own = frozenset({"swiglu"})
    liger = {"rms_norm": False, "swiglu": True}
    checkpoint_mlps = True

    def _swiglu(self, gate, up):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply(gate, up)


def liger_parts(impl: Any) -> dict[str, bool]:
    """What of Liger's Qwen3.5 patch a route switches on (nothing for the baseline)."""
    return {"rms_norm": False, "swiglu": False, **dict(getattr(impl, "liger", {}) or {})}


ORACLE = OracleNormMlp()
TORCH = TorchNormMlp()
TORCH_MLP = TorchMlp()
LIGER_RMSNORM = LigerRmsNorm()
LIGER_SWIGLU = LigerSwiglu()
