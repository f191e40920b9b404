"""The ``prefill.geometry`` route's recurrent-state storage, set through the transformers cache
(docs/engines.md, "Hugging Face transformers").

A hybrid model (Qwen3.5: gated-DeltaNet layers beside full attention) carries each linear
layer's recurrent state between calls in its cache. transformers allocates that state from its
first write and keeps it in the dtype the layer computed (fp32). :class:`GeometryCache` stores
it in the route's ``state_dtype`` instead: every state the model writes is rounded to it on the
way into the cache, and the next chunk reads it back from there (the layer computes in fp32
again), so an fp16 state is rounded at every chunk seam, as the shipped fp16_q7920 geometry
does. An fp32 route leaves the cache exactly as transformers' ``DynamicCache``.
"""

from __future__ import annotations

from typing import Any


def _dynamic_cache() -> type:
    from transformers import DynamicCache

    return DynamicCache


def geometry_cache(config: Any, state_dtype: Any) -> Any:
    """A dynamic cache of ``config``'s layers storing recurrent states in ``state_dtype``."""
    base = _dynamic_cache()

    class GeometryCache(base):  # type: ignore[misc, valid-type]
        """DynamicCache whose linear-attention states are stored in ``state_dtype``."""

        def update_recurrent_state(self, recurrent_states: Any, layer_idx: int,
                                   state_idx: int = 0, **kwargs: Any) -> Any:
            super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
            states = self.layers[layer_idx].recurrent_states
            if states[state_idx].dtype != state_dtype:  # the first write allocated it
                states[state_idx] = states[state_idx].to(state_dtype)
            return states[state_idx]

    return GeometryCache(config=config)


def recurrent_state_dtypes(cache: Any) -> set[str]:
    """The dtypes the cache's linear layers hold their recurrent states in (what ran)."""
    found = set()
    for layer in getattr(cache, "layers", []):
        for state in (getattr(layer, "recurrent_states", None) or {}).values():
            if state is not None:
                found.add(str(state.dtype).removeprefix("torch."))
    return found
