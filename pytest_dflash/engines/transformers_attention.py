"""``attn.d256`` routes as transformers attention functions (docs/engines.md, "Hugging Face
transformers").

transformers looks an attention layer's function up by name (``AttentionInterface``) and builds
the layer's mask with the function registered under the same name (``AttentionMaskInterface``).
:func:`register` puts a route there under its own name, so the model's own attention layers
(projections, norms, rotary embedding, cache update, output gate) run unchanged and only the
attention itself is the route's, called in the family contract
(``pytest_dflash.routes.families.AttnD256``):

- transformers calls ``f(module, query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D], mask,
  scaling=...)`` with the cache already concatenated and the GQA heads not repeated;
  the route takes them per sequence, repeats the heads itself and aligns the causal mask
  bottom-right: a fresh chunk (Sq == Skv) goes to its ``dense`` op, a chunk or a verify block
  over a cached prefix to its ``paged`` op, over a paged copy of the keys and values
  transformers concatenated (blocks of :data:`BLOCK_SIZE`, logical block i in physical block
  i ^ 1, so a route that ignores the block table is wrong), as the reference engine does;
- the mask function is transformers' ``sdpa_mask``, never skipped (:func:`route_mask`).
  Registering it matters: without one, transformers hands the function
  ``attention_mask=None`` even where keys outnumber queries. The mask it builds must be the
  causal mask of one unpadded sequence, the only mask the family contract serves, over the
  first keys (a ``StaticCache``'s slots not yet written are masked, and left out); any other
  mask (padding) is an :class:`~pytest_dflash.engines.EngineError`, never a silent drop;
- the result goes back as ``[B, Sq, Hq, D]``, as transformers expects;
- every call is counted on the calling layer itself (:func:`count_call`: ``"layer{i}:fresh"``
  for a chunk without a cached prefix, ``"layer{i}:cached"`` over one), beside the route's own
  ``dense`` or ``paged`` hit, so the engine's ``route_hits`` says which layer called which op.

An engineer's own attention function with transformers' signature becomes a route through
:class:`FunctionAttention` (``pytest_dflash.engines.own_attention`` registers it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_dflash.engines import EngineError

HEAD_DIM = 256
BLOCK_SIZE = 32  # tokens per page of the paged copy (the reference engine's KV block size)
# name -> (route name, route object): what each registered function serves (this process)
_REGISTERED: dict[str, tuple[str, Any]] = {}


def function_name(route_name: str, impl: Any) -> str:
    """The name the route's function is registered under: one per route object, so two
    registries' objects of one route name never overwrite each other. Not the route's name:
    transformers treats any name containing "flash" as a flash-attention kernel to load."""
    for name, (route, obj) in _REGISTERED.items():
        if route == route_name and obj is impl:
            return name
    return f"gated_route_{len(_REGISTERED)}"


def _attended_keys(mask: Any, sq: int, skv: int, route_name: str) -> int:
    """How many keys the queries attend: ``mask`` must be the bottom-right causal mask of one
    unpadded sequence over its first ``n`` keys, every later key masked for every query. A
    ``StaticCache`` hands over all the slots it reserved (``skv``), of which only the first
    ``n`` are written yet; the route then gets those ``n`` keys, which is what the mask says."""
    import torch

    if mask.dtype != torch.bool:
        raise EngineError(
            f"{route_name}: transformers passed a {mask.dtype} attention mask; the attn.d256 "
            "mask function is sdpa_mask (boolean): register the route with register()"
        )
    n = int(mask[-1].sum())
    causal = torch.ones(sq, n, dtype=torch.bool, device=mask.device).tril(n - sq)
    if n < sq or not bool((mask[:, :n] == causal).all()) or bool(mask[:, n:].any()):
        raise EngineError(
            f"{route_name}: transformers asked for a mask other than the causal mask of one "
            "unpadded sequence (padding, a sliding window); an attn.d256 route serves causal "
            "attention only: run the engine on unpadded single sequences"
        )
    return n


def count_call(module: Any, route_name: str, op: str, n: int = 1) -> None:
    """Count a route call on the module that made it (``module.dflash_calls``): the engine
    sums its own model's counters, so two engines of one route never share counts, and the
    global kernel hits (which the validation-cost gate compares across routes) stay the
    kernels' own."""
    from collections import Counter

    calls = getattr(module, "dflash_calls", None)
    if calls is None:
        calls = Counter()
        module.dflash_calls = calls
    calls[(route_name, op)] += n


def calls_of(model: Any) -> dict[tuple[str, str], int]:
    """Every route call counted on ``model``'s modules, summed: (route, op) -> calls."""
    from collections import Counter

    total: Counter[tuple[str, str]] = Counter()
    for module in model.modules():
        total.update(getattr(module, "dflash_calls", None) or {})
    return dict(total)


def paged_copy(k: Any, v: Any) -> tuple[Any, Any, Any]:
    """k/v ``[Skv, Hkv, D]`` as a paged cache ``[blocks, BLOCK_SIZE, Hkv, D]`` (an even number of
    blocks, logical block i stored in physical block i ^ 1) and the int32 block table."""
    import torch

    skv = k.shape[0]
    used = -(-skv // BLOCK_SIZE)
    blocks = used + used % 2
    table = torch.arange(blocks, dtype=torch.int32, device=k.device) ^ 1
    pages = []
    for t in (k, v):
        flat = t.new_zeros(blocks * BLOCK_SIZE, *t.shape[1:])
        flat[:skv] = t
        logical = flat.view(blocks, BLOCK_SIZE, *t.shape[1:])
        pages.append(logical[table.long()].contiguous())  # physical block p holds logical p ^ 1
    return pages[0], pages[1], table[:used]


def attention_function(route_name: str, impl: Any) -> Callable[..., tuple[Any, None]]:
    """The transformers attention function serving ``impl`` (an ``AttnD256`` object)."""

    def attend(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[Any, None]:
        import torch

        batch, hq, sq, dim = query.shape
        hkv, skv = key.shape[1], key.shape[2]
        if dim != HEAD_DIM:
            raise EngineError(
                f"{route_name}: the model's attention head dim is {dim}; family attn.d256 "
                f"serves head dim {HEAD_DIM} only"
            )
        groups = getattr(module, "num_key_value_groups", hq // max(hkv, 1))
        if hkv * groups != hq:
            raise EngineError(f"{route_name}: {hq} query heads are not {groups} x {hkv} "
                              "key/value heads (module.num_key_value_groups)")
        if dropout:
            raise EngineError(f"{route_name}: attention dropout {dropout}; the engine runs "
                              "the model in eval mode")
        keys = ([skv] * batch if attention_mask is None else
                [_attended_keys(attention_mask[b, 0], sq, skv, route_name)
                 for b in range(batch)])
        scale = float(scaling) if scaling is not None else dim ** -0.5
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = torch.empty(batch, sq, hq, dim, dtype=query.dtype, device=query.device)
        for b, n in enumerate(keys):
            if n == sq:
                impl.dense(q[b].contiguous(), k[b, :n].contiguous(), v[b, :n].contiguous(),
                           out[b], scale, True)
            else:
                k_cache, v_cache, table = paged_copy(k[b, :n], v[b, :n])
                impl.paged(q[b].contiguous(), k_cache, v_cache, table, n, out[b], scale, True)
            layer = getattr(module, "layer_idx", "?")
            count_call(module, route_name, f"layer{layer}:{'fresh' if n == sq else 'cached'}")
        return out, None

    attend.__qualname__ = attend.__name__ = f"attend_{route_name.replace('.', '_')}"
    return attend


def route_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``sdpa_mask``, always built. sdpa_mask returns ``None`` where torch's
    top-left ``is_causal`` suffices, which includes a first chunk over a ``StaticCache``'s
    reserved slots (more keys than queries, the unwritten ones past the queries); the route
    aligns the causal mask bottom-right, as a chunk over a cached prefix needs, so ``None``
    would make it attend those slots. With the mask, every call says which keys exist."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register(route_name: str, impl: Any) -> str:
    """Register the route as a transformers attention function with its mask function;
    returns the ``attn_implementation`` name that selects it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = function_name(route_name, impl)
    if name not in _REGISTERED:
        AttentionInterface.register(name, attention_function(route_name, impl))
        AttentionMaskInterface.register(name, route_mask)
        _REGISTERED[name] = (route_name, impl)
    return name


def served_by(attn_implementation: str) -> str | None:
    """The route a registered function name serves, None for transformers' own functions."""
    entry = _REGISTERED.get(attn_implementation)
    return entry[0] if entry else None
