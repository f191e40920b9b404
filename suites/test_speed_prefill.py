"""Cold prefill gate (kind ``prefill``) of every family the engine applies (docs/gates.md,
"prefill"): model-level prompt throughput, as the seed measured the D256 ops, the QPN2-packed
large-M path and the prefill geometries (same-card cold 32K / 64K prefill pairs). The op-level
``speed`` gates time one op of a family; this gate times the whole model's prefill.

For each of the profile's prompt lengths (``ProfileSizes.prefill_lengths``, 32K:64K ratio), the
candidate's engine (the candidate switched in, every other family at its baseline) and the
baseline's prefill the same prompt, interleaved in a balanced order, the prefix cache reset
before every run (cold), in the run's timing worker processes (each rebuilds the session's
in-process engine; a server engine is timed in this process). The routes of one prompt that
are judged against the same baseline engine time their first look together
(``shared_look``): the baseline runs once a round for all of them. Every run of a route, in every
process, must yield the same first-token hash and the expected chunk count, the candidate's
greedy first token must equal the baseline's, and the candidate's route hits must prove that it
served the calls. Tokens/s of both go in the report.

A fast route is only worth timing if it computes what the baseline computes after the same
prompt, so before timing, each prompt's cold prefill pair is checked across routes: the greedy
next token must be the baseline's, and KL(candidate || baseline) of the next-token distributions
at the ``policy.agreement_rows`` positions after every chunk seam (both routes' seams) and on as
many verify rows decoded on top of the prefill (which read the paged KV of every chunk) must
stay under ``policy.agreement_kl_bound`` (docs/gates.md).
"""

from __future__ import annotations

import pytest

from dflash_suites.support.engine import (
    ENGINE_FAMILIES,
    ColdPrefillPair,
    check_prefill_runs,
    merged_prefill_facts,
)

pytestmark = pytest.mark.sm70


def kl_rows(cand, base):
    """KL(cand || base) per row of two fp64 log-prob matrices [rows, vocab]."""
    return (cand.exp() * (cand - base)).sum(-1)


def check_agreement(dflash_gate, baseline, candidate, text: list[int],
                    length: int) -> tuple[dict, list[str]]:
    """One cold prefill of the prompt (the first ``length`` of ``text``) per route
    (``prefill_logits``), then one verify step of the ``policy.agreement_rows`` held-out tokens
    that follow it in ``text``; the measurements for the report and the failures: a different
    greedy next token, or KL(candidate || baseline) over the bound at a position after a seam,
    the last position or a verify row."""
    import time

    import torch

    from pytest_dflash.metrics.seam_bands import agreement_positions, declared_chunk, seams

    start_s = time.perf_counter()
    policy, rows = dflash_gate.policy, dflash_gate.policy.agreement_rows
    ids, cont = text[:length], text[length:length + rows]
    chunks = {  # a chunk nobody declares (a server route) has no seams to look behind
        name: declared_chunk(engine, route, dflash_gate.profile) or length
        for name, engine, route in (("candidate", candidate, dflash_gate.route),
                                    ("baseline", baseline, dflash_gate.baseline_route))
    }
    positions = agreement_positions(length, chunks.values(), rows)
    compute = getattr(candidate, "dtype", None) or dflash_gate.dtype
    bound = policy.agreement_kl_bound
    side = {}
    for name, engine in (("baseline", baseline), ("candidate", candidate)):
        at = engine.prefill_logits(ids, positions)
        verify = torch.log_softmax(engine.verify(cont).double().cpu(), dim=-1)
        side[name] = (at, verify)
        engine.reset_prefix_cache()
    kl_at = kl_rows(side["candidate"][0], side["baseline"][0])
    kl_verify = kl_rows(side["candidate"][1], side["baseline"][1])
    greedy = [int(side[name][0][-1].argmax()) for name in ("candidate", "baseline")]
    verify_equal = int((side["candidate"][1].argmax(-1) == side["baseline"][1].argmax(-1)).sum())
    per_seam = {}
    for start in sorted(set(seams(length, chunks["candidate"])
                            + seams(length, chunks["baseline"]))):
        index = [i for i, p in enumerate(positions) if start <= p < start + rows]
        per_seam[str(start)] = float(kl_at[index].max())
    worst = max(float(kl_at.max()), float(kl_verify.max()))
    where = (f"position {positions[int(kl_at.argmax())]}"
             if float(kl_at.max()) >= float(kl_verify.max())
             else f"verify row {int(kl_verify.argmax())}")
    dtype = str(compute).removeprefix("torch.")
    figure = (f"agreement: greedy {'equal' if greedy[0] == greedy[1] else 'DIFFERS'}, max KL "
              f"{worst:.1e} (bound {bound:g}, {dtype})")
    record = {"figure": figure, "greedy_next_token_candidate": greedy[0],
              "greedy_next_token_baseline": greedy[1], "max_kl": worst, "kl_bound": bound,
              "compute_dtype": dtype, "worst_at": where,
              "max_kl_after_seams": float(kl_at.max()),
              "max_kl_verify_rows": float(kl_verify.max()), "max_kl_per_seam": per_seam,
              "kl_last_position": float(kl_at[-1]), "verify_rows_argmax_equal": verify_equal,
              "verify_rows": rows, "positions": positions, "chunk_tokens": chunks,
              "seconds": round(time.perf_counter() - start_s, 3)}
    failures = []
    if greedy[0] != greedy[1]:
        failures.append(f"greedy next token {greedy[0]}, the baseline's {greedy[1]}")
    if worst > bound:
        failures.append(f"KL(candidate || baseline) {worst:.3e} at {where} > bound {bound:g} "
                        f"({dtype} compute; max per seam: {per_seam}; verify rows: "
                        f"{float(kl_verify.max()):.3e})")
    return record, failures


def shared_look(dflash_gate, baseline, ids: list[int]):
    """This gate's share of the first look timed with the other routes whose cold prefill of
    the same prompt is judged against the same baseline engine (docs/gates.md, "Shared
    looks"): their samples if one of them timed it, else a look of this route and those still
    to run. Those routes' agreement is checked by their own tests, before their timing counts;
    a route whose engine cannot be built here or rebuilt in a timing worker is left to its own
    test. CPU only: on CUDA every worker of a shared look would hold each route's captured
    prefill graph at once, several times a pair's device memory at the full profile's lengths,
    so there each route times its own look."""
    import hashlib
    import json

    from pytest_dflash.measure.timing import SharedLook

    if dflash_gate.device.type != "cpu":
        return None

    builder = "dflash_suites.support.engine:cold_prefill_arms"
    peers = []
    for peer in dflash_gate.peers(size=len(ids)):
        try:  # built once per session: the peer's own test gets the same engine
            engine = dflash_gate.engine(peer.name)
        except (Exception, pytest.skip.Exception):  # its own test says why
            continue
        if dflash_gate.engine_job(builder, (engine,)) is not None:  # a worker can rebuild it
            peers.append(peer.name)
    route = dflash_gate.route
    prompt = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]
    engine = dflash_gate.registry.engine_selection((dflash_gate.baseline_route.name,))
    group = (f"cold prefill of {len(ids)} tokens (prompt {prompt}) against "
             f"{json.dumps(engine, sort_keys=True)}")
    job = dflash_gate.engine_job(builder, (baseline,), routes=[route.name, *peers],
                                 baseline=route.baseline, ids=ids) if peers else None
    return SharedLook(group, route.name, dflash_gate.timing.looks, job)


@pytest.mark.gate("prefill", family=ENGINE_FAMILIES, per_size="prefill_lengths")
def test_speed_cold_prefill(dflash_gate, size):
    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.measure.timing import TimingInconclusive, speed_gate

    route, length = dflash_gate.route, size
    baseline, candidate = dflash_gate.require("prefill_timing", "first_token_hash", "route_hits",
                                              "position_logits", "verify_logits")
    # agreement first: a route that computes something else is not worth timing; the timed
    # prompt is the very one it checked (the workers get its ids, they never read the data)
    text = prompt_ids(length + dflash_gate.policy.agreement_rows, baseline.encode)
    agreement, disagreements = check_agreement(dflash_gate, baseline, candidate, text, length)
    dflash_gate.record_engines(baseline, candidate)
    dflash_gate.record(prompt_tokens=length, agreement=agreement,
                       figure=f"@{length} {agreement['figure']}")
    assert not disagreements, (
        f"{route.name} @{length}: after the same cold prefill as {route.baseline}: "
        + "; ".join(disagreements))
    ids = text[:length]
    local = ColdPrefillPair(baseline, candidate, route.name, ids)
    job = dflash_gate.engine_job("dflash_suites.support.engine:cold_prefill_pair",
                                 (baseline, candidate), route=route.name,
                                 baseline=route.baseline, ids=ids)
    measured: dict = {}
    try:
        speed_gate(local.candidate, local.baseline, policy=dflash_gate.policy,
                   device=dflash_gate.device, record=measured.update,
                   label=f"{route.name} cold prefill {length} tokens",
                   before_each=local.before_each, job=job, timing=dflash_gate.timing,
                   shared=shared_look(dflash_gate, baseline, ids) if job else None)
        failure = None
    except (AssertionError, TimingInconclusive) as exc:  # judged after the evidence below
        failure = exc
    # every timed run's facts: from each worker process, or from this process
    facts = ([p["info"]["facts"] for p in measured["processes"]] if "processes" in measured
             else [local.facts()])
    samples = measured.get("samples") or {
        "candidate": [s for p in measured.get("processes", []) for s in p["samples"]["candidate"]],
        "baseline": [s for p in measured.get("processes", []) for s in p["samples"]["baseline"]]}
    rates = {name: length / sorted(s)[len(s) // 2] for name, s in samples.items() if s}
    ran = sum(f["candidate_route_hits"] for f in facts)
    cand, base = merged_prefill_facts(facts, "candidate"), merged_prefill_facts(facts, "baseline")
    if measured.get("figure"):
        measured["figure"] += f"; {agreement['figure']}"
    dflash_gate.record(**measured,
                       tokens_per_s_candidate=rates.get("candidate"),
                       tokens_per_s_baseline=rates.get("baseline"),
                       candidate_chunk_dispatches=ran,
                       chunk_tokens={"candidate": getattr(candidate, "chunk", None),
                                     "baseline": getattr(baseline, "chunk", None)})
    # the evidence must be real before the timing verdict counts
    cand_hash, cand_token = check_prefill_runs(cand, f"{route.name} @{length}")
    base_hash, base_token = check_prefill_runs(base, f"{route.baseline} @{length}")
    assert ran >= cand["runs"] > 0, (
        f"{route.name} recorded {ran} route hits over {cand['runs']} prefills: the candidate "
        f"did not serve them (hits {candidate.route_hits()})")
    dflash_gate.record(first_token_hash_candidate=cand_hash, first_token_hash_baseline=base_hash,
                       first_token_candidate=cand_token, first_token_baseline=base_token)
    assert cand_token == base_token, (
        f"{route.name} @{length}: greedy first token {cand_token} over the timed cold "
        f"prefills, the baseline {route.baseline} gives {base_token}: the routes do not agree")
    if failure is not None:
        raise failure
