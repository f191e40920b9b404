"""Own tests of pytest-dflash.

torch is imported here, once, before any pytester inline run: pytester restores sys.modules
after each inline run, and a C extension such as torch cannot be imported a second time.
httpx likewise: imported first inside an inline run and re-imported after it, its transport maps
the *old* httpcore exception classes, so a refused connection escapes as a raw httpcore error
and a server engine's health wait gives up at once instead of retrying. `evaluate` likewise: its
import registers torch's ``c10d_functional`` op library, which a second import refuses, so a
second inline run that scores perplexity would end in a harness error.

``real_runs`` runs real gates once per session; the readers of a report (plot, JUnit, diff,
summaries, merge) are tested on the files they wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import evaluate  # noqa: F401
import pytest
import torch  # noqa: F401

with contextlib.suppress(ImportError):  # the test extra; `pip install -e .` alone lacks it
    import httpcore  # noqa: F401  (httpx imports it lazily, inside the first client)
    import httpx  # noqa: F401


# ------------------------------------------------------------------ reports of real gate runs

ROOT = Path(__file__).resolve().parent.parent
# the real gates the readers of a report are tested on: the fa2 route's loader and parity gates
# (deterministic) and its speed gate (timed in worker processes), at quick size
REAL_SELECTION = ("-m", "sm70 and (loader or parity or speed)", "--dflash-route",
                  "attn.d256.fa2", "--dflash-profile", "quick")


@dataclass(frozen=True)
class RealRuns:
    """Three shards of the real selection, each run in its own folder as on its own host,
    their merge, and one unsharded run of the deterministic gates."""

    folder: Path
    shards: tuple[Path, ...]  # s1.json, s2.json, s3.json
    junit: tuple[Path, ...]  # each shard's JUnit XML
    merged: Path  # pytest-dflash merge of the three
    unsharded: Path  # one run of the loader and parity gates

    def load(self, path: Path) -> dict:
        return json.loads(path.read_text(encoding="utf-8"))


def _pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "--rootdir", str(ROOT), "-c",
               str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider", "-q", *args,
               str(ROOT / "suites")]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ))


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> RealRuns:
    """Real gates run once per test session (a few minutes on a 2-core CPU): a change of the
    report's shape reaches every test built on these files."""
    folder = tmp_path_factory.mktemp("real-runs")
    shards, junit = [], []
    for k in (1, 2, 3):
        here = folder / f"host{k}"
        report, xml = here / f"s{k}.json", here / f"s{k}.xml"
        # 2 rounds a process in the report (evidence.compact): every reader meets a sample
        done = _pytest_in(here, *REAL_SELECTION, f"--dflash-shard={k}/3",
                          "--dflash-report-rounds=2",
                          f"--dflash-report={report}", f"--junitxml={xml}")
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
        shards.append(report)
        junit.append(xml)
    unsharded = folder / "one" / "one.json"
    done = _pytest_in(unsharded.parent, "-m", "sm70 and (loader or parity)",
                      *REAL_SELECTION[2:], f"--dflash-report={unsharded}")
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    merged = folder / "all.json"
    done = subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "merge", str(merged),
                           *map(str, shards)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return RealRuns(folder, tuple(shards), tuple(junit), merged, unsharded)
