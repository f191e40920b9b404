"""Fixture data, the training script and the committed weights of the reference model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_fixtures import make_data, tasks
from dflash_fixtures.make_data import HELD_OUT_MODULES, corpus_files, stdlib_dir
from pytest_dflash.engines import model as M

MODEL_DIR = Path(make_data.__file__).resolve().parent / "model"


def _run(program: str) -> int:
    return subprocess.run([sys.executable, "-c", program], capture_output=True,
                          timeout=60).returncode


@pytest.mark.parametrize("held_out", [False, True], ids=["train", "heldout"])
def test_reference_bodies_pass_and_wrong_bodies_fail(held_out):
    batch = tasks.make_tasks(len(tasks.FAMILIES), seed=5, held_out=held_out)
    program = "\n".join(
        f"exec({t.program(t.solution)!r}, {{}})" for t in batch
    )
    assert _run(program) == 0
    for task in batch:  # every family's asserts must catch a wrong answer
        assert _run(task.program("    return None\n")) != 0, task.task_id


def test_heldout_names_never_appear_in_training_tasks():
    train = tasks.make_tasks(3000, seed=1234, held_out=False)
    heldout = [json.loads(line) for line in make_data.CODING_TASKS.read_text().splitlines()]
    train_names = {t.entry_point for t in train}
    train_prompts = {t.prompt for t in train}
    assert not train_names & {t["entry_point"] for t in heldout}
    assert not train_prompts & {t["prompt"] for t in heldout}


def test_committed_heldout_tasks_are_the_generator_output():
    expected = [t.to_json() for t in tasks.make_tasks(
        make_data.N_HELDOUT_TASKS, make_data.HELDOUT_TASK_SEED, held_out=True)]
    committed = [json.loads(line) for line in make_data.CODING_TASKS.read_text().splitlines()]
    assert committed == expected


def test_corpus_excludes_heldout_modules_and_ppl_segments_come_from_them():
    files = corpus_files()
    assert files == sorted(files)
    names = {str(f) for f in files}
    assert not names & set(HELD_OUT_MODULES)
    assert not {f for f in names if Path(f).name in {f"test_{m}" for m in HELD_OUT_MODULES}}
    rows = [json.loads(line) for line in make_data.PPL_SEGMENTS.read_text().splitlines()]
    assert len(rows) == make_data.N_SEGMENTS
    if sys.version_info[:2] != (3, 11):
        pytest.skip("segments were cut from the Python 3.11 standard library")
    for row in rows:
        assert row["module"] in HELD_OUT_MODULES
        assert row["text"] in (stdlib_dir() / row["module"]).read_text(encoding="utf-8")


def test_gated_delta_rule_chunked_equals_recurrent():
    torch.manual_seed(0)
    b, t, h, d = 2, 150, 2, 32
    for spread in (1.0, 0.05):  # random keys, then nearly parallel keys (ill-conditioned)
        base = torch.randn(d)
        k = torch.nn.functional.normalize(base + spread * torch.randn(b, t, h, d), dim=-1)
        q = torch.nn.functional.normalize(torch.randn(b, t, h, d), dim=-1) / d**0.5
        v, g, beta = torch.randn(b, t, h, d), -torch.rand(b, t, h), torch.rand(b, t, h)
        s0 = torch.randn(b, h, d, d) * 0.1
        o_ref, s_ref = M.gdr_recurrent(q, k, v, g, beta, s0)
        o, s = M.gdr_chunked(q, k, v, g, beta, s0, chunk=64)
        torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_ssm_mixer_split_into_calls_equals_one_call_and_fp16_state_differs():
    cfg = M.ModelConfig()
    torch.manual_seed(1)
    layer = M._flat(M.HybridLM(cfg).layers[0]["mix"])
    x = torch.randn(1, 100, cfg.d_model)
    with torch.no_grad():
        whole, _, s_whole = M.ssm_mixer(layer, x, cfg, None, None)
        y1, c1, s1 = M.ssm_mixer(layer, x[:, :37], cfg, None, None)
        y2, _, s2 = M.ssm_mixer(layer, x[:, 37:], cfg, c1, s1)
        torch.testing.assert_close(torch.cat([y1, y2], 1), whole, atol=1e-5, rtol=1e-4)
        half, _, s_half = M.ssm_mixer(layer, x, cfg, None, None, state_dtype=torch.float16)
    assert s_half.dtype == torch.float16
    assert 0 < (half - whole).abs().max() < 1e-2


def test_nvfp4_export_decodes_like_the_kernels_dequantize():
    from dflash_kernels.nvfp4 import NVFP4Weight, dequantize

    torch.manual_seed(2)
    w = torch.randn(64, 128) * torch.rand(64, 1) * 3
    codes, scales, glob = M.nvfp4_codes(w)
    ours = M.nvfp4_decode(codes, scales, glob)
    theirs = dequantize(NVFP4Weight(M.pack_nibbles(codes), scales, float(glob)))
    assert torch.equal(ours, theirs)
    assert torch.equal(M.unpack_nibbles(M.pack_nibbles(codes)), codes)
    assert (ours - w).norm() / w.norm() < 0.15


def test_committed_checkpoint_loads_and_its_log_names_it():
    cfg, tensors = M.load_checkpoint(MODEL_DIR)
    assert (MODEL_DIR / "weights.pt").stat().st_size <= 16 << 20
    sha = (MODEL_DIR / "weights.sha256").read_text().split()[0]
    log = (MODEL_DIR / "train_log.txt").read_text()
    assert f"sha256 {sha}" in log, "train_log.txt does not describe the committed weights"
    bpb = float(log.split("held-out bits per byte")[1].split(":")[1].split()[0])
    pass1 = float(log.split("held-out greedy pass@1")[1].split(":")[1].split()[0])
    assert bpb <= 2.5 and pass1 >= 0.6, (bpb, pass1)
    for i in range(cfg.n_layers):
        packed, scales, _ = M.mlp_nvfp4(tensors, f"layers.{i}.mlp.gate_up.weight")
        assert packed.dtype == torch.uint8 and packed.shape == (2 * cfg.d_ff, cfg.d_model // 2)
        assert scales.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("damage", ["truncated", "altered", "no_sha"])
def test_damaged_checkpoint_fails_clearly(tmp_path, damage):
    shutil.copytree(MODEL_DIR, tmp_path / "m")
    weights = tmp_path / "m" / "weights.pt"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "altered":
        weights.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    else:
        (tmp_path / "m" / "weights.sha256").unlink()
    with pytest.raises(M.CheckpointError) as info:
        M.load_checkpoint(tmp_path / "m")
    expected = "missing" if damage == "no_sha" else "truncated or altered"
    assert expected in str(info.value)


def test_training_script_runs_on_cpu(tmp_path):
    index = make_data.build_corpus(tmp_path / "corpus.bin", limit_files=4)
    assert index["files"] == 4 and (tmp_path / "corpus.json").is_file()
    out = tmp_path / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_fixtures.train", "--corpus", str(tmp_path / "corpus.bin"),
         "--out", str(out), "--device", "cpu", "--smoke", "--steps", "3", "--batch", "2",
         "--seq-len", "32", "--eval-tasks", "1", "--eval-segments", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "train_log.txt").read_text()
    losses = [float(line.split("loss ")[1].split()[0]) for line in log.splitlines()
              if line.startswith("step ")]
    assert losses and all(0 < x < 10 for x in losses)
    cfg, _ = M.load_checkpoint(out)  # sha256 written by the script matches its own file
    assert cfg.d_model == 64
    assert "held-out bits per byte" in log
