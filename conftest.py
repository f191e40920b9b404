"""pytest setup of this repository: the plugin's own tests and a worked example.

This file configures runs *inside this repository* only; users of the installed plugin never
load it. It has three jobs:

1. the pytester plugin for the own tests (``tests/``), which run pytest inside pytest;
2. fixtures the own tests share (``repo_root``, ``run_repo_pytest``);
3. a worked example of what an engine repository puts in its own conftest: registering a local
   route into a shipped family so the shipped suites gate it (docs/extending.md walks through
   it). The example is opt-in (``--example-route``) so the main job's verdict table stays the
   shipped stack's: ``pytest -m sm70 --example-route --dflash-route attn.d256.example``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parent


# ------------------------------------------------------------------ 3. the worked example

class ExampleAttention:
    """An attn.d256 route in plain torch (fp32 math), as an engine repository would write it.

    It follows the family contract (``pytest_dflash.routes.families.AttnD256``): ``dense`` and
    ``paged`` write into the caller's ``out`` and record one route hit per call, which is how
    the gates prove that this route, not a fallback, computed what they judge.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def _attend(self, q, k, v, out, softmax_scale: float, causal: bool) -> None:
        import torch

        tq, hq, _ = q.shape
        tk, hkv, _ = k.shape
        qf = q.float().transpose(0, 1)
        kf = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        scores = qf @ kf.transpose(1, 2) * softmax_scale
        if causal:  # bottom-right: query i sees keys up to i + (tk - tq)
            rows = torch.arange(tq, device=q.device).unsqueeze(1) + (tk - tq)
            cols = torch.arange(tk, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > rows, float("-inf"))
        out.copy_((scores.softmax(-1) @ vf).transpose(0, 1).to(out.dtype))

    def dense(self, q, k, v, out, softmax_scale: float, causal: bool) -> None:
        from pytest_dflash.native import hits
        hits.record(self.name, "dense")
        self._attend(q, k, v, out, softmax_scale, causal)

    def paged(self, q, k_cache, v_cache, block_table, kv_len: int, out, softmax_scale: float,
              causal: bool) -> None:
        from dflash_kernels.attention import gather_pages
        from pytest_dflash.native import hits
        hits.record(self.name, "paged")
        k, v = gather_pages(k_cache, v_cache, block_table, kv_len)
        self._attend(q, k, v, out, softmax_scale, causal)


class ExampleRoutes:
    """The example's registration. In an engine repository this is a plain module-level
    ``def pytest_dflash_routes(registry)`` in its conftest; here it sits in an object that is
    registered only with ``--example-route``."""

    def pytest_dflash_routes(self, registry) -> None:
        from pytest_dflash import Route
        registry.register(Route(
            "attn.d256.example", family="attn.d256", role="candidate",
            baseline="attn.d256.sdpa", gates=("parity",),
            impl=ExampleAttention("attn.d256.example"),
            description="worked example: plain-torch attention from the repository conftest"))


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--example-route``: register the worked-example route of this conftest."""
    parser.getgroup("dflash").addoption(
        "--example-route", action="store_true", default=False,
        help="(this repository) register the worked-example route attn.d256.example "
             "from conftest.py so the shipped suites gate it")


@pytest.hookimpl(tryfirst=True)  # before pytest-dflash asks every plugin for its routes
def pytest_configure(config: pytest.Config) -> None:
    """Register the example's routes when asked for (``--example-route``)."""
    if config.getoption("example_route") and not config.pluginmanager.has_plugin("example-routes"):
        config.pluginmanager.register(ExampleRoutes(), "example-routes")


# ------------------------------------------------------------------ 2. shared fixtures

@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (where ``pyproject.toml`` and the suites live)."""
    return ROOT


@pytest.fixture
def run_repo_pytest(tmp_path: Path):
    """Run pytest in a fresh interpreter at the repository root, bounded in time, with its
    report in ``tmp_path``: ``run_repo_pytest(*args) -> (CompletedProcess, report_path)``.

    For tests that must see this repository's own configuration (pyproject, this conftest),
    which pytester's temporary projects do not."""

    def run(*args: str, timeout_s: float = 600) -> tuple[subprocess.CompletedProcess, Path]:
        report = tmp_path / "dflash-report.json"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                   "--dflash-report", str(report), *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ))
        return done, report

    return run


@pytest.fixture
def run_child_json():
    """Run Python ``code`` in a fresh interpreter and return the JSON its last stdout line holds:
    ``run_child_json(code, timeout_s=300) -> object``.

    For calls that must raise a clear error, where a native crash instead (a library built
    with a static libstdc++ once ended refused op calls in SIGSEGV; docs/cuda.md) has to fail
    the one test, naming the signal, rather than end the whole session."""

    def run(code: str, timeout_s: float = 300) -> object:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ))
        if done.returncode < 0:
            pytest.fail(f"the child interpreter crashed ({signal.Signals(-done.returncode).name})"
                        f"; stderr: {done.stderr[-2000:]}")
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run

