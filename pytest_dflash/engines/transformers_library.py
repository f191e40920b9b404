"""Switching library routes into a transformers model where the modelling code dispatches.

**Gated DeltaNet (family ``linear.gdn``).** The layers call transformers' dispatch points
(``pytest_dflash.library.dispatch_points``). :class:`GdnSwitch` puts the selected route's ops at
those names while its engine runs (and puts back exactly what was there afterwards), so two
engines of one process (baseline and candidate) each run their own route, and the baseline runs
the torch code even where fla is installed. Each call is counted on the calling layer
(``layer{i}:chunk:m>8`` ...) under the route whose own code served it. Each layer's gated
``norm`` is swapped for :class:`RouteGatedNorm` (per model), which calls the route's
``gated_norm`` with the layer's weight.

**Liger (family ``norm_mlp``).** :func:`apply_liger` runs ``apply_liger_kernel_to_qwen3_5`` on
one model instance and then restores the module-level classes it also replaces, so models built
later (the baseline's) keep transformers' own; each patched norm counts its calls. A route that
serves the checkpoint's gated MLPs (Liger's SwiGLU and its baseline ``norm_mlp.torch_mlp``)
counts each MLP's calls under its name (:func:`serve_checkpoint_mlps`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from pytest_dflash.engines import EngineError, EngineUnsupported
from pytest_dflash.library.dispatch_points import (
    DISPATCH,
    MAX_VERIFY_ROWS,
    NoModellingCode,
    torch_fallbacks,
)
from pytest_dflash.library.dispatch_points import modelling_module as _modelling_module


def modelling_module() -> ModuleType:
    """transformers' Qwen3.5 modelling module, or EngineUnsupported naming the fix."""
    try:
        return _modelling_module()
    except NoModellingCode as exc:
        raise EngineUnsupported(str(exc)) from None


def _module_base() -> type:
    import torch

    return torch.nn.Module


class RouteGatedNorm(_module_base()):  # type: ignore[misc]
    """A gated-DeltaNet layer's output norm served by a ``linear.gdn`` route's
    ``gated_norm``, with the layer's own weight and epsilon; counts its calls."""

    def __init__(self, inner: Any, route_name: str, impl: Any, layer_idx: Any,
                 baseline: str) -> None:
        super().__init__()
        self.inner, self.route_name, self.impl = inner, route_name, impl
        self.baseline = baseline  # whose code a call the route leaves to the baseline runs
        self.op = f"layer{layer_idx}:gated_norm"

    def forward(self, hidden_states: Any, gate: Any = None) -> Any:
        from pytest_dflash.engines.transformers_attention import count_call

        out = self.impl.gated_norm(hidden_states, gate, self.inner.weight,
                                   self.inner.variance_epsilon)
        served = self.route_name if getattr(self.impl, "last_served", True) else None
        count_call(self, served or self.baseline, self.op)
        return out.to(hidden_states.dtype)


def gdn_layers(model: Any) -> list[Any]:
    """The model's gated-DeltaNet layers: modules whose modelling module has the dispatch
    points (Qwen3.5 and the models that share its layer)."""
    found = []
    for module in model.modules():
        owner = sys.modules.get(type(module).__module__)
        if (owner is not None and type(module).__name__.endswith("GatedDeltaNet")
                and all(hasattr(owner, name) for name in DISPATCH.values())):
            found.append(module)
    return found


class GdnSwitch:
    """One engine's ``linear.gdn`` route inside its model (see the module docstring)."""

    def __init__(self, model: Any, route_name: str, impl: Any, baseline: str) -> None:
        self.route_name, self.impl, self.baseline = route_name, impl, baseline
        self.layers = gdn_layers(model)
        self.root = model
        if not self.layers:
            if route_name != baseline:
                raise EngineUnsupported(
                    f"route {route_name} cannot be applied in {type(model).__name__}: it has "
                    "no gated-DeltaNet layers; gate it on a Qwen3.5-architecture model (the "
                    "default --dflash-engine hf model)")
            self.modules: list[ModuleType] = []
            return
        self.modules = list({id(m): m for m in
                             (sys.modules[type(layer).__module__] for layer in self.layers)
                             }.values())
        # every route's gated norm is called through its contract, the baseline's too (it
        # runs transformers' own forward), so a verify step records the same kernels whichever
        # route leaves its norm to the baseline
        for layer in self.layers:
            layer.norm = RouteGatedNorm(layer.norm, route_name, impl,
                                        getattr(layer, "layer_idx", "?"), baseline)
        try:
            torch_fallbacks()  # resolved before any switch is installed
        except NoModellingCode as exc:
            raise EngineUnsupported(str(exc)) from None
        self._ops = {name: self._dispatch(op) for op, name in DISPATCH.items()}

    def _dispatch(self, op: str) -> Callable[..., Any]:
        route_op = getattr(self.impl, op)
        route_name, baseline, root, impl = self.route_name, self.baseline, self.root, self.impl

        def dispatched(query: Any, key: Any, value: Any, g: Any = None, beta: Any = None,
                       initial_state: Any = None, output_final_state: bool = False,
                       use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None,
                       **kwargs: Any) -> Any:
            from pytest_dflash.engines.transformers_attention import count_call

            if cu_seqlens is not None:
                raise EngineError(f"{route_name}: transformers passed packed sequences "
                                  "(cu_seqlens); the engine runs one unpadded sequence")
            out, state = route_op(query, key, value, g, beta, initial_state,
                                  output_final_state, use_qk_l2norm_in_kernel)
            caller = sys._getframe(1).f_locals.get("self")  # the layer that called the point
            layer = caller if caller is not None and hasattr(caller, "layer_idx") else root
            served = route_name if getattr(impl, "last_served", True) else baseline
            rows = "m<=8" if query.shape[1] <= MAX_VERIFY_ROWS else "m>8"
            count_call(layer, served, f"layer{getattr(layer, 'layer_idx', '?')}:{op}:{rows}")
            if state is not None and initial_state is not None:
                state = state.to(initial_state.dtype)  # the cache keeps what it holds
            # the layer's dtype, as transformers' fallback returns it
            return out.to(query.dtype), state

        dispatched.__name__ = dispatched.__qualname__ = f"{DISPATCH[op]}_via_route"
        # what transformers put there, for anyone resolving the fallback while this is installed
        dispatched.__dflash_original__ = getattr(self.modules[0], DISPATCH[op])  # type: ignore[attr-defined]
        return dispatched

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The route's ops at the dispatch points while the block runs; whatever was there
        before is put back afterwards, also on an error."""
        saved = [(module, name, getattr(module, name))
                 for module in self.modules for name in self._ops]
        try:
            for module, name, _ in saved:
                setattr(module, name, self._ops[name])
            yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)


def apply_liger(model: Any, route_name: str, rms_norm: bool, swiglu: bool) -> int:
    """Liger's ``apply_liger_kernel_to_qwen3_5`` on ``model`` only (no loss patching, no
    rotary: Liger has none for Qwen3.5), the modelling module's classes restored afterwards;
    every patched norm counts its calls. Returns how many norms were patched."""
    from transformers import PreTrainedModel

    module = modelling_module()
    if not isinstance(model, PreTrainedModel) or type(model).__module__ != module.__name__:
        raise EngineUnsupported(
            f"route {route_name} applies Liger's Qwen3.5 patch; {type(model).__name__} is not "
            "a Qwen3.5 model: gate it on the default --dflash-engine hf model")
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

    saved = dict(vars(module))
    norms = [m for m in model.modules() if type(m) is module.Qwen3_5RMSNorm]
    try:
        apply_liger_kernel_to_qwen3_5(rope=False, cross_entropy=False,
                                      fused_linear_cross_entropy=False, rms_norm=rms_norm,
                                      swiglu=swiglu, model=model)
    finally:
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
    patched = 0
    if rms_norm:
        for norm in norms:
            _count_forward(norm, route_name, "rms_norm")
            patched += 1
    return patched


def serve_checkpoint_mlps(model: Any, route_name: str,
                          swiglu: Callable[[Any, Any], Any] | None = None) -> int:
    """The model's gated MLPs (transformers' own ``Qwen3_5MLP`` modules, as Liger may have
    patched their forward) served by ``route_name``: every call counted under it (op ``mlp``);
    with ``swiglu``, each MLP computes ``down(swiglu(gate(x), up(x)))``, the route's SiLU-mul
    between the checkpoint's projections. Returns how many. None found is EngineUnsupported:
    the route would silently serve nothing."""
    module = modelling_module()
    mlps = [m for m in model.modules() if type(m) is module.Qwen3_5MLP]
    if not mlps:
        raise EngineUnsupported(
            f"route {route_name} serves a Qwen3.5 model's gated MLPs; "
            f"{type(model).__name__} has no Qwen3_5MLP: gate it on the default "
            "--dflash-engine hf model")
    for mlp in mlps:
        if swiglu is not None:
            mlp.forward = _route_mlp_forward(mlp, swiglu)
        _count_forward(mlp, route_name, "mlp")
    return len(mlps)


def _route_mlp_forward(mlp: Any, swiglu: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    def forward(x: Any) -> Any:
        return mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))

    return forward


def _count_forward(module: Any, route_name: str, op: str) -> None:
    """Count every call of ``module`` (its forward, as patched) on the module itself."""
    from pytest_dflash.engines.transformers_attention import count_call

    forward = module.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        count_call(module, route_name, op)
        return forward(*args, **kwargs)

    module.forward = counted
