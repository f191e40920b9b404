"""The server engine against a real llama.cpp server (llama-cpp-python's ``llama_cpp.server``).

A tiny Llama of random weights with a byte-level BPE trained here is converted to GGUF by
``dflash_fixtures.convert_gguf`` and served by a real ``llama_cpp.server`` process on a loopback
port, started by :class:`ServerPool` exactly as ``--dflash-serve`` starts it. What the server
answers is compared with transformers (the conversion) and with llama.cpp in process (the
engine's use of the server's endpoints). Needs the ``llamacpp`` extra (it compiles llama.cpp)
and transformers; without them the module is skipped with the reason.
"""

from __future__ import annotations

import inspect
import json
import os
import re

import pytest
from benchmark_scripts import script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytest.importorskip("httpx")
pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: pip install "
    "'pytest-dflash[llamacpp]' (compiles llama.cpp)",
)
pytest.importorskip(
    "llama_cpp.server.app", reason="llama_cpp.server needs the [server] extra of llama-cpp-python"
)
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from dflash_fixtures.convert_gguf import ConversionError, convert  # noqa: E402
from pytest_dflash.engines import EngineUnsupported, Sampling, missing  # noqa: E402
from pytest_dflash.engines import llamacpp as lc  # noqa: E402
from pytest_dflash.engines.openai_server import ServerPool, group_members  # noqa: E402
from pytest_dflash.routes.registry import RouteRegistry  # noqa: E402
from pytest_dflash.routes.shipped import pytest_dflash_routes as shipped_routes  # noqa: E402

TEXTS = [
    'def scale(xs, k):\n    """Multiply every item by k."""\n    return [x * k for x in xs]\n',
    "naïve café → ünïcode: 日本語 and emoji 🙂 stay exact\n",
    "    if key in seen:\n        raise ValueError(f'{key!r} twice')\n",
]


def registry() -> RouteRegistry:
    reg = RouteRegistry()
    shipped_routes(reg)
    lc.pytest_dflash_routes(reg)
    reg.validate()
    return reg


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random-weight tiny Llama and a byte-level BPE trained on standard-library sources."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("hf")
    texts = [inspect.getsource(m) for m in (json, inspect, re)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainer=trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<s>", "</s>", "<pad>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gguf_path(hf_dir, tmp_path_factory):
    return convert(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def llama(gguf_path):
    """llama.cpp in process, with every position's logits (the server's defaults)."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf_path), n_ctx=1024, logits_all=True, verbose=False, n_threads=2)


def llama_logprobs(llama, ids: list[int]) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) from llama.cpp in process."""
    import numpy as np

    llama.reset()
    llama.eval(ids)
    logits = np.asarray(llama.scores[: len(ids) - 1], dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return [float(logits[i, ids[i + 1]] - logz[i]) for i in range(len(ids) - 1)]


@pytest.fixture(scope="module")
def pool(gguf_path, tmp_path_factory):
    pool = ServerPool(
        registry(),
        command=lc.serve_command(gguf_path, n_ctx=1024),
        startup_timeout_s=120,
        request_timeout_s=120,
        log_dir=tmp_path_factory.mktemp("server-logs"),
    )
    yield pool
    pool.close()
    assert all(not group_members(entry["pid"]) for entry in pool.history), (
        "a llama.cpp server outlived its pool"
    )


def test_gguf_tokenizes_and_scores_as_transformers(hf_dir, llama):
    """The conversion is faithful: llama.cpp's tokenizer gives transformers' ids (BOS in
    front, multi-byte characters included) and its log-probs match transformers'."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert llama.tokenize(text.encode(), add_bos=True, special=False) == ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = llama_logprobs(llama, ids)
        worst = max(abs(g - w) for g, w in zip(got, want.tolist(), strict=True))
        assert worst < 2e-2, f"llama.cpp log-probs differ from transformers by {worst}"
        assert float(want.std()) > 0.1, "a model this flat could not show a wrong conversion"


def test_conversion_refuses_what_it_cannot_write(hf_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(ConversionError, match="model_type 'qwen2'"):
        convert(bad, tmp_path / "x.gguf")


def test_server_engine_finds_what_llama_cpp_server_offers(pool):
    engine = pool.engine(pool.registry.engine_selection())
    api = engine.api
    assert api.source == "/openapi.json"
    assert (api.tokenize, api.detokenize) == ("/extras/tokenize", "/extras/detokenize")
    assert api.token_prompts is False and api.echo_logprobs and api.stream
    caps = engine.capabilities
    assert caps.prompt_logprobs and not caps.prefill_timing
    assert "reset_prefix_cache" in caps.reasons["prefill_timing"]
    reason = missing([engine], ["prefill_timing", "first_token_hash"])
    assert "prefill_timing" in reason and "first_token_hash" in reason
    with pytest.raises(EngineUnsupported, match="reset_prefix_cache"):
        engine.reset_prefix_cache()


def test_encode_score_generate_and_prefill_match_llama_cpp_in_process(pool, hf_dir, llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    engine = pool.engine(pool.registry.engine_selection())
    for text in TEXTS:
        ids = engine.encode(text, add_special_tokens=True)
        assert ids == tokenizer(text)["input_ids"]
        assert engine.encode(text) == ids[1:]
        got, want = engine.score(ids), llama_logprobs(llama, ids)
        assert len(got) == len(ids) - 1
        # the first scored token comes from the forced one-token completion of the BOS
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4, (got, want)
    gen = engine.generate(TEXTS[0], 24, stop=["\n\n"], sampling=Sampling())
    llama.reset()
    local = llama.create_completion(
        TEXTS[0], max_tokens=24, temperature=0.0, stop=["\n\n"], repeat_penalty=1.0, min_p=0.0
    )
    assert gen.text == local["choices"][0]["text"]
    assert gen.finish_reason == local["choices"][0]["finish_reason"]
    assert gen.token_ids == engine.encode(gen.text)
    pre = engine.prefill(engine.encode(TEXTS[1], add_special_tokens=True))
    assert pre.seconds > 0 and pre.prompt_tokens == len(engine.encode(TEXTS[1])) + 1
    with pytest.raises(EngineUnsupported, match="do not start with"):
        engine.score([5, 6, 7])


@pytest.mark.parametrize(
    "route, settings",
    [
        (lc.FLASH_ATTN, [r"flash_attn\s*=\s*(1|enabled|true)"]),
        (lc.UBATCH, [r"n_ubatch\s*=\s*64"]),
        (lc.KV_Q8_0, [r"flash_attn\s*=\s*(1|enabled|true)", r"K \(q8_0\)", r"V \(q8_0\)"]),
        (lc.KV_Q4_0, [r"flash_attn\s*=\s*(1|enabled|true)", r"K \(q4_0\)", r"V \(q4_0\)"]),
    ],
)
def test_route_switches_reach_llama_cpp(pool, route, settings):
    """Each route's server runs with llama.cpp's own setting switched (read from llama.cpp's
    log of its context), and the baseline's server with none of them."""
    from pathlib import Path

    engine = pool.engine(pool.registry.engine_selection([route]))
    ids = engine.encode(TEXTS[0], add_special_tokens=True)
    assert len(engine.score(ids)) == len(ids) - 1
    entry = pool.history[-1]
    assert entry["enabled_routes"] == [route]
    assert entry["switches"] == {
        pool.registry.get(route).enable_switch: "1",
        **pool.registry.get(route).server_env,
    }
    log = Path(entry["log"]).read_text(errors="replace")
    for pattern in settings:
        assert re.search(pattern, log), f"{route}: llama.cpp's log shows no {pattern!r}"
    base = pool.engine(pool.registry.engine_selection())
    base.encode("x")
    base_log = Path(pool.history[-1]["log"]).read_text(errors="replace")
    assert not re.search(settings[-1], base_log), "the baseline server has the route's setting"


def test_a_server_without_echo_declares_prompt_logprobs_missing(pool):
    """The probe reads the request schema the server publishes: the real llama_cpp.server
    document, with ``echo`` taken out of the completion request, is a server the ppl gate
    must leave pending (with the reason), not one it may call."""
    from pytest_dflash.engines.openai_server import ServerAPI

    engine = pool.engine(pool.registry.engine_selection())
    engine.encode("x")
    doc = engine._client.get("/openapi.json").json()
    assert ServerAPI.from_openapi(doc).capabilities().prompt_logprobs
    schema = doc["components"]["schemas"]["CreateCompletionRequest"]
    del schema["properties"]["echo"]
    caps = ServerAPI.from_openapi(doc).capabilities()
    assert not caps.prompt_logprobs
    assert "no echo with logprobs" in caps.reasons["prompt_logprobs"]


def test_llama_cpp_routes_are_gated_through_dflash_serve(pytester, gguf_path):
    """The shipped suites, ``-p pytest_dflash.engines.llamacpp`` and ``--dflash-serve`` of a
    llama_cpp.server: ppl and quality reach a verdict (passed or failed, never an error), the
    prefill speed gate stays pending with the server's reasons, each selection's server ran
    with the route's llama.cpp settings, and none outlives the session."""
    pytest.importorskip("datasets")
    from pytest_dflash.engines.data import LONG_FILE, PPL_FILE, TASKS_FILE, data_dir
    from pytest_dflash.policy.profiles import sizes

    data = pytester.mkdir("data")
    for name in (PPL_FILE, TASKS_FILE, LONG_FILE):  # every file the selected gates read
        lines = (data_dir() / name).read_text().splitlines()[:2]
        (data / name).write_text("\n".join(lines) + "\n")
    # the long-context ppl test scores a context of ppl_long_tokens; the server's context holds
    # it and the token its scoring completion generates
    n_ctx = sizes("quick").ppl_long_tokens + 16
    pytester.makepyprojecttoml("[tool.pytest-dflash]\nquality_max_new_tokens = 32\n")
    report = pytester.path / "llamacpp.json"
    pytester.runpytest(
        "--pyargs",
        "dflash_suites",
        "--dflash-profile",
        "quick",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_dflash.engines.llamacpp",
        "-m",
        "ppl or quality or prefill",
        "--dflash-data",
        str(data),
        "--dflash-route",
        lc.UBATCH,
        "--dflash-serve",
        lc.serve_command(gguf_path, n_ctx=n_ctx),
        "--dflash-serve-timeout",
        "120",
        "--dflash-report",
        str(report),
        "--dflash-every-test",  # both ppl tests keep their figures (llamacpp_gates.py reads them)
    )
    written = json.loads(report.read_text())
    entry = written["routes"][lc.UBATCH]
    ppl_outcomes = [t["outcome"] for t in entry["gates"]["ppl"]["tests"]]
    # held-out segments and long contexts, each decided by its figures (never an error)
    assert len(ppl_outcomes) == 2 and set(ppl_outcomes) <= {"passed", "failed"}, ppl_outcomes
    quality = [t["outcome"] for t in entry["gates"]["quality"]["tests"]]
    # two tasks the tiny model never solves: no power to see a regression, so inconclusive
    # (the gate stays pending), never an error and never a pass
    assert quality and all(o in ("failed", "inconclusive") for o in quality), quality
    speed = entry["gates"]["prefill"]
    assert speed["status"] == "pending"
    assert all(
        t["outcome"] == "skipped"
        and "first_token_hash" in t["message"]
        and "reset_prefix_cache" in t["message"]
        for t in speed["tests"]
    )
    ppl = entry["gates"]["ppl"]["tests"][0]["measurements"]
    servers = ppl["servers"]
    assert {tuple(s["enabled_routes"]) for s in servers} >= {(), (lc.UBATCH,)}
    assert all(
        s["switches"].get("N_UBATCH") == ("64" if s["enabled_routes"] else None) for s in servers
    )
    assert all(not group_members(s["pid"]) for s in servers)
    assert ppl["ppl_baseline"] > 1 and ppl["tokens"] > 0
    # benchmarks/llamacpp_gates.py reads this report: both ppl tests keep their outcome and
    # deciding figures, and the pending route its reasons
    out = gates_script().figures(written, lc.UBATCH)
    tests = out["gates"]["ppl"]["tests"]
    held, long = tests["test_ppl_heldout_segments"], tests["test_ppl_long_contexts"]
    assert held["max_ppl_rel_delta"] >= 0 and held["ppl_rel_tolerance"] > 0
    assert long["max_band_ppl_rel_delta"] >= 0 and long["ppl_band_rel_tolerance"] > 0
    assert "per token" in held["figure"] and "long contexts" in long["figure"]
    assert set(out["gates"]["ppl"]["server_switches"]) == {"baseline", lc.UBATCH}
    assert out["verdict"] == "pending" and any("prefill" in r for r in out["reasons"])
    assert out["gates"]["quality"]["status"] == "inconclusive"


def gates_script():
    """``benchmarks/llamacpp_gates.py`` as a module."""
    return script("llamacpp_gates")
