"""``gemm.nvfp4`` routes as a transformers model's MLPs (docs/engines.md, "Hugging Face
transformers").

A gated MLP of transformers (``gate_proj``, ``up_proj``, ``down_proj`` without bias, SiLU: the
Llama and Qwen families) is swapped for :class:`NVFP4MLP`, which holds the same weights quantized
once to NVFP4, gate and up fused into one weight as the shipped stack runs them, each prepared
once by the route (``GemmNvfp4.prepare``). Its forward is the route's ``gate_up`` then
``linear``: every row the layer sees (M <= 8 verify rows, large-M prefill chunks) goes through
the route. The codes come from :func:`dflash_kernels.nvfp4.quantize` of the checkpoint's
weights, so every route of one model, baseline included, runs the same codes, and a verdict
compares routes, not quantization. Each call is counted on the module (``"m<=8"`` or ``"m>8"``,
two GEMMs a call) beside the route's own hits, so ``route_hits`` counts the MLP GEMM calls made
inside the model by M branch.
"""

from __future__ import annotations

from typing import Any

from pytest_dflash.engines import EngineUnsupported

MAX_VERIFY_ROWS = 8
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def gated_mlps(model: Any) -> list[tuple[Any, str, Any]]:
    """(parent module, attribute, MLP module) of every gated MLP of ``model``."""
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if all(hasattr(child, p) for p in PROJECTIONS) and not isinstance(child, NVFP4MLP):
                found.append((parent, attr, child))
    return found


def _check(mlp: Any, where: str) -> None:
    for name in PROJECTIONS:
        layer = getattr(mlp, name)
        if getattr(layer, "bias", None) is not None:
            raise EngineUnsupported(f"{where}.{name} has a bias; the gemm.nvfp4 routes serve "
                                    "x @ W^T only")
        if layer.weight.shape[1] % 64 or layer.weight.shape[0] % 32:
            raise EngineUnsupported(
                f"{where}.{name} is {tuple(layer.weight.shape)}: the gemm.nvfp4 contract needs "
                "K % 64 == 0 and N % 32 == 0 (QPN layouts); use a model whose hidden and "
                "intermediate sizes are multiples of 64")
    act = getattr(getattr(mlp, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise EngineUnsupported(f"{where}: activation {act!r}; the fused gate_up of gemm.nvfp4 "
                                "is silu(gate) * up")


def _module_base() -> type:
    import torch

    return torch.nn.Module


class NVFP4MLP(_module_base()):  # type: ignore[misc]
    """A gated MLP whose projections are NVFP4 codes served by one gemm.nvfp4 route."""

    def __init__(self, mlp: Any, route_name: str, gemm: Any, where: str) -> None:
        import torch

        from dflash_kernels.nvfp4 import quantize

        super().__init__()
        _check(mlp, where)
        self.route_name, self.gemm, self.where = route_name, gemm, where
        gate, up, down = (getattr(mlp, p).weight.detach().float() for p in PROJECTIONS)
        self.out_dtype = mlp.down_proj.weight.dtype
        self.gate_up = gemm.prepare(quantize(torch.cat([gate, up]).contiguous()))
        self.down = gemm.prepare(quantize(down.contiguous()))

    def forward(self, x: Any) -> Any:
        import torch

        from pytest_dflash.engines.transformers_attention import count_call

        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        work = rows if rows.dtype in (torch.float32, torch.float16) else rows.float()
        act = self.gemm.gate_up(work.contiguous(), self.gate_up)
        out = self.gemm.linear(act, self.down)
        m = rows.shape[0]
        count_call(self, self.route_name, "m<=8" if m <= MAX_VERIFY_ROWS else "m>8", 2)
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.where}, route={self.route_name}"


def quantize_mlps(model: Any, route_name: str, gemm: Any) -> int:
    """Swap every gated MLP of ``model`` for an :class:`NVFP4MLP` of the route; returns how many
    (none found is an EngineUnsupported: the family would silently not run)."""
    mlps = gated_mlps(model)
    if not mlps:
        raise EngineUnsupported(
            f"{type(model).__name__} has no gated MLP (gate_proj, up_proj, down_proj): "
            "family gemm.nvfp4 cannot be applied in it")
    names = {id(m): n for n, m in model.named_modules()}
    for parent, attr, mlp in mlps:
        setattr(parent, attr, NVFP4MLP(mlp, route_name, gemm, names.get(id(mlp), attr)))
    return len(mlps)
