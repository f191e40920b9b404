"""Build the bundled native attention library (``kernels/csrc``) into a per-user cache.

Why a cache and not the source tree: an installed package's directory may be read-only or shared
by several environments, and a build artefact next to the sources is exactly what once shadowed
the installed operators. The cache key is the sha256 of the sources, the torch version and ABI,
the compiler and the flags, so a changed source or a torch upgrade never reuses a stale library.
Two processes that build at once (xdist workers, parallel CI jobs) serialise on a file lock and
the finished library appears by atomic rename, so nobody ever loads a half-written file.

The result is a plain shared library that registers torch ops when loaded with
``torch.ops.load_library`` (not a Python extension module): g++ is invoked directly with torch's
include and library paths, which is quicker and has fewer moving parts than setuptools.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS: dict[str, tuple[str, ...]] = {
    "full": (),
    # registers only the dense op: a deliberately partial library for the loader gate
    "dense_only": ("-DDFLASH_DENSE_ONLY",),
}
SOURCES: tuple[str, ...] = ("attn_d256.cpp",)
# Portable flags only: the library must run on any x86-64/aarch64 machine the wheel lands on.
# Vector speed comes from ATen's run-time dispatched kernels, not from -march.
CFLAGS: tuple[str, ...] = ("-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-Wall")
LIBRARY_STEM = "libdflash_d256"


class BuildError(RuntimeError):
    """The native library could not be built; the message carries the compiler's output."""


def csrc_dir() -> Path:
    """The C++ sources shipped with the ``dflash_kernels`` package."""
    import dflash_kernels

    return Path(dflash_kernels.__file__).resolve().parent / "csrc"


def default_cache_dir() -> Path:
    """``$DFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-dflash`` (~/.cache/pytest-dflash)."""
    env = os.environ.get("DFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pytest-dflash"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError(
            "no C++ compiler found (looked for $CXX, g++, c++); install g++ or set CXX to build "
            "the bundled D256 attention library"
        )
    return cxx


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise BuildError(
            f"C++ compiler {cxx!r} cannot run: {exc}; set CXX to a working g++"
        ) from None
    return done.stdout.splitlines()[0] if done.stdout else cxx


def _torch_flags() -> list[str]:
    import torch
    from torch.utils import cpp_extension

    flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    flags += [f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib_dir}"]
    return flags


def _check_outside_sources(cache_dir: Path) -> None:
    """Refuse a cache inside the package sources: that is how a stale build shadows the real one."""
    resolved = cache_dir.resolve()
    for root in (csrc_dir().parent, Path(__file__).resolve().parent):
        if resolved == root or root in resolved.parents:
            raise BuildError(
                f"cache directory {cache_dir} lies inside the package sources ({root}); "
                "builds never go into the source tree: set DFLASH_CACHE_DIR elsewhere"
            )


def build_key(variant: str = "full") -> tuple[str, list[str]]:
    """The cache key (hex sha256) and the full compiler command line minus its output path."""
    import torch

    if variant not in VARIANTS:
        raise BuildError(f"unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}")
    cxx = _compiler()
    sources = [csrc_dir() / name for name in SOURCES]
    for src in sources:
        if not src.is_file():
            raise BuildError(f"C++ source {src} is missing: the dflash_kernels install is broken")
    cmd = [cxx, *CFLAGS, *VARIANTS[variant], *map(str, sources), *_torch_flags()]
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    digest.update(torch.__version__.encode() + b"\0")
    digest.update(_compiler_version(cxx).encode() + b"\0")
    digest.update("\0".join(cmd[1:]).encode())
    return digest.hexdigest(), cmd


def library_path(variant: str = "full", cache_dir: Path | None = None) -> Path:
    """Where the library of this key lives (it may not be built yet)."""
    key, _ = build_key(variant)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / key[:24] / f"{LIBRARY_STEM}_{variant}.so"


def build_library(variant: str = "full", cache_dir: Path | None = None) -> Path:
    """Return the cached library for ``variant``, compiling it first if needed (~15 s).

    Safe against concurrent builders: the first takes the lock and compiles into a temporary
    file in the same directory, then renames it into place; the others wait on the lock and find
    the finished file.
    """
    from filelock import FileLock

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _check_outside_sources(root)
    key, cmd = build_key(variant)
    target = root / key[:24] / f"{LIBRARY_STEM}_{variant}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=600):
        if target.is_file():  # built by another process while we waited
            return target
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            done = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildError(
                    f"building {target.name} failed (exit {done.returncode}):\n"
                    f"$ {' '.join(cmd)} -o {tmp}\n{done.stderr[-4000:]}"
                )
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def bundled_library_path(cache_dir: Path | None = None) -> Path:
    """The package's own full build of ``kernels/csrc`` (built on first use)."""
    return build_library("full", cache_dir)


def main_build(argv: list[str] | None = None) -> int:
    """``pytest-dflash build``: compile ahead of time (e.g. in a Docker layer), print the path."""
    parser = argparse.ArgumentParser(
        prog="pytest-dflash build",
        description="Build the bundled D256 attention library into the per-user cache.",
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="full")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache directory (default: $DFLASH_CACHE_DIR or "
                        "~/.cache/pytest-dflash)")
    args = parser.parse_args(argv)
    try:
        path = build_library(args.variant, args.cache_dir)
    except BuildError as exc:
        print(f"pytest-dflash build: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
