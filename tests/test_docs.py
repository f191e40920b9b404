"""The documentation cites only what the repository holds: every relative link and every
backticked repository path in README.md and docs/*.md names a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("pytest_dflash", "kernels", "suites", "fixtures", "docs", "tests", "scripts",
       "benchmarks", ".ci")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a backticked path under one of the top folders, e.g. `kernels/csrc/qpn_gemm.cpp`
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")


def _targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text(encoding="utf-8")
    found = []
    for link in LINK.findall(text):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue  # a URL or an anchor in the same page
        found.append((link, doc.parent / link.split("#")[0]))
    for path in PATH.findall(text):
        found.append((path, ROOT / path.rstrip(".")))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_cited_file_exists(doc: Path) -> None:
    missing = [cited for cited, path in _targets(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(ROOT)} cites what the repository does not hold: " \
                        f"{missing}"
