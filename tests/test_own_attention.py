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

def _attend(query, key, value, mask, scaling, groups, dtype=None):
    import torch
    work = dtype or torch.float32
    k = key.to(work).repeat_interleave(groups, dim=1)
    v = value.to(work).repeat_interleave(groups, dim=1)
    scores = query.to(work) @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.float().softmax(-1).to(work) @ v).to(query.dtype).transpose(1, 2).contiguous()


def top_left_causal(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Ignores the mask it is given: assumes as many keys as queries (top-left causal)."""
    import torch
    sq, skv = query.shape[2], key.shape[2]
    own = None
    if attention_mask is not None:
        own = torch.ones(sq, skv, dtype=torch.bool, device=query.device).tril()[None, None]
    return _attend(query, key, value, own, scaling, module.num_key_value_groups), None


def fp16_accumulation(module, query, key, value, attention_mask, scaling=None, **kwargs):
    import torch
    return _attend(query, key, value, attention_mask, scaling, module.num_key_value_groups,
                   torch.float16), None


def drift_past_1k(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out = _attend(query, key, value, attention_mask, scaling, module.num_key_value_groups)
    return (out * 1.001 if key.shape[2] > 1024 else out), None


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
