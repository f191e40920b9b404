"""Where a prefill geometry's chunk seams fall, and the figures the model-level gates take
around them (docs/gates.md, "ppl" and "speed"): perplexity per position band and the positions
the cold-prefill agreement check compares.

A geometry route prefills in chunks of Q tokens; chunk k holds tokens [kQ, (k+1)Q), so its seams
are the positions s = Q, 2Q, ... < T. Whatever the route carries across a seam (SSM and conv
state, paged KV) first shows in the logits at position s, which predict token s + 1. Positions
here are logit positions: position i predicts token i + 1, which is also the index of that
token's log-prob in ``Engine.score``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


def seams(length: int, chunk: int) -> list[int]:
    """The seams of a ``length``-token prefill in chunks of ``chunk`` tokens."""
    if chunk < 1:
        raise ValueError(f"chunk size must be >= 1 token, got {chunk}")
    return list(range(chunk, length, chunk))


@dataclass(frozen=True)
class Band:
    """Logit positions [start, end) of one context, named for the report."""

    label: str
    start: int
    end: int


def bands(length: int, chunk: int, window: int) -> list[Band]:
    """The position bands of a ``length``-token context scored in chunks of ``chunk``: before
    the first seam, the ``window`` positions after each seam (up to the next seam), and the
    last ``window`` positions (the tail, where every seam's effect has accumulated)."""
    scored = length - 1  # positions 0 .. length - 2 predict a token of the context
    cuts = seams(length, chunk)
    if not cuts:
        raise ValueError(f"a context of {length} tokens has no seam at chunk size {chunk}")
    out = [Band("before seam 1", 0, cuts[0])]
    for n, start in enumerate(cuts, 1):
        end = min(start + window, cuts[n] if n < len(cuts) else scored, scored)
        if end > start:
            out.append(Band(f"after seam {n} (@{start})", start, end))
    out.append(Band("tail", max(0, scored - window), scored))
    return out


def declared_chunk(engine: Any, route: Any, profile: str) -> int | None:
    """The prefill chunk an engine runs, where something says: the engine's own ``chunk``
    (the reference and transformers engines), else the chunk the route declares (its
    implementation's ``chunk(profile)``, the prefill.geometry contract). None where neither
    does: a server route switched through ``server_env`` (``impl`` None), an outside engine.
    Then the seams are unknown and the gates take band figures without seam positions."""
    chunk = getattr(engine, "chunk", None)
    if isinstance(chunk, int) and chunk > 0:
        return chunk
    declared = getattr(route.implementation(), "chunk", None)
    return int(declared(profile)) if callable(declared) else None


def even_bands(length: int, parts: int, window: int) -> list[Band]:
    """The position bands of a ``length``-token context whose chunk seams are unknown: ``parts``
    consecutive bands of equal length, and the last ``window`` positions (the tail, where
    whatever the engine carries along the context has accumulated)."""
    scored = length - 1
    if parts < 1 or scored < parts:
        raise ValueError(f"cannot cut {scored} scored positions into {parts} bands")
    edges = [round(scored * k / parts) for k in range(parts + 1)]
    out = [Band(f"positions {a}-{b - 1}", a, b) for a, b in zip(edges, edges[1:], strict=False)]
    out.append(Band("tail", max(0, scored - window), scored))
    return out


def band_perplexities(logprobs: Sequence[float], context_bands: Iterable[Band]) -> list[float]:
    """exp(mean NLL) over each band's positions of one context's ``Engine.score`` log-probs."""
    out = []
    for band in context_bands:
        part = logprobs[band.start : band.end]
        if not part:
            raise ValueError(
                f"band {band.label} [{band.start}, {band.end}) is empty for "
                f"{len(logprobs)} scored positions"
            )
        out.append(math.exp(-math.fsum(part) / len(part)))
    return out


def agreement_positions(length: int, chunks: Iterable[int], rows: int) -> list[int]:
    """The logit positions the agreement check compares in a ``length``-token prompt: the
    first ``rows`` positions after every seam of each chunk size (both routes' seams), and the
    last position (the first generated token)."""
    picked = {length - 1}
    for chunk in chunks:
        for start in seams(length, chunk):
            picked.update(range(start, min(start + rows, length)))
    return sorted(picked)
