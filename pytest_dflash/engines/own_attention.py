"""An engineer's own attention function as an ``attn.d256`` route (docs/engines.md, "Your own
attention function").

A function with transformers' attention-function signature,
``f(module, query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D], attention_mask, scaling=...,
dropout=..., **kwargs) -> (out [B, Sq, Hq, D], weights or None)``, is wrapped by
:func:`attention_route` into a candidate route of family ``attn.d256``; register it from a
``conftest.py`` or a plugin in ``pytest_dflash_routes``. It is then gated like any attn.d256
candidate: the op-level gates call it through the family contract (``dense`` / ``paged``), and
on the transformers engine it serves the model's attention layers.

Each call gets what transformers would hand it: query, key and value in transformers' layout
with the key/value heads not repeated (``module.num_key_value_groups`` says by how much), and
the boolean causal mask ``[B, 1, Sq, Skv]`` (True: attend) aligned bottom-right, so a chunk over
a cached prefix sees the whole prefix. A function that ignores the mask and assumes
``Sq == Skv`` is wrong there, and the gates see it.

Mistakes are usage errors before any test runs, naming the fix (:class:`RegistryError`): a name
that transformers' ``AttentionInterface`` does not know, a function whose parameters are not
transformers' signature, an output of the wrong shape on a probe call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pytest_dflash.routes.registry import RegistryError, Route

FAMILY = "attn.d256"
BASELINE = f"{FAMILY}.sdpa"
HEAD_DIM = 256
PARAMETERS = ("module", "query", "key", "value", "attention_mask")
# the op-level parity and speed, and the model-level gates of the transformers engine: ppl,
# quality and prefill (agreement with the baseline after a cold prefill, then its speed)
DEFAULT_GATES = ("parity", "ppl", "quality", "speed", "prefill")


class _Layer:
    """What an attention function may read from the calling layer (transformers passes the
    attention module): the GQA group size, the layer index, eval mode."""

    is_causal = True
    training = False

    def __init__(self, groups: int, layer_idx: int = 0) -> None:
        self.num_key_value_groups = groups
        self.layer_idx = layer_idx


def lookup(function: Callable[..., Any] | str, route_name: str) -> Callable[..., Any]:
    """The callable itself, or the function registered under that name with transformers'
    ``AttentionInterface``."""
    if callable(function):
        return function
    if not isinstance(function, str):
        raise RegistryError(f"route {route_name!r}: give an attention function or the name it is "
                            f"registered under, got {type(function).__name__}")
    from transformers import AttentionInterface

    known = AttentionInterface._global_mapping
    if function not in known:
        raise RegistryError(
            f"route {route_name!r}: transformers knows no attention function {function!r} "
            f"(AttentionInterface has {', '.join(sorted(known))}); register it first with "
            "AttentionInterface.register(name, function), or pass the function itself")
    return known[function]


def check_signature(function: Callable[..., Any], route_name: str) -> None:
    """Its first five parameters are transformers' (module, query, key, value,
    attention_mask), and it takes ``scaling`` (by name or through ``**kwargs``)."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as exc:
        raise RegistryError(f"route {route_name!r}: cannot read the signature of "
                            f"{function!r}: {exc}") from None
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(PARAMETERS)]
    takes_scaling = any(p.name == "scaling" or p.kind == p.VAR_KEYWORD for p in params)
    if len(positional) < len(PARAMETERS) or not takes_scaling:
        got = ", ".join(p.name for p in params)
        raise RegistryError(
            f"route {route_name!r}: {getattr(function, '__name__', function)}({got}) is not a "
            "transformers attention function; write f(module, query, key, value, "
            "attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out, weights)")


def causal_mask(sq: int, skv: int, device: Any) -> Any:
    """transformers' boolean mask ``[1, 1, Sq, Skv]`` (True: attend), bottom-right aligned."""
    import torch

    return torch.ones(sq, skv, dtype=torch.bool, device=device).tril(skv - sq)[None, None]


class FunctionAttention:
    """The ``AttnD256`` contract over an attention function with transformers' signature."""

    def __init__(self, route_name: str, function: Callable[..., Any]) -> None:
        self.route, self.function = route_name, function

    def _call(self, q: Any, k: Any, v: Any, softmax_scale: float, causal: bool) -> Any:
        tq, hq, dim = q.shape
        tk, hkv, _ = k.shape
        query, key, value = (t.transpose(0, 1)[None] for t in (q, k, v))
        mask = causal_mask(tq, tk, q.device) if causal else None
        result = self.function(_Layer(hq // hkv), query, key, value, mask,
                               scaling=softmax_scale, dropout=0.0)
        out = result[0] if isinstance(result, tuple) else result
        if tuple(out.shape) != (1, tq, hq, dim):
            raise ValueError(f"{self.route}: the attention function returned "
                             f"{tuple(out.shape)}, transformers expects [B, Sq, Hq, D] = "
                             f"{(1, tq, hq, dim)}")
        return out[0]

    def dense(self, q: Any, k: Any, v: Any, out: Any, softmax_scale: float,
              causal: bool) -> None:
        from dflash_kernels.attention import _check_dense
        from pytest_dflash.native import hits

        _check_dense(q, k, v, out)
        hits.record(self.route, "dense")
        out.copy_(self._call(q, k, v, softmax_scale, causal))

    def paged(self, q: Any, k_cache: Any, v_cache: Any, block_table: Any, kv_len: int,
              out: Any, softmax_scale: float, causal: bool) -> None:
        from dflash_kernels.attention import _check_dense, gather_pages
        from pytest_dflash.native import hits

        k, v = gather_pages(k_cache, v_cache, block_table, kv_len)
        _check_dense(q, k, v, out)
        hits.record(self.route, "paged")
        out.copy_(self._call(q, k, v, softmax_scale, causal))

    def __repr__(self) -> str:
        return f"<own attention {self.route}: {getattr(self.function, '__name__', '?')}>"


def check_output(impl: FunctionAttention) -> None:
    """One probe call (GQA 2:1, 3 queries over 5 keys): the output must have transformers'
    shape and the query's dtype."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, HEAD_DIM, generator=gen)
    k, v = (torch.randn(5, 1, HEAD_DIM, generator=gen) for _ in range(2))
    try:
        out = impl._call(q, k, v, HEAD_DIM ** -0.5, True)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
    except Exception as exc:  # the engineer's code: any failure is a usage error naming it
        raise RegistryError(f"{impl.route}: the attention function failed on a probe call "
                            f"(query [1, 2, 3, 256], key/value [1, 1, 5, 256]): "
                            f"{type(exc).__name__}: {exc}") from None
    if out.dtype != q.dtype:
        raise RegistryError(f"{impl.route}: the attention function returned {out.dtype} for "
                            f"{q.dtype} queries; return the query's dtype")


def attention_route(name: str, function: Callable[..., Any] | str, *,
                    gates: tuple[str, ...] = DEFAULT_GATES, description: str = "") -> Route:
    """A candidate route of family attn.d256 (baseline ``attn.d256.sdpa``) served by
    ``function``: register it with ``registry.register(attention_route(...))``."""
    if not name.startswith(FAMILY + "."):
        raise RegistryError(f"route {name!r}: an attention route is named "
                            f"'{FAMILY}.<yours>', e.g. '{FAMILY}.mine'")
    fn = lookup(function, name)
    check_signature(fn, name)
    impl = FunctionAttention(name, fn)
    check_output(impl)
    return Route(name, FAMILY, "candidate", baseline=BASELINE, gates=tuple(gates), impl=impl,
                 description=description or f"own attention function "
                                            f"{getattr(fn, '__name__', function)}")
