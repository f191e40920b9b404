"""Where transformers' Qwen3.5 dispatches its gated-DeltaNet ops, and the torch code behind them.

transformers (5.15 and later) decorates Qwen3.5's ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` with ``use_kernel_func_from_hub_with_fallback``: at import
time it binds flash-linear-attention's kernel when fla can be imported, and keeps the torch code
as the wrapper's ``__wrapped__``. The layer calls the module-level name, so that name is the
dispatch point; with the ``kernels`` package installed the name holds a ``Func`` module whose
``forward`` calls the same wrapper. The ``linear.gdn`` baseline runs the torch code found here
(:func:`torch_fallbacks`), and the transformers engine switches routes in at these names
(``pytest_dflash.engines.transformers_library``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

MODELLING = "transformers.models.qwen3_5.modeling_qwen3_5"
DISPATCH = {"chunk": "torch_chunk_gated_delta_rule",
            "recurrent": "torch_recurrent_gated_delta_rule"}
MAX_VERIFY_ROWS = 8


class NoModellingCode(ImportError):
    """transformers is missing, or too old to have Qwen3.5; the message names the fix."""


def modelling_module() -> ModuleType:
    """transformers' Qwen3.5 modelling module, or :class:`NoModellingCode` naming the fix."""
    import importlib

    try:
        return importlib.import_module(MODELLING)
    except ImportError as exc:
        raise NoModellingCode(
            f"transformers has no Qwen3.5 modelling code ({exc}); family linear.gdn needs "
            "transformers >= 5.15: pip install -U 'pytest-dflash[hf]'") from None


def dispatcher_of(point: Any) -> Callable[..., Any]:
    """transformers' dispatch function behind a dispatch point: the point itself, or the
    function a ``kernels`` ``Func`` module calls (the ``func`` of its ``forward``'s closure)."""
    forward = getattr(type(point), "forward", None)
    inner = _closure(forward, "func") if forward is not None else None
    return inner if inner is not None else point


def _closure(function: Callable[..., Any], name: str) -> Any:
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars or not function.__closure__:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def dispatch_target(point: Any) -> dict[str, Any]:
    """What transformers' dispatch point does by default: ``fallback`` (the torch code, the
    wrapper's ``__wrapped__``), ``implementation`` (what it bound at import: fla's kernel when
    fla imported, else the torch code) and ``library`` (whether that is a library's)."""
    point = getattr(point, "__dflash_original__", point)  # a switch installed now: the original
    dispatcher = dispatcher_of(point)
    fallback = getattr(dispatcher, "__wrapped__", dispatcher)
    bound = _closure(dispatcher, "implementation")
    implementation = bound if bound is not None else fallback
    return {"dispatcher": dispatcher, "fallback": fallback, "implementation": implementation,
            "library": implementation is not fallback}


@functools.lru_cache(maxsize=1)
def torch_fallbacks() -> SimpleNamespace:
    """The torch code transformers' Qwen3.5 runs without flash-linear-attention: ``chunk`` and
    ``recurrent`` (the dispatch points' ``__wrapped__``) and ``gated_norm`` (the unbound
    ``Qwen3_5RMSNormGated.forward``)."""
    module = modelling_module()
    ops = {op: dispatch_target(getattr(module, name))["fallback"]
           for op, name in DISPATCH.items()}
    return SimpleNamespace(**ops, gated_norm=module.Qwen3_5RMSNormGated.forward)
