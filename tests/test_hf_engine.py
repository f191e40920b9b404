"""The transformers engine against the real library and the real tiny Llama model the package
ships (``dflash_fixtures/hf_model``): tokenizer BOS, chunked scoring over the cache, verify on the
cached prefix, stop strings, route proofs, unsupported routes, and the gates run through
``--dflash-engine hf`` in pytester sessions."""

from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")
# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")

import torch  # noqa: E402

from pytest_dflash.engines import EngineUnsupported  # noqa: E402
from pytest_dflash.engines import transformers as hf  # noqa: E402

MODEL = hf.llama_model_dir()
BASE = {"prefill.geometry": hf.BASELINE}
TEXT = "def lift(pts):\n    return [p + 1 for p in pts]\n" * 12


def engine(route: str = hf.BASELINE, profile: str = "quick") -> hf.TransformersEngine:
    return hf.build(MODEL, {"prefill.geometry": route}, profile)


@pytest.fixture(scope="module")
def base() -> hf.TransformersEngine:
    return engine()


def full_logits(eng: hf.TransformersEngine, ids: list[int]) -> torch.Tensor:
    """One forward of the whole sequence without any cache: the library's own answer."""
    with torch.inference_mode():
        return eng.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def test_encode_puts_the_tokenizers_bos_in_front(base: hf.TransformersEngine) -> None:
    plain = base.encode(TEXT)
    with_bos = base.encode(TEXT, add_special_tokens=True)
    assert with_bos == [base.tokenizer.bos_token_id, *plain]
    assert base.tokenizer.decode(plain) == TEXT  # byte-level BPE: decoding is exact
    assert len(plain) < len(TEXT.encode()) / 2  # real merges, not bytes


def test_chunked_score_matches_one_full_forward() -> None:
    small = engine(hf.Q824.name)  # quick profile: chunks of 51 tokens
    ids = small.encode(TEXT, add_special_tokens=True)
    assert len(ids) > 2 * small.chunk
    scores = small.score(ids)
    logp = torch.log_softmax(full_logits(small, ids)[:-1], dim=-1)
    expected = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(scores) == len(ids) - 1
    assert torch.allclose(torch.tensor(scores), expected, atol=1e-4)
    assert small.route_hits()[f"{hf.Q824.name}:chunk"] == math.ceil(len(ids) / small.chunk)


def test_prefill_and_verify_run_on_the_cached_prefix() -> None:
    small = engine(hf.Q824.name)
    ids = small.encode(TEXT, add_special_tokens=True)
    prompt, draft = ids[:-6], ids[-6:]
    first = small.prefill(prompt)
    assert first.chunks == math.ceil(len(prompt) / small.chunk)
    assert first.prompt_tokens == len(prompt) and first.seconds > 0
    rows = small.verify(draft)
    again = small.verify(draft)  # the prefix is left as it was
    expected = full_logits(small, ids)[-len(draft) :]  # the rows after each draft token
    assert rows.shape == (len(draft), small.vocab)
    assert torch.equal(rows, again)
    assert torch.allclose(rows, expected, atol=1e-4)
    small.reset_prefix_cache()
    assert small.prefill(prompt).first_token_hash == first.first_token_hash
    with pytest.raises(hf.EngineError, match="at most 8"):
        small.verify(ids[:9])


def test_prefill_logits_across_seams_match_one_full_forward() -> None:
    """The agreement check's rows: log-probs at positions after every chunk seam of one cold
    chunked prefill equal the library's full forward, and verify then continues that prefix."""
    small = engine(hf.Q824.name)
    ids = small.encode(TEXT, add_special_tokens=True)
    prompt, draft = ids[:-4], ids[-4:]
    seams = list(range(small.chunk, len(prompt), small.chunk))
    assert len(seams) >= 3
    where = [s + 1 for s in seams] + [len(prompt) - 1]
    rows = small.prefill_logits(prompt, where)
    expected = torch.log_softmax(full_logits(small, prompt).double(), dim=-1)[where]
    assert rows.shape == (len(where), small.vocab) and rows.dtype == torch.float64
    assert torch.allclose(rows, expected, atol=1e-4)
    after = small.verify(draft)
    assert torch.allclose(after, full_logits(small, ids)[-len(draft):], atol=1e-4)
    with pytest.raises(hf.EngineError, match="outside the prompt"):
        small.prefill_logits(prompt, [len(prompt)])


def test_quantized_cache_verify_keeps_its_prefix() -> None:
    pytest.importorskip("optimum.quanto")
    quant = engine(hf.KV_QUANTO_INT2.name)
    ids = quant.encode(TEXT, add_special_tokens=True)
    quant.prefill(ids[:-4])
    first, second = quant.verify(ids[-4:]), quant.verify(ids[-4:])
    assert torch.equal(first, second) and torch.isfinite(first).all()
    assert quant.route_hits()[f"{hf.KV_QUANTO_INT2.name}:cache:QuantizedCache"] > 0


def test_generate_stops_at_a_stop_string_of_the_completion(base: hf.TransformersEngine) -> None:
    prompt = "class Point:\n    def __init__(self"
    free = base.generate(prompt, 24)
    assert free.finish_reason in ("stop", "length") and free.token_ids
    # a stop string the unconstrained completion contains: the text is cut right before it
    cut = free.text[1:3] if len(free.text) >= 3 else None
    if cut is None:
        pytest.fail(f"the model completed only {free.text!r}: too short to test stop strings")
    stopped = base.generate(prompt, 24, stop=[cut])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(cut)]
    # a stop string that only spans the prompt's end never stops the completion
    assert base.generate(prompt, 4, stop=["(self"]).token_ids == free.token_ids[:4]


def test_route_hits_prove_what_the_model_ran() -> None:
    eager, bf16 = engine(hf.EAGER.name), engine(hf.BF16.name)
    ids = eager.encode(TEXT, add_special_tokens=True)
    eager.score(ids)
    bf16.score(ids)
    assert eager.model.config._attn_implementation == "eager"
    assert eager.route_hits()[f"{hf.EAGER.name}:attn:eager"] > 0
    assert bf16.route_hits()[f"{hf.BF16.name}:dtype:bfloat16"] > 0


def test_the_sessions_dtype_runs_both_sides_unless_the_route_sets_its_own() -> None:
    """--dflash-dtype: the baseline computes in it (a GPU stack's bf16), a geometry route that
    sets a dtype keeps its own, and a dtype the engine has no name for names the option."""
    base16 = hf.build(MODEL, BASE, "quick", dtype="bfloat16")
    base16.score(base16.encode(TEXT, add_special_tokens=True))
    assert base16.model.dtype == torch.bfloat16
    assert base16.route_hits()[f"{hf.BASELINE}:dtype:bfloat16"] > 0
    assert "bfloat16" in repr(base16)
    assert hf.build(MODEL, {"prefill.geometry": hf.BF16.name}, "quick",
                    dtype="float16").model.dtype == torch.bfloat16
    with pytest.raises(hf.EngineError, match="--dflash-dtype"):
        hf.build(MODEL, BASE, "quick", dtype="float64")


def test_a_timing_worker_builds_its_engines_in_the_sessions_dtype() -> None:
    """The worker rebuilds the gate's engines from the spec: the same model, the same dtype."""
    from pytest_dflash.measure.timing_child import WorkerContext
    from pytest_dflash.measure.timing_pool import WorkerSpec
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.routes import library, shipped

    spec = WorkerSpec(device="cpu", threads=1, profile="quick", policy=Policy().as_dict(),
                      plugins=[shipped.__name__, library.__name__, hf.__name__],
                      hf_model=str(MODEL),
                      hf_dtype="float16")
    worker = WorkerContext(json.loads(json.dumps(spec.as_json())))
    assert worker.engine().model.dtype == torch.float16


def test_routes_the_engine_cannot_switch_are_unsupported() -> None:
    """The Llama fixture has no recurrent state and attention head dim 32."""
    with pytest.raises(EngineUnsupported, match="no recurrent"):
        engine("prefill.geometry.fp16_q7920")
    with pytest.raises(EngineUnsupported, match="head dim is 32"):
        hf.build(MODEL, {**BASE, "attn.d256": "attn.d256.fa2"}, "quick")


def test_bad_model_directory_names_the_fix(tmp_path) -> None:
    with pytest.raises(hf.EngineError, match="no config.json"):
        hf.check_model_dir(tmp_path)
    with pytest.raises(hf.EngineError, match="no such directory"):
        hf.check_model_dir(tmp_path / "missing")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--dflash-engine", "hf:no/such/model"], "*no/such/model: no such directory*"),
        (["--dflash-engine", "vllm"], "*unknown engine; give 'reference', 'hf'*"),
        (["--dflash-dtype", "bfloat16"], "*--dflash-dtype bfloat16 sets the transformers "
                                         "engine's compute dtype*add --dflash-engine hf*"),
        (
            ["--dflash-engine", "hf", "--dflash-engine-url", "baseline=http://h:1"],
            "*give one of them*",
        ),
    ],
)
def test_bad_engine_choice_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], words: str
) -> None:
    pytester.makepyfile(test_a="def test_a():\n    assert True\n")
    result = pytester.runpytest(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([words])


def small_data(pytester: pytest.Pytester) -> str:
    from pytest_dflash.engines.data import PPL_FILE, TASKS_FILE, data_dir

    data = pytester.mkdir("data")
    for name in (PPL_FILE, TASKS_FILE, "long_contexts.jsonl"):
        lines = (data_dir() / name).read_text().splitlines()[:2]
        (data / name).write_text("\n".join(lines) + "\n")
    return str(data)


def test_ppl_gate_through_the_transformers_engine(pytester: pytest.Pytester) -> None:
    """eager attention predicts what sdpa predicts (accepted by ppl); bfloat16 compute moves
    this model's per-token perplexity past the tolerance (rejected). The ini key selects the
    engine; the shipped fp16-state geometry cannot be applied and stays pending."""
    pytester.makeini(f"[pytest]\ndflash_engine = hf:{MODEL}\n")
    report = pytester.path / "r.json"
    # a subprocess: modules transformers imports lazily must not be dropped and imported again
    # in this process, as pytester's in-process runs do
    result = pytester.runpytest_subprocess(
        "--pyargs",
        "dflash_suites",
        "-m",
        "ppl",
        "--dflash-profile",
        "quick",
        "--dflash-route",
        hf.EAGER.name,
        "--dflash-route",
        hf.BF16.name,
        "--dflash-route",
        "prefill.geometry.fp16_q7920",
        "--dflash-data",
        small_data(pytester),
        "--dflash-report",
        str(report),
        "-p",
        "no:cacheprovider",
    )
    routes = json.loads(report.read_text())["routes"]
    eager = routes[hf.EAGER.name]["gates"]["ppl"]
    bf16 = routes[hf.BF16.name]["gates"]["ppl"]
    assert eager["status"] == "passed", eager["tests"][0]["message"]
    assert bf16["status"] == "failed", bf16["tests"][0]["message"]
    measured = bf16["tests"][0]["measurements"]
    assert measured["max_ppl_rel_delta"] > measured["ppl_rel_tolerance"]
    eager_figures = eager["tests"][0]["measurements"]
    assert eager_figures["max_ppl_rel_delta"] <= eager_figures["ppl_rel_tolerance"]
    state = routes["prefill.geometry.fp16_q7920"]["gates"]["ppl"]
    assert state["status"] == "pending" and "no recurrent" in state["tests"][0]["message"]
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_quality_gate_without_power_ends_inconclusive(pytester: pytest.Pytester) -> None:
    """The tiny model passes none of the held-out tasks with either route: no candidate could
    be shown worse, so the gate is inconclusive and the route pending, never accepted."""
    pytester.makeini(f"[pytest]\ndflash_engine = hf:{MODEL}\n")
    pytester.makepyprojecttoml("[tool.pytest-dflash]\nquality_max_new_tokens = 32\n")
    report = pytester.path / "q.json"
    pytester.runpytest_subprocess(
        "--pyargs", "dflash_suites", "-m", "quality", "--dflash-profile", "quick",
        "--dflash-route", hf.EAGER.name, "--dflash-data", small_data(pytester),
        "--dflash-allow-unjailed", "--dflash-report", str(report), "-p", "no:cacheprovider")
    entry = json.loads(report.read_text())["routes"][hf.EAGER.name]
    quality = entry["gates"]["quality"]
    test = quality["tests"][0]
    assert test["measurements"]["pass_at_1_baseline"] == 0.0
    assert test["outcome"] == "inconclusive", test
    assert test["measurements"]["decision"] == "inconclusive"
    assert "no power: the baseline passes 0 of 2 tasks" in test["message"]
    assert quality["status"] == "pending"
    assert entry["verdict"] == "pending"
    assert any(r.startswith("quality pending: inconclusive (") for r in entry["reasons"])
