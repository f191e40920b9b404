"""An engineer's own attention function (transformers' signature) as an attn.d256 route: the
documented example, run as written, is accepted; planted defects are rejected; bad input is a
usage error before any test runs; on the transformers engine it serves the model's attention
layers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- own-attention-example -->"


def documented_example() -> str:
    """The conftest.py of docs/engines.md's example, exactly as the page shows it."""
    text = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text[text.index(MARK):], re.S)
    assert block, "docs/engines.md lost its own-attention example"
    return block.group(1)


DEFECTS = '''

def _scores(query, key, mask, scaling, groups):
    import torch
    k = key.float().repeat_interleave(groups, dim=1)
    scores = query.float() @ k.transpose(-1, -2) * scaling
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _out(weighted, query):
    return weighted.to(query.dtype).transpose(1, 2).contiguous()


def top_left_causal(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Ignores the mask it is given and builds its own for as many keys as queries (top-left
    causal): a chunk over a cached prefix sees only the prefix's first keys."""
    import torch
    sq, skv = query.shape[2], key.shape[2]
    own = None
    if attention_mask is not None:
        own = torch.ones(sq, skv, dtype=torch.bool, device=query.device).tril()[None, None]
    groups = module.num_key_value_groups
    probs = _scores(query, key, own, scaling, groups).softmax(-1)
    return _out(probs @ value.float().repeat_interleave(groups, dim=1), query), None


def fp16_accumulation(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Keeps its running sums in fp16 registers: the softmax row sum one key at a time, the
    weighted values 16 keys at a time (an MMA step with an fp16 accumulator). The products
    themselves are exact: only the accumulation is fp16."""
    import torch
    groups, half = module.num_key_value_groups, torch.float16
    scores = _scores(query, key, attention_mask, scaling, groups)
    probs = (scores - scores.amax(-1, keepdim=True)).exp().to(half)
    v = value.to(half).repeat_interleave(groups, dim=1)
    acc = torch.zeros(*probs.shape[:3], v.shape[-1], dtype=half, device=query.device)
    row_sum = torch.zeros(*probs.shape[:3], 1, dtype=half, device=query.device)
    for t in range(0, v.shape[2], 16):
        acc = (acc.float() + probs[..., t:t + 16].float() @ v[..., t:t + 16, :].float()).to(half)
    for t in range(v.shape[2]):
        row_sum = row_sum + probs[..., t:t + 1]
    return _out(acc.float() / row_sum.float(), query), None


def drift_past_1k(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Scales a query's scores by log(n) / log(1024) once it sees n > 1024 keys (long-context
    "logn" scaling, switched on for a model never trained with it): exact up to 1K keys."""
    import math
    import torch
    sq, skv = query.shape[2], key.shape[2]
    seen = torch.arange(skv - sq + 1, skv + 1, dtype=torch.float32, device=query.device)
    factor = (seen.log() / math.log(1024)).clamp(min=1.0)[:, None]
    groups = module.num_key_value_groups
    probs = (_scores(query, key, attention_mask, scaling, groups) * factor).softmax(-1)
    return _out(probs @ value.float().repeat_interleave(groups, dim=1), query), None


def _register_defects(registry):
    for fn in (top_left_causal, fp16_accumulation, drift_past_1k):
        registry.register(attention_route(f"attn.d256.{fn.__name__}", fn))


_example_routes = pytest_dflash_routes


def pytest_dflash_routes(registry):
    _example_routes(registry)
    _register_defects(registry)
'''


def test_documented_example_accepted_and_planted_defects_rejected(
        pytester: pytest.Pytester) -> None:
    """The dense parity tests of attn.d256 (the candidate against the fp64 oracle: prefixes
    Tq < Tk at the tile edges, causal prefills of 1024 and 4096 keys at the ci profile) judge
    the documented function and three planted ones."""
    pytester.makeconftest(documented_example() + DEFECTS)
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(
        "--pyargs", "dflash_suites.test_parity_attn", "-k", "dense_parity",
        "--dflash-profile", "ci", "--dflash-route", "attn.d256.mine",
        "--dflash-route", "attn.d256.top_left_causal",
        "--dflash-route", "attn.d256.fp16_accumulation",
        "--dflash-route", "attn.d256.drift_past_1k",
        "--dflash-report", str(report), "-p", "no:cacheprovider", timeout=900)
    assert report.is_file(), result.stdout.str()[-3000:]
    routes = json.loads(report.read_text())["routes"]
    assert routes["attn.d256.mine"]["gates"]["parity"]["status"] == "passed", routes[
        "attn.d256.mine"]["gates"]["parity"]
    for defect in ("top_left_causal", "fp16_accumulation", "drift_past_1k"):
        gate = routes[f"attn.d256.{defect}"]["gates"]["parity"]
        assert gate["status"] == "failed", (defect, gate)


# The model-level gates that must reject each planted defect inside the transformers engine's
# model at the quick profile (prefill prompts of 256 and 512 tokens, one long context of 2048
# tokens scored in chunks of 206): a drift that starts past 1K keys is out of the prompts' reach,
# so only the long context's bands can see it. The prefill gate runs only where its agreement
# check must reject (before any timing): timing a route whose speed is the baseline's runs to
# the cap of worker processes, which this test does not need.
REJECTED_BY = {"top_left_causal": ("ppl", "prefill"), "fp16_accumulation": ("ppl", "prefill"),
               "drift_past_1k": ("ppl",)}
# what each gate's failure says (suites/test_ppl.py, suites/test_speed_prefill.py)
FAILURE_WORDS = {"ppl": "perplexity", "prefill": "after the same cold prefill"}


def segment_perplexities(entry: dict) -> list[float]:
    """The per-segment perplexities the ppl gate's short-segment test recorded for a route."""
    (test,) = [t for t in entry["gates"]["ppl"]["tests"] if "heldout_segments" in t["nodeid"]]
    return test["measurements"]["per_segment_candidate"]


def test_planted_defects_rejected_by_model_level_gates(pytester: pytest.Pytester) -> None:
    """Inside the Qwen3.5 hybrid of ``--dflash-engine hf``, the ppl gate and the prefill gate's
    agreement check (the candidate's next-token distributions after the same cold prefill as
    the baseline's) reject each planted defect, and the route's reasons name the gate; the
    documented function passes ppl. Not only op-level parity: these are the model's own
    predictions."""
    from pytest_dflash.evidence.report import judged, load

    pytester.makeconftest(documented_example() + DEFECTS)
    report = pytester.path / "r.json"
    gates = ["--dflash-gate=attn.d256.mine:ppl"] + [
        f"--dflash-gate=attn.d256.{name}:{kind}"
        for name, kinds in REJECTED_BY.items() for kind in kinds]
    result = pytester.runpytest_subprocess(
        "--pyargs", "dflash_suites.test_ppl", "dflash_suites.test_speed_prefill",
        "--dflash-engine", "hf", "--dflash-profile", "quick", *gates,
        "--dflash-report", str(report), "-p", "no:cacheprovider", timeout=900)
    assert report.is_file(), result.stdout.str()[-3000:]
    routes = judged(load(report)["routes"])

    mine = routes["attn.d256.mine"]
    assert mine["gates"]["ppl"]["status"] == "passed", mine["gates"]["ppl"]
    for defect, kinds in REJECTED_BY.items():
        entry = routes[f"attn.d256.{defect}"]
        assert entry["verdict"] == "reject", (defect, entry["reasons"])
        for kind in kinds:
            named = [r for r in entry["reasons"] if r.startswith(f"{kind} failed: ")]
            assert named and FAILURE_WORDS[kind] in named[0], (defect, kind, entry["reasons"])
    # the drift is exact below 1K keys: on the short segments it scores what the example does
    drift = routes["attn.d256.drift_past_1k"]
    assert segment_perplexities(drift) == segment_perplexities(mine)


@pytest.mark.parametrize("body, words", [
    ("def f(q, k, v):\n    return q, None\n", "*is not a transformers attention function*"),
    ("def f(module, query, key, value, attention_mask, scaling=None, **kw):\n"
     "    return query, None\n", "*returned (1, 2, 3, 256)*expects [[]B, Sq, Hq, D[]]*"),
    ("f = 'no_such_attention'\n", "*transformers knows no attention function 'no_such_attention'*"),
])
def test_bad_own_function_is_a_usage_error(pytester: pytest.Pytester, body: str,
                                           words: str) -> None:
    pytester.makeconftest(
        "from pytest_dflash.engines.own_attention import attention_route\n" + body +
        "def pytest_dflash_routes(registry):\n"
        "    registry.register(attention_route('attn.d256.mine', f))\n")
    pytester.makepyfile(test_a="def test_a():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([words])


def test_own_function_serves_the_models_attention(tmp_path: Path) -> None:
    import torch
    from qwen35_model import make_qwen35

    from pytest_dflash.engines import transformers as hf
    from pytest_dflash.engines.own_attention import attention_route

    namespace: dict = {}
    exec(documented_example(), namespace)  # the documented function, as written
    registry = hf.default_registry()
    registry.register(attention_route("attn.d256.mine", namespace["my_attention"]))
    model = make_qwen35(tmp_path / "qwen35")
    mine = hf.build(model, {"attn.d256": "attn.d256.mine"}, "quick", registry=registry)
    base = hf.build(model, {}, "quick", registry=registry)
    for engine in (mine, base):
        engine.chunk = 40
    ids = mine.encode("def lift(pts):\n    return [p + 1 for p in pts]\n" * 4,
                      add_special_tokens=True)
    positions = list(range(len(ids)))
    ours, theirs = mine.prefill_logits(ids, positions), base.prefill_logits(ids, positions)
    assert float((ours - theirs).abs().max()) < 1e-4
    hits = mine.route_hits()
    assert hits["attn.d256.mine:layer3:cached"] > 0 and hits["attn.d256.mine/paged"] > 0
    assert mine.attention_served_by == "attn.d256.mine"
    assert not any(key.startswith("attn.d256.sdpa") for key in hits)
    assert torch.isfinite(ours).all()
