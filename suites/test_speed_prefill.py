"""Cold prefill speed gate of family prefill.geometry (docs/gates.md, "speed").

For each of the profile's prompt lengths (``ProfileSizes.prefill_lengths``, 32K:64K ratio), the
candidate geometry's engine and the baseline's prefill the same prompt interleaved in randomized
order, the prefix cache reset before every run (cold), every run of a route yielding the same
first-token hash, and the candidate's route hits proving its chunking really ran. Tokens/s of both
go in the report.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sm70


class PrefillRuns:
    """Cold prefills of one engine, checking every run repeats the first run's token hash."""

    def __init__(self, engine, ids: list[int], label: str) -> None:
        self.engine, self.ids, self.label = engine, ids, label
        self.hashes: set[str] = set()
        self.chunks: set[int] = set()
        self.runs = 0

    def reset(self) -> None:
        self.engine.reset_prefix_cache()

    def __call__(self) -> None:
        result = self.engine.prefill(self.ids)
        self.hashes.add(result.first_token_hash)
        self.chunks.add(result.chunks)
        self.runs += 1

    def check(self) -> str:
        if len(self.hashes) != 1:
            raise AssertionError(f"{self.label}: {len(self.hashes)} different first-token hashes "
                                 f"over {self.runs} cold prefills of one prompt: not deterministic")
        if self.chunks != {self.expected_chunks()}:
            raise AssertionError(f"{self.label}: prefill ran in {sorted(self.chunks)} chunks, "
                                 f"expected {self.expected_chunks()}: a warm prefix was reused")
        return next(iter(self.hashes))

    def expected_chunks(self) -> int:
        chunk = getattr(self.engine, "chunk", None)
        return -(-len(self.ids) // chunk) if chunk else next(iter(self.chunks))


@pytest.mark.gate("speed", family="prefill.geometry", per_size="prefill_lengths")
def test_speed_cold_prefill(dflash_gate, size):
    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.measure.timing import speed_gate

    route, length = dflash_gate.route, size
    baseline, candidate = dflash_gate.require("prefill_timing", "first_token_hash", "route_hits")
    ids = prompt_ids(length, baseline.encode)
    cand = PrefillRuns(candidate, ids, f"{route.name} @{length}")
    base = PrefillRuns(baseline, ids, f"{route.baseline} @{length}")
    hits_before = candidate.route_hits().get(route.name, 0)
    measured: dict = {}

    def before_each() -> None:
        cand.reset()
        base.reset()

    try:
        speed_gate(cand, base, policy=dflash_gate.policy,
                   device=dflash_gate.device, record=measured.update,
                   label=f"{route.name} cold prefill {length} tokens",
                   before_each=before_each)
        failure = None
    except AssertionError as exc:
        failure = exc
    samples = measured.get("samples", {})
    rates = {name: length / sorted(s)[len(s) // 2] for name, s in samples.items() if s}
    ran = candidate.route_hits().get(route.name, 0) - hits_before
    dflash_gate.record(**measured, prompt_tokens=length,
                       tokens_per_s_candidate=rates.get("candidate"),
                       tokens_per_s_baseline=rates.get("baseline"),
                       candidate_chunk_dispatches=ran,
                       chunk_tokens={"candidate": getattr(candidate, "chunk", None),
                                     "baseline": getattr(baseline, "chunk", None)})
    # the evidence must be real before the timing verdict counts
    cand_hash, base_hash = cand.check(), base.check()
    assert ran >= cand.runs > 0, (
        f"{route.name} recorded {ran} route hits over {cand.runs} prefills: the candidate "
        f"geometry did not run (hits {candidate.route_hits()})")
    dflash_gate.record(first_token_hash_candidate=cand_hash, first_token_hash_baseline=base_hash)
    if failure is not None:
        raise failure
