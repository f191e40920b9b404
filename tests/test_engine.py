"""The reference engine against the engine protocol and against the training-form model."""

from __future__ import annotations

import pytest
import torch

from pytest_dflash import RouteRegistry
from pytest_dflash.engines import Engine, Sampling
from pytest_dflash.engines import model as M
from pytest_dflash.engines.reference import EngineError, build, default_model_dir
from pytest_dflash.engines.tokenizer import BOS, EOS, encode

PROMPT = "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n\n\ndef scale(xs, k):\n"
FP32_Q6592 = {"prefill.geometry": "prefill.geometry.fp32_q6592"}


@pytest.fixture(scope="module")
def engine():
    return build({}, "quick")


@pytest.fixture(scope="module")
def dense_model():
    cfg, tensors = M.load_checkpoint(default_model_dir())
    return M.load_into(M.HybridLM(cfg), tensors).eval()


def long_ids(n: int) -> list[int]:
    text = (PROMPT * 40)[: n - 1]
    return [BOS, *encode(text)]


def test_protocol_and_baseline_selection(engine):
    assert isinstance(engine, Engine)
    assert engine.selection == {"attn.d256": "attn.d256.sdpa",
                                "gemm.nvfp4": "gemm.nvfp4.turbomind",
                                "prefill.geometry": "prefill.geometry.fp32_q3296"}
    assert engine.chunk == 3296 // 16


@pytest.mark.parametrize("selection, words", [
    ({"gemm.nvfp4": "gemm.nvfp4.nope"}, "unknown route"),
    ({"gemm.nvfp4": "attn.d256.sdpa"}, "of family 'attn.d256'"),
])
def test_bad_selection_is_refused_clearly(selection, words):
    with pytest.raises(ValueError, match=words):
        build(selection, "quick")


def test_score_matches_training_model_across_chunks(engine, dense_model):
    ids = long_ids(260)  # quick chunk 206: two chunks, dense then paged attention
    hits_before = dict(engine.route_hits())
    got = torch.tensor(engine.score(ids))
    hits = engine.route_hits()
    with torch.no_grad():
        logp = torch.log_softmax(dense_model(torch.tensor([ids]))[0, :-1].float(), -1)
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got.shape == want.shape == (len(ids) - 1,)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    delta = {k: hits.get(k, 0) - hits_before.get(k, 0) for k in hits}
    assert delta["prefill.geometry.fp32_q3296"] == 2
    assert delta["attn.d256.sdpa:dense"] == 2 and delta["attn.d256.sdpa:paged"] == 2
    assert delta["gemm.nvfp4.turbomind/dequant"] == 2 * 2 * 8  # kernel's own hit records


def test_geometry_routes_are_checked_against_the_family_contract():
    """Any object with a torch.dtype ``state_dtype`` and ``chunk(profile)`` is a geometry (an
    outside project's, or the shipped class from a re-imported module); anything else is
    refused by name."""
    from pytest_dflash import Route
    from pytest_dflash.routes.shipped import SHIPPED_ROUTES

    class OwnGeometry:  # not pytest_dflash.engines.geometry.Geometry
        name, state_dtype = "prefill.geometry.own", torch.float32

        def chunk(self, profile: str) -> int:
            return 100

    class NoChunk:
        name, state_dtype = "prefill.geometry.nochunk", torch.float32

    registry = RouteRegistry()
    for route in SHIPPED_ROUTES:
        registry.register(route)
    for name, impl in (("prefill.geometry.own", OwnGeometry()),
                       ("prefill.geometry.nochunk", NoChunk())):
        registry.register(Route(name, "prefill.geometry", "candidate",
                                baseline="prefill.geometry.fp32_q3296", gates=("ppl",), impl=impl))
    own = build({"prefill.geometry": "prefill.geometry.own"}, "quick", registry=registry)
    assert own.chunk == 100 and own.prefill(long_ids(250)).chunks == 3
    with pytest.raises(EngineError, match=r"prefill\.geometry\.nochunk does not offer the "
                                          r"prefill\.geometry contract"):
        build({"prefill.geometry": "prefill.geometry.nochunk"}, "quick", registry=registry)


def test_geometries_agree_and_fp16_state_is_a_different_route():
    ids = long_ids(450)
    base = build({}, "quick")
    wide = build(FP32_Q6592, "quick")
    half = build({"prefill.geometry": "prefill.geometry.fp16_q7920"}, "quick")
    rb, rw, rh = (e.prefill(ids) for e in (base, wide, half))
    assert (rb.chunks, rw.chunks, rh.chunks) == (3, 2, 1)
    assert rb.first_token == rw.first_token == rh.first_token
    sb, sh = torch.tensor(base.score(ids[:120])), torch.tensor(half.score(ids[:120]))
    assert 0 < (sb - sh).abs().max() < 1e-2


def test_prefix_cache_reuse_and_reset(engine):
    engine.reset_prefix_cache()
    ids = long_ids(300)
    cold = engine.prefill(ids)
    assert cold.chunks == 2 and cold.prompt_tokens == 300
    warm = engine.prefill(ids)
    assert warm.chunks == 0 and warm.first_token_hash == cold.first_token_hash
    longer = engine.prefill(ids + encode("    return"))
    assert longer.chunks == 1  # only the new tokens ran (paged over the cached prefix)
    engine.reset_prefix_cache()
    again = engine.prefill(ids + encode("    return"))
    assert again.chunks == 2 and again.first_token == longer.first_token
    assert engine.prefill(ids).first_token_hash == cold.first_token_hash


def test_generate_greedy_stop_length_and_seeded_sampling(engine):
    prompt = 'def lift_points(q):\n    """Return a new list with 7 added to each element of q."""\n'
    greedy = engine.generate(prompt, 64, ["\ndef "])
    assert greedy.finish_reason == "stop"
    assert greedy.text == "    return [x + 7 for x in q]\n"
    assert greedy.token_ids[-1] != EOS and len(greedy.token_ids) == len(greedy.text)
    cut = engine.generate(prompt, 64, ["x +"])
    assert cut.finish_reason == "stop" and cut.text == "    return ["  # cut before the stop
    short = engine.generate(prompt, 3)
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    free = "# "  # an open-ended prompt: sampling has real choices here
    hot = Sampling(temperature=1.5, top_p=0.95, seed=7)
    a, b = engine.generate(free, 16, sampling=hot), engine.generate(free, 16, sampling=hot)
    assert a.token_ids == b.token_ids
    seeds = {tuple(engine.generate(free, 16, sampling=Sampling(1.5, seed=s)).token_ids)
             for s in range(3)}
    assert len(seeds) > 1


def test_generate_many_gives_the_lone_completions_in_prompt_order(engine):
    from dflash_fixtures.tasks import STOP
    from pytest_dflash.engines.data import coding_tasks

    prompts = [t["prompt"] for t in coding_tasks("ci")[:5]]
    before = engine.route_hits().get("gemm.nvfp4.turbomind", 0)
    lone = [engine.generate(p, 40, STOP) for p in prompts]
    lone_gemm = engine.route_hits()["gemm.nvfp4.turbomind"] - before
    finished: list[int] = []
    many = engine.generate_many(prompts, 40, STOP, batch=3,
                                on_complete=lambda i, g: finished.append(i))
    many_gemm = engine.route_hits()["gemm.nvfp4.turbomind"] - before - lone_gemm
    assert [(g.text, g.token_ids, g.finish_reason) for g in many] == \
        [(g.text, g.token_ids, g.finish_reason) for g in lone]
    assert sorted(finished) == list(range(len(prompts)))
    # decode steps really were shared: the GEMM ran far fewer calls than one sequence at a time
    assert many_gemm < 0.6 * lone_gemm, (many_gemm, lone_gemm)
    hot = Sampling(temperature=1.5, top_p=0.95, seed=7)
    assert [g.token_ids for g in engine.generate_many(["# ", "def f("], 12, sampling=hot,
                                                      batch=2)] == \
        [engine.generate(p, 12, sampling=hot).token_ids for p in ("# ", "def f(")]
    with pytest.raises(EngineError, match="batch >= 1"):
        engine.generate_many(prompts, 4, batch=0)


def test_generate_all_completes_one_at_a_time_without_generate_many(engine):
    from pytest_dflash.engines import generate_all

    class GenerateOnly:  # an engine of the original protocol: generate, no generate_many
        def generate(self, *args):
            return engine.generate(*args)

    finished: list[int] = []
    gens, how = generate_all(GenerateOnly(), ["def f(", "# "], 8, None, Sampling(), 16,
                             on_complete=lambda i, g: finished.append(i))
    assert how == "generate, one completion at a time" and finished == [0, 1]
    assert [g.token_ids for g in gens] == [engine.generate(p, 8).token_ids
                                           for p in ("def f(", "# ")]
    gens, how = generate_all(engine, ["def f(", "# "], 8, None, Sampling(), 16)
    assert how.startswith("generate_many, up to 16") and len(gens) == 2


def test_verify_rows_match_scoring_and_leave_the_state_alone(engine):
    engine.reset_prefix_cache()
    ids = long_ids(120)
    engine.prefill(ids)
    draft = encode("    retu")
    logits = engine.verify(draft)
    assert tuple(logits.shape) == (8, M.ModelConfig().vocab_size)
    assert torch.equal(engine.verify(draft), logits)  # no state was committed
    scored = torch.tensor(engine.score(ids + draft))[-len(draft) + 1:]
    from_verify = torch.log_softmax(logits[:-1], -1).gather(
        1, torch.tensor(draft[1:])[:, None])[:, 0]
    torch.testing.assert_close(from_verify, scored, atol=2e-3, rtol=1e-3)
    for m in range(1, 9):
        assert engine.verify(draft[:m]).shape[0] == m
    with pytest.raises(EngineError, match="at most 8"):
        engine.verify(draft + [32])


def test_verify_runs_the_selected_gemm_route_at_small_m():
    eng = build({"gemm.nvfp4": "gemm.nvfp4.qpn2_packed"}, "quick")
    eng.prefill(long_ids(64))
    before = dict(eng.route_hits())
    eng.verify(encode("abc"))
    after = eng.route_hits()
    assert after["gemm.nvfp4.qpn2_packed:m<=8"] - before.get("gemm.nvfp4.qpn2_packed:m<=8", 0) \
        == 16
    kernel = {k for k in after if "/" in k and after[k] != before.get(k, 0)}
    assert any(k.startswith("gemm.nvfp4.") for k in kernel), kernel
    assert not any("turbomind" in k for k in after)


def test_bad_inputs_are_refused_clearly(engine):
    fresh = build({}, "quick")
    with pytest.raises(EngineError, match="call prefill"):
        fresh.verify([65])
    with pytest.raises(EngineError, match="empty"):
        engine.prefill([])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.score([BOS, 999])
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.generate("x", 0)
    with pytest.raises(ValueError, match="unknown profile"):
        build({}, "huge")


def test_a_cold_prefill_call_computes_the_prefill_and_books_its_hits_per_run():
    """The call a CUDA graph captures for the prefill gate (``cold_prefill_call``) is the eager
    prefill without the host: the same chunks, the same last-position logits (so the same
    first-token hash), nothing left in the prefix cache, and ``book`` counts exactly one more
    run of the same route hits, as a replay runs the same kernels."""
    from pytest_dflash.native import hits

    eng = build({"gemm.nvfp4": "gemm.nvfp4.qpn2_packed"}, "quick")
    ids = encode("def add(a, b):\n    return a + b\n" * 12, bos=True)
    eager = eng.prefill(ids)
    eng.reset_prefix_cache()
    call = eng.cold_prefill_call(ids)
    before = eng.route_hits()
    with hits.counting() as ran:
        out = call()
    one_run = {k: n - before.get(k, 0) for k, n in eng.route_hits().items()
               if n != before.get(k, 0)}
    result = call.result(out)
    assert (result.first_token_hash, result.first_token, result.chunks) == (
        eager.first_token_hash, eager.first_token, eager.chunks)
    assert result.chunks > 1  # the prompt crosses chunk seams
    assert one_run["gemm.nvfp4.qpn2_packed"] > 0 and one_run["prefill.geometry.fp32_q3296"] \
        == result.chunks
    assert eng._prefix == {} and eng._current is None  # a timed cold prefill caches nothing
    before = eng.route_hits()
    with hits.counting() as booked:
        call.book()
    assert {k: n - before.get(k, 0) for k, n in eng.route_hits().items()
            if n != before.get(k, 0)} == one_run
    assert booked.counts == ran.counts and ran.route("gemm.nvfp4.qpn2_packed") > 0
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.cold_prefill_call([10**6])
