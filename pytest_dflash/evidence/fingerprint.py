"""Evidence fingerprint: what exactly was measured, so results of different code never merge.

Only cheap facts are gathered here; the device part is filled in by the plugin once torch is
loaded anyway. ``key`` is the subset that must match for ``--dflash-merge``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

KEY_FIELDS = ("git_head", "git_dirty_sha256", "kernel_sources_sha256", "sidecar_sha256",
              "torch", "cuda", "device", "engine")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _git(root: Path, *args: str) -> bytes | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: Path) -> dict[str, str | None]:
    """HEAD and a hash of the tracked changes on top of it (untracked files do not count)."""
    head = _git(root, "rev-parse", "HEAD")
    if head is None:
        return {"git_head": None, "git_dirty_sha256": None}
    diff = _git(root, "diff", "HEAD", "--binary") or b""
    return {
        "git_head": head.decode().strip(),
        "git_dirty_sha256": hashlib.sha256(diff).hexdigest() if diff else None,
    }


def kernel_sources_sha256() -> str | None:
    """Hash of the shipped C++ sources, found without importing the kernels package."""
    import importlib.util

    spec = importlib.util.find_spec("dflash_kernels")
    if spec is None or not spec.submodule_search_locations:
        return None
    csrc = Path(next(iter(spec.submodule_search_locations))) / "csrc"
    digest = hashlib.sha256()
    for path in sorted(csrc.glob("*")) if csrc.is_dir() else []:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def collect(root: Path, sidecar: Path | None) -> dict[str, Any]:
    sidecar_sha = None
    if sidecar is not None and Path(sidecar).is_file():
        sidecar_sha = sha256_file(Path(sidecar))
    return {
        **git_state(root),
        "kernel_sources_sha256": kernel_sources_sha256(),
        "sidecar_sha256": sidecar_sha,
        "python": sys.version.split()[0],
        "torch": None,
        "cuda": None,
        "device": None,
        "engine": None,
        "libraries": [],
    }


def key(fingerprint: dict[str, Any]) -> dict[str, Any]:
    return {name: fingerprint.get(name) for name in KEY_FIELDS}


def short(fingerprint: dict[str, Any]) -> str:
    head = (fingerprint.get("git_head") or "no-git")[:10]
    dirty = "+dirty" if fingerprint.get("git_dirty_sha256") else ""
    digest = hashlib.sha256(repr(sorted(key(fingerprint).items())).encode()).hexdigest()[:12]
    return f"{head}{dirty} ({digest})"
