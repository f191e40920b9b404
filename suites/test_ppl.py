"""Perplexity gate of family prefill.geometry (docs/gates.md, "ppl").

A route that changes numerics (the fp16 SSM state) must not change what the model predicts: the
candidate's and the baseline's engines score the same held-out segments (standard-library modules
never trained on), each with a BOS prefix, and the largest per-segment perplexity difference must
stay within ``policy.ppl_tolerance``. Corpus perplexity and bits per byte of both are reported.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sm70


def score_segments(engine, segments: list[dict]) -> dict:
    """Per-token log-probs of each BOS-prefixed segment, through the perplexity metric."""
    from pytest_dflash.engines.tokenizer import BOS
    from pytest_dflash.metrics import load_metric

    logprobs, num_bytes = [], []
    for row in segments:
        ids = [BOS, *engine.encode(row["text"])]
        logprobs.append(engine.score(ids))
        num_bytes.append(len(row["text"].encode("utf-8")))
    return load_metric("perplexity").compute(logprobs=logprobs, num_bytes=num_bytes)


@pytest.mark.gate("ppl", family="prefill.geometry")
def test_ppl_heldout_segments(dflash_gate):
    """max per-segment |PPL(candidate) - PPL(baseline)| <= policy.ppl_tolerance."""
    from pytest_dflash.engines.data import ppl_segments

    route, policy = dflash_gate.route, dflash_gate.policy
    segments = ppl_segments(dflash_gate.profile)
    baseline, candidate = dflash_gate.engines()
    base = score_segments(baseline, segments)
    cand = score_segments(candidate, segments)
    deltas = [abs(c - b) for c, b in zip(cand["perplexities"], base["perplexities"], strict=True)]
    worst = max(range(len(deltas)), key=deltas.__getitem__)
    dflash_gate.record(
        figure=f"max per-segment PPL delta {deltas[worst]:.4f} "
               f"(tolerance {policy.ppl_tolerance}); PPL {base['perplexity']:.4f} -> "
               f"{cand['perplexity']:.4f}, {cand['bits_per_byte']:.3f} bits/byte",
        max_ppl_delta=deltas[worst],
        worst_segment=segments[worst]["id"],
        ppl_baseline=base["perplexity"], ppl_candidate=cand["perplexity"],
        bits_per_byte_baseline=base["bits_per_byte"],
        bits_per_byte_candidate=cand["bits_per_byte"],
        per_segment_baseline=base["perplexities"], per_segment_candidate=cand["perplexities"],
        segments=len(segments), tokens=cand["tokens"],
    )
    assert deltas[worst] <= policy.ppl_tolerance, (
        f"{route.name}: segment {segments[worst]['id']} perplexity "
        f"{base['perplexities'][worst]:.5f} (baseline {route.baseline}) -> "
        f"{cand['perplexities'][worst]:.5f}: |delta| {deltas[worst]:.5f} > tolerance "
        f"{policy.ppl_tolerance}"
    )
