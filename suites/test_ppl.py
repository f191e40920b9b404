"""Perplexity gate of family prefill.geometry (docs/gates.md, "ppl").

A route that changes numerics (the fp16 SSM state) must not change what the model predicts: the
candidate's and the baseline's engines score the same held-out segments (standard-library modules
never trained on, or ``--dflash-data``), each with the engine's BOS prefix, and the largest
per-segment perplexity difference must stay within ``policy.ppl_tolerance`` per token and
``policy.ppl_byte_tolerance`` per byte (tokenizer-independent). Corpus perplexity and bits per
byte of both are reported.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sm70


def score_segments(engine, segments: list[dict]) -> dict:
    """Per-token log-probs of each segment, prefixed with the engine's own BOS (the engine
    protocol's ``encode(text, add_special_tokens=True)``), through the perplexity metric; plus
    per-segment byte-level perplexities exp(NLL / UTF-8 bytes), comparable across tokenizers."""
    import math

    from pytest_dflash.metrics import load_metric

    logprobs, num_bytes = [], []
    for row in segments:
        ids = engine.encode(row["text"], add_special_tokens=True)
        logprobs.append(engine.score(ids))
        num_bytes.append(len(row["text"].encode("utf-8")))
    result = load_metric("perplexity").compute(logprobs=logprobs, num_bytes=num_bytes)
    result["byte_perplexities"] = [math.exp(-math.fsum(lp) / n)
                                   for lp, n in zip(logprobs, num_bytes, strict=True)]
    return result


def worst_delta(base: list[float], cand: list[float]) -> tuple[int, float]:
    deltas = [abs(c - b) for c, b in zip(cand, base, strict=True)]
    worst = max(range(len(deltas)), key=deltas.__getitem__)
    return worst, deltas[worst]


@pytest.mark.gate("ppl", family="prefill.geometry")
def test_ppl_heldout_segments(dflash_gate):
    """max per-segment |PPL(candidate) - PPL(baseline)| <= policy.ppl_tolerance per token, and
    the same per byte <= policy.ppl_byte_tolerance."""
    from pytest_dflash.engines.data import ppl_segments

    route, policy = dflash_gate.route, dflash_gate.policy
    segments = ppl_segments(dflash_gate.profile, dflash_gate.data_dir)
    baseline, candidate = dflash_gate.require("prompt_logprobs")
    base = score_segments(baseline, segments)
    cand = score_segments(candidate, segments)
    dflash_gate.record_engines(baseline, candidate)
    worst, delta = worst_delta(base["perplexities"], cand["perplexities"])
    worst_b, delta_b = worst_delta(base["byte_perplexities"], cand["byte_perplexities"])
    dflash_gate.record(
        figure=f"per token: max per-segment PPL delta {delta:.4f} (tolerance "
               f"{policy.ppl_tolerance}), PPL {base['perplexity']:.4f} -> "
               f"{cand['perplexity']:.4f}; per byte: max per-segment delta {delta_b:.4f} "
               f"(tolerance {policy.ppl_byte_tolerance}), {base['bits_per_byte']:.3f} -> "
               f"{cand['bits_per_byte']:.3f} bits/byte",
        max_ppl_delta=delta, ppl_tolerance=policy.ppl_tolerance,
        max_byte_ppl_delta=delta_b, ppl_byte_tolerance=policy.ppl_byte_tolerance,
        margin=max(delta / policy.ppl_tolerance if policy.ppl_tolerance else float("inf"),
                   delta_b / policy.ppl_byte_tolerance if policy.ppl_byte_tolerance
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
    if delta > policy.ppl_tolerance:
        failures.append(
            f"segment {segments[worst]['id']} perplexity per token "
            f"{base['perplexities'][worst]:.5f} (baseline {route.baseline}) -> "
            f"{cand['perplexities'][worst]:.5f}: |delta| {delta:.5f} > tolerance "
            f"{policy.ppl_tolerance}")
    if delta_b > policy.ppl_byte_tolerance:
        failures.append(
            f"segment {segments[worst_b]['id']} perplexity per byte "
            f"{base['byte_perplexities'][worst_b]:.5f} -> "
            f"{cand['byte_perplexities'][worst_b]:.5f}: |delta| {delta_b:.5f} > tolerance "
            f"{policy.ppl_byte_tolerance}")
    assert not failures, f"{route.name}: " + "; ".join(failures)
