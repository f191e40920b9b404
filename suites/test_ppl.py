"""Perplexity gate of every family the engine applies (docs/gates.md, "ppl").

A route that changes numerics (the fp16 SSM state) must not change what the model predicts: the
candidate's and the baseline's engines score the same held-out segments (standard-library modules
never trained on, or ``--dflash-data``), each with the engine's BOS prefix, and the largest
per-segment relative change of perplexity, |PPL(candidate) / PPL(baseline) - 1|, must stay
within ``policy.ppl_rel_tolerance`` per token and ``policy.ppl_byte_rel_tolerance`` per byte
(tokenizer-independent). A relative change means the same on every model, whatever its own
perplexity. Corpus perplexity and bits per byte of both are reported.

Those segments are shorter than any prefill chunk, so they never see a chunk seam. The
long-context test scores held-out contexts (whole modules concatenated) long enough to cross at
least three seams of both routes' chunk sizes, and compares the perplexity per position band:
before the first seam, the ``policy.ppl_band_tokens`` positions after each seam, and the tail
(``pytest_dflash.metrics.seam_bands``).
"""

from __future__ import annotations

import weakref

import pytest

from dflash_suites.support.engine import ENGINE_FAMILIES, Served

pytestmark = pytest.mark.sm70

# The baseline engine's log-probs of each segment and long context, kept for the session: every
# geometry candidate is compared with the same baseline engine on the same text, and a deterministic
# engine (the speed gate checks bitwise-equal repeats) scores them the same every time.
_BASELINE_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# position bands of a long context whose chunk seams nobody declares (a server route)
SEAMLESS_BANDS = 4


def baseline_score(engine, ids: list[int]) -> list[float]:
    """``engine.score(ids)``, once per engine and token sequence."""
    try:
        cache = _BASELINE_SCORES.setdefault(engine, {})
    except TypeError:  # an engine object that cannot be weakly referenced: no caching
        return engine.score(ids)
    key = tuple(ids)
    if key not in cache:
        cache[key] = engine.score(ids)
    return cache[key]


def score_segments(engine, segments: list[dict], baseline: bool = False) -> dict:
    """Per-token log-probs of each segment, prefixed with the engine's own BOS (the engine
    protocol's ``encode(text, add_special_tokens=True)``), through the perplexity metric; plus
    per-segment byte-level perplexities exp(NLL / UTF-8 bytes), comparable across tokenizers.
    The ``baseline`` engine's scores are kept for the session (:func:`baseline_score`)."""
    import math

    from pytest_dflash.metrics import load_metric

    logprobs, num_bytes = [], []
    for row in segments:
        ids = engine.encode(row["text"], add_special_tokens=True)
        logprobs.append(baseline_score(engine, ids) if baseline else engine.score(ids))
        num_bytes.append(len(row["text"].encode("utf-8")))
    result = load_metric("perplexity").compute(logprobs=logprobs, num_bytes=num_bytes)
    result["byte_perplexities"] = [math.exp(-math.fsum(lp) / n)
                                   for lp, n in zip(logprobs, num_bytes, strict=True)]
    return result


def worst_delta(base: list[float], cand: list[float]) -> tuple[int, float]:
    """The index and size of the largest relative change |cand / base - 1|."""
    deltas = [abs(c / b - 1.0) for c, b in zip(cand, base, strict=True)]
    worst = max(range(len(deltas)), key=deltas.__getitem__)
    return worst, deltas[worst]


@pytest.mark.gate("ppl", family=ENGINE_FAMILIES)
def test_ppl_heldout_segments(dflash_gate):
    """max per-segment |PPL(candidate) / PPL(baseline) - 1| <= policy.ppl_rel_tolerance per
    token, and the same per byte <= policy.ppl_byte_rel_tolerance."""
    from pytest_dflash.engines.data import ppl_segments

    route, policy = dflash_gate.route, dflash_gate.policy
    segments = ppl_segments(dflash_gate.profile, dflash_gate.data_dir)
    baseline, candidate = dflash_gate.require("prompt_logprobs")
    base = score_segments(baseline, segments, baseline=True)
    served = Served(candidate, route.name)
    cand = score_segments(candidate, segments)
    dflash_gate.record_engines(baseline, candidate)
    ran = served.check(f"{len(segments)} scored segments")
    dflash_gate.record(candidate_route_hits=ran)
    worst, delta = worst_delta(base["perplexities"], cand["perplexities"])
    worst_b, delta_b = worst_delta(base["byte_perplexities"], cand["byte_perplexities"])
    tol, tol_b = policy.ppl_rel_tolerance, policy.ppl_byte_rel_tolerance
    dflash_gate.record(
        figure=f"per token: max per-segment PPL change {delta:.2e} (tolerance {tol:g}), PPL "
               f"{base['perplexity']:.4f} -> {cand['perplexity']:.4f}; per byte: max change "
               f"{delta_b:.2e} (tolerance {tol_b:g}), {base['bits_per_byte']:.4f} -> "
               f"{cand['bits_per_byte']:.4f} bits/byte",
        max_ppl_rel_delta=delta, ppl_rel_tolerance=tol,
        max_byte_ppl_rel_delta=delta_b, ppl_byte_rel_tolerance=tol_b,
        margin=max(delta / tol if tol else float("inf"), delta_b / tol_b if tol_b
                   else float("inf")),
        worst_segment=segments[worst]["id"], worst_segment_bytes=segments[worst_b]["id"],
        ppl_baseline=base["perplexity"], ppl_candidate=cand["perplexity"],
        bits_per_byte_baseline=base["bits_per_byte"],
        bits_per_byte_candidate=cand["bits_per_byte"],
        per_segment_baseline=base["perplexities"], per_segment_candidate=cand["perplexities"],
        per_segment_bytes_baseline=base["byte_perplexities"],
        per_segment_bytes_candidate=cand["byte_perplexities"],
        segments=len(segments), tokens=cand["tokens"], bytes=cand["bytes"],
        data=str(dflash_gate.data_dir) if dflash_gate.data_dir else "shipped",
    )
    failures = []
    if delta > tol:
        failures.append(
            f"segment {segments[worst]['id']} perplexity per token "
            f"{base['perplexities'][worst]:.5f} (baseline {route.baseline}) -> "
            f"{cand['perplexities'][worst]:.5f}: change {delta:.4%} > tolerance {tol:.4%}")
    if delta_b > tol_b:
        failures.append(
            f"segment {segments[worst_b]['id']} perplexity per byte "
            f"{base['byte_perplexities'][worst_b]:.5f} -> "
            f"{cand['byte_perplexities'][worst_b]:.5f}: change {delta_b:.4%} > tolerance "
            f"{tol_b:.4%}")
    assert not failures, f"{route.name}: " + "; ".join(failures)


@pytest.mark.gate("ppl", family=ENGINE_FAMILIES)
def test_ppl_long_contexts(dflash_gate):
    """Per position band of each long context, |PPL(candidate) / PPL(baseline) - 1| <=
    policy.ppl_band_rel_tolerance (before the first seam, after each seam, the tail).

    A route whose engine runs a chunk nobody declares (a server route switched through its
    environment, an outside engine) is scored on equal position bands and the tail instead:
    the same figures, without seam positions (``seam_bands.declared_chunk``)."""
    from pytest_dflash.engines.data import long_contexts
    from pytest_dflash.metrics.seam_bands import (
        band_perplexities,
        bands,
        declared_chunk,
        even_bands,
    )

    route, policy, profile = dflash_gate.route, dflash_gate.policy, dflash_gate.profile
    baseline, candidate = dflash_gate.require("prompt_logprobs")
    chunk = declared_chunk(candidate, route, profile)
    base_chunk = declared_chunk(baseline, dflash_gate.baseline_route, profile)
    need = dflash_gate.sizes.ppl_long_tokens
    if chunk is not None:  # three seams of both chunk sizes, and a tail behind the last seam
        need = max(need, 3 * max(chunk, base_chunk or 0) + policy.ppl_band_tokens + 2)
    contexts = long_contexts(profile, baseline.encode, need, dflash_gate.data_dir)
    per_context, worst = {}, None
    served = Served(candidate, route.name)
    for context in contexts:
        ids = context["ids"]
        cuts = (bands(len(ids), chunk, policy.ppl_band_tokens) if chunk is not None
                else even_bands(len(ids), SEAMLESS_BANDS, policy.ppl_band_tokens))
        base = band_perplexities(baseline_score(baseline, ids), cuts)
        cand = band_perplexities(candidate.score(ids), cuts)
        rows = [{"band": b.label, "positions": [b.start, b.end], "ppl_baseline": x,
                 "ppl_candidate": y, "delta": y / x - 1.0}
                for b, x, y in zip(cuts, base, cand, strict=True)]
        per_context[context["id"]] = rows
        for row in rows:
            if worst is None or abs(row["delta"]) > abs(worst[1]["delta"]):
                worst = (context["id"], row)
    dflash_gate.record_engines(baseline, candidate)
    dflash_gate.record(candidate_route_hits=served.check(f"{len(contexts)} scored long contexts"))
    where, row = worst
    delta = abs(row["delta"])
    tol = policy.ppl_band_rel_tolerance
    if chunk is not None:
        seams_crossed = min(len(rows) - 2 for rows in per_context.values())
        where_seams = f"{seams_crossed} seams of Q{chunk}"
    else:
        where_seams = f"chunk not declared: {SEAMLESS_BANDS} position bands"
    dflash_gate.record(
        figure=f"long contexts ({len(contexts)} x {need} tokens, {where_seams}): max band "
               f"PPL change {delta:.2e} (tolerance {tol:g}) at {where} {row['band']}",
        max_band_ppl_rel_delta=delta, ppl_band_rel_tolerance=tol,
        margin=delta / tol if tol else float("inf"),
        worst_context=where, worst_band=row["band"], context_tokens=need,
        chunk_tokens={"candidate": chunk, "baseline": base_chunk},
        band_tokens=policy.ppl_band_tokens, bands=per_context,
        data=str(dflash_gate.data_dir) if dflash_gate.data_dir else "shipped",
    )
    assert delta <= tol, (
        f"{route.name}: long context {where}, {row['band']} (positions {row['positions']}): "
        f"perplexity {row['ppl_baseline']:.5f} (baseline {route.baseline}) -> "
        f"{row['ppl_candidate']:.5f}: change {delta:.4%} > tolerance {tol:.4%}")
