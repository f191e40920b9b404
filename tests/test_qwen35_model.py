"""The committed Qwen3.5-architecture fixture model (``dflash_fixtures/qwen35_model``): its
checksum and log, the architecture the transformers engine's routes need (the shipped stack's
hybrid layer pattern, head dim 256 with GQA, MLP sizes of the QPN contract), and a prefill in
chunks over transformers' own cache that equals one forward."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import dflash_fixtures  # noqa: E402
from dflash_fixtures import train_qwen35  # noqa: E402

MODEL_DIR = Path(dflash_fixtures.__file__).resolve().parent / "qwen35_model"
RESULT = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "hf_qwen35_model.json"


def _log_figure(log: str, name: str) -> float:
    return float(log.split(name)[1].split(":")[1].split()[0])


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, local_files_only=True
    ).eval()


def test_committed_weights_match_their_checksum_and_log():
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 20 << 20
    sha = (MODEL_DIR / "model.safetensors.sha256").read_text().split()[0]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == sha, "weights altered or truncated"
    log = (MODEL_DIR / "train_log.txt").read_text()
    assert f"sha256 {sha}" in log, "train_log.txt does not describe the committed weights"
    # the result file quotes the log of the run that made these weights
    rows = dict(json.loads(RESULT.read_text())["values"]["rows"])
    assert float(rows["heldout_bits_per_byte"]) == _log_figure(log, "held-out bits per byte")
    assert float(rows["heldout_greedy_pass_at_1"]) == _log_figure(log, "held-out greedy pass@1")


def test_architecture_is_the_shipped_hybrid(model):
    cfg = model.config
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    groups = [cfg.layer_types[i : i + 4] for i in range(0, len(cfg.layer_types), 4)]
    assert len(groups) >= 2 and len(cfg.layer_types) % 4 == 0
    assert all(g == ["linear_attention"] * 3 + ["full_attention"] for g in groups), groups
    assert cfg.head_dim == 256
    assert cfg.num_attention_heads > cfg.num_key_value_heads >= 1  # GQA
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    attn = model.model.layers[3].self_attn
    assert attn.k_proj.out_features == cfg.num_key_value_heads * 256
    # QPN contract on every MLP GEMM: K % 64 == 0 and N % 32 == 0 (weights are [N, K])
    for layer in model.model.layers:
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            n, k = proj.weight.shape
            assert k % 64 == 0 and n % 32 == 0, (n, k)
    assert next(model.parameters()).dtype == torch.float32


def test_chunked_prefill_over_the_cache_equals_one_forward(model):
    ids = torch.randint(
        3, model.config.vocab_size, (1, 700), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        whole = model(input_ids=ids, use_cache=False).logits[0]
        cache = transformers.DynamicCache(config=model.config)
        parts = [
            model(input_ids=ids[:, s : s + 300], cache=cache, use_cache=True).logits[0]
            for s in range(0, ids.shape[1], 300)
        ]
        # the DeltaNet layers carry their recurrent and conv state between the calls
        assert all(cache.layers[0].is_recurrent_states_initialized.values())
        # a fresh cache per chunk (no carried state) must differ: the comparison can fail
        cold = model(input_ids=ids[:, 300:600], use_cache=False).logits[0]
    chunked = torch.cat(parts)
    assert chunked.shape == whole.shape
    assert (chunked - whole).abs().max().item() < 1e-4
    assert (cold - whole[300:600]).abs().max().item() > 1e-2


def test_greedy_completion_of_a_heldout_style_prompt_is_a_function_body(model):
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    prompt = (
        'def lift_points(pts):\n    """Return a new list with 3 added to each element of pts."""\n'
    )
    ids = tok(prompt, return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tok.bos_token_id
    out = model.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.startswith("    return"), text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--hidden", "100"], "--hidden 100"),
        (["--groups", "1"], "--groups 1"),
        (["--ffn", "400"], "--ffn 400"),
    ],
)
def test_training_script_refuses_sizes_outside_the_contract(tmp_path, capsys, flags, named):
    with pytest.raises(SystemExit):
        train_qwen35.main(["--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert named in err and "multiples of 64" in err
    assert not (tmp_path / "train_log.txt").exists()
