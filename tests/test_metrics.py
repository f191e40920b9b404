"""The shipped evaluate metrics, loaded by absolute path, vs direct formulas and known values."""

from __future__ import annotations

import math
import os
import random
from fractions import Fraction

import pytest

from pytest_dflash.metrics import known_metrics, load_metric


@pytest.fixture(scope="module")
def pass_at_k():
    return load_metric("pass_at_k")


@pytest.fixture(scope="module")
def perplexity():
    return load_metric("perplexity")


def exact_pass_at_k(n: int, c: int, k: int) -> float:
    """The textbook form 1 - C(n-c, k) / C(n, k), in exact rational arithmetic."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_known_metrics_are_the_shipped_folders():
    assert known_metrics() == ["pass_at_k", "perplexity"]


def test_unknown_metric_lists_known_ones():
    with pytest.raises(ValueError, match="unknown metric 'bleu'; known metrics: pass_at_k, perp"):
        load_metric("bleu")


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(1, 1, 1), (10, 0, 1), (10, 10, 5), (10, 3, 1), (10, 3, 5), (20, 7, 10), (200, 13, 100)],
)
def test_pass_at_k_matches_the_binomial_formula(pass_at_k, n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    result = pass_at_k.compute(task_ids=["t"], passed=[outcomes], k=k)
    assert result[f"pass@{k}"] == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_averages_tasks_and_reports_every_k(pass_at_k):
    rng = random.Random(7)
    tasks = [[rng.random() < 0.4 for _ in range(rng.randint(10, 30))] for _ in range(25)]
    result = pass_at_k.compute(task_ids=[f"t{i}" for i in range(25)], passed=tasks, k=[1, 5, 10])
    assert result["tasks"] == 25
    for k in (1, 5, 10):
        expected = sum(exact_pass_at_k(len(t), sum(t), k) for t in tasks) / 25
        assert result[f"pass@{k}"] == pytest.approx(expected, rel=1e-12)
    # pass@1 is the plain mean pass rate per task
    assert result["pass@1"] == pytest.approx(sum(sum(t) / len(t) for t in tasks) / 25, rel=1e-12)


def test_pass_at_k_with_fewer_samples_than_k_is_a_clear_error(pass_at_k):
    with pytest.raises(ValueError, match="task 'HumanEval/3' has 2 sample\\(s\\), fewer than k=5"):
        pass_at_k.compute(
            task_ids=["HumanEval/1", "HumanEval/3"],
            passed=[[True] * 5, [True, False]],
            k=[1, 5],
        )


@pytest.mark.parametrize("k", [0, -1, [1, 0], [], True])
def test_pass_at_k_bad_k(pass_at_k, k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        pass_at_k.compute(task_ids=["a"], passed=[[True]], k=k)


def test_pass_at_k_duplicate_task(pass_at_k):
    with pytest.raises(ValueError, match="task 'a' appears twice"):
        pass_at_k.compute(task_ids=["a", "a"], passed=[[True], [False]], k=1)


def test_loading_ignores_a_same_named_folder_in_the_cwd(tmp_path, monkeypatch):
    decoy = tmp_path / "pass_at_k"
    decoy.mkdir()
    (decoy / "pass_at_k.py").write_text("raise RuntimeError('decoy metric loaded')\n")
    monkeypatch.chdir(tmp_path)
    metric = load_metric("pass_at_k")
    assert metric.compute(task_ids=["a"], passed=[[True, False]], k=1)["pass@1"] == 0.5


def test_loading_sets_offline_mode_unless_the_caller_chose(monkeypatch):
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "recorded")  # so monkeypatch restores the original state
        monkeypatch.delenv(variable)
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "0")
    load_metric("perplexity")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["HF_EVALUATE_OFFLINE"] == "0"


def test_perplexity_known_values(perplexity):
    # a byte model that is uniform over 256 values: perplexity 256, exactly 8 bits per byte
    uniform = [-math.log(256)] * 64
    result = perplexity.compute(logprobs=[uniform, uniform[:32]], num_bytes=[64, 32])
    assert result["perplexity"] == pytest.approx(256.0, rel=1e-12)
    assert result["bits_per_byte"] == pytest.approx(8.0, rel=1e-12)
    assert result["perplexities"] == pytest.approx([256.0, 256.0], rel=1e-12)
    assert (result["tokens"], result["bytes"]) == (96, 96)


def test_perplexity_matches_direct_formulas(perplexity):
    rng = random.Random(3)
    segments = [
        [math.log(rng.uniform(0.01, 1.0)) for _ in range(rng.randint(5, 40))] for _ in range(6)
    ]
    nbytes = [rng.randint(len(s), 4 * len(s)) for s in segments]
    result = perplexity.compute(logprobs=segments, num_bytes=nbytes)
    flat = [lp for s in segments for lp in s]
    nll = -sum(flat)
    assert result["mean_nll"] == pytest.approx(nll / len(flat), rel=1e-12)
    assert result["perplexity"] == pytest.approx(math.exp(nll / len(flat)), rel=1e-12)
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / sum(nbytes), rel=1e-12)
    assert result["perplexities"] == pytest.approx(
        [math.exp(-sum(s) / len(s)) for s in segments], rel=1e-12
    )


@pytest.mark.parametrize(
    ("logprobs", "num_bytes", "message"),
    [
        ([[-0.5, 0.3]], [4], "segment 0 token 1: log-prob 0.3 is not a finite natural-log"),
        ([[-0.5, float("nan")]], [4], "segment 0 token 1: log-prob nan"),
        ([[-0.5], []], [4, 4], "segment 1 has no scored tokens"),
        ([[-0.5]], [0], "segment 0: num_bytes must be a positive byte count"),
    ],
)
def test_perplexity_bad_inputs(perplexity, logprobs, num_bytes, message):
    with pytest.raises(ValueError, match=message):
        perplexity.compute(logprobs=logprobs, num_bytes=num_bytes)
