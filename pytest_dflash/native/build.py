"""Build the bundled native library (every source in ``kernels/csrc``) into a per-user cache.

Why a cache and not the source tree: an installed package's directory may be read-only or shared
by several environments, and a build artefact next to the sources is exactly what once shadowed
the installed operators. The cache key is the sha256 of the sources, the torch version and ABI,
the compilers and the flags, so a changed source or a torch upgrade never reuses a stale library.
Two processes that build at once (xdist workers, parallel CI jobs) serialise on a file lock and
the finished library appears by atomic rename, so nobody ever loads a half-written file.

Variants (:data:`VARIANTS`) differ by a macro or two. A variant's macro is passed only to the
sources that name it (themselves or through a header of csrc/), so a source that never names it
compiles to the same object in every variant; the missing variants are built together and each
distinct object is compiled once (the two variants take three C++ compiles, not four).

The result is a plain shared library that registers torch ops when loaded with
``torch.ops.load_library`` (not a Python extension module): g++ (and nvcc for CUDA sources) are
invoked directly with torch's include and library paths, which is quicker and has fewer moving
parts than setuptools.

Sources: every ``csrc/*.cpp`` goes into the library, so a new source file needs no change here.
Every ``csrc/*.cu`` is added when torch was built with CUDA and ``nvcc`` is found (see
:func:`cuda_plan`); the CUDA objects are linked into the same library, so the same op namespace
gets CPU and CUDA kernels from one file. On a CPU-only machine the library is the CPU part alone
and :func:`cuda_plan` says why, which the loader reports on a CUDA run (state *partial*).

``$DFLASH_CUDA_ARCH`` lists the CUDA targets, comma separated: ``sm_XY`` (machine code for that
GPU), ``compute_XY`` (PTX the driver compiles at load for XY and newer) or ``X.Y`` (= ``sm_XY``);
``none`` builds no CUDA code. Default: machine code for the GPU present plus PTX for the oldest
architecture the toolkit accepts (compute_70 before CUDA 13, compute_75 from CUDA 13 on), which
proves on every build that the kernels use nothing newer than a V100 (Volta) has, as the target
deployment needs. A V100 user with CUDA 12 builds ``sm_70`` by default.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

VARIANTS: dict[str, tuple[str, ...]] = {
    "full": (),
    # registers only the dense op: a deliberately partial library for the loader gate
    "dense_only": ("-DDFLASH_DENSE_ONLY",),
}
# Portable flags only: the library must run on any x86-64/aarch64 machine the wheel lands on.
# Vector speed comes from ATen's run-time dispatched kernels, not from -march.
CFLAGS: tuple[str, ...] = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-Wall")
LINK_FLAGS: tuple[str, ...] = ("-shared", "-fopenmp")
# nvcc: a plain-CUDA source behind a small launch interface (attn_d256_cuda.cu) needs no torch
# include paths; a source that includes ATen/c10/torch headers (qpn_gemm_cuda.cu, through
# qpn_common.h) gets them, with torch's own half/bfloat16 conventions and C++20 like the C++ part.
# --threads 0: the targets of one source (e.g. sm_90 and compute_75) compile in parallel.
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--threads", "0")
NVCC_TORCH_FLAGS: tuple[str, ...] = (
    "-std=c++20", "--expt-relaxed-constexpr",
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
)
_TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*<(?:ATen|c10|torch)/', re.MULTILINE)
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
LIBRARY_STEM = "libdflash_d256"
# The C++ runtime, named as the shared object, ahead of whatever g++ appends itself. The library
# must use the process's libstdc++: a GCC of its own (CXX=/opt/gcc/bin/g++, e.g.) linked
# libstdc++ in statically, so the library carried a private copy whose locale was
# never initialised, and formatting any error message that holds a number crashed the process
# (SIGSEGV in std::ostream::_M_insert<long>) instead of raising (docs/cuda.md). Named first, the
# shared object resolves every C++ runtime symbol and no archive member is pulled in.
SHARED_CPP_RUNTIME = "-l:libstdc++.so.6"
CUDA_ARCH_ENV = "DFLASH_CUDA_ARCH"
_ARCH_TOKEN = re.compile(r"^(?:(sm|compute)_(\d{2,3})|(\d+)\.(\d))$")


class BuildError(RuntimeError):
    """The native library could not be built; the message carries the compiler's output."""


@dataclass(frozen=True)
class CudaPlan:
    """Whether the CUDA sources are compiled, why not if not, and for which targets."""

    enabled: bool
    reason: str  # why CUDA code is (not) built: shown by the loader on a CUDA run
    nvcc: str | None = None
    cuda_home: str | None = None
    version: str | None = None  # nvcc's release line
    targets: tuple[str, ...] = ()  # e.g. ("sm_90", "compute_75")

    def gencode(self) -> list[str]:
        flags = []
        for target in self.targets:
            kind, num = target.split("_")
            code = f"sm_{num}" if kind == "sm" else f"compute_{num}"
            flags.append(f"-gencode=arch=compute_{num},code={code}")
        return flags


@dataclass(frozen=True)
class BuildPlan:
    """Everything one build runs: one compiler process per source (g++ for C++, nvcc for
    CUDA), all at once, then one link of their objects."""

    variant: str
    key: str
    cxx_cmds: list[tuple[Path, list[str]]]  # (C++ source, its compile command minus -o)
    link_cmd: list[str]  # the objects follow it, then link_flags
    link_flags: list[str]  # after the objects, so --as-needed keeps every library they use
    cuda: CudaPlan
    nvcc_cmds: list[tuple[Path, list[str]]] = field(default_factory=list)  # (source, cmd - -o)

    def compiles(self) -> list[tuple[Path, list[str]]]:
        """Every compile of the build, CUDA first (the slowest), each independent of the rest."""
        return [*self.nvcc_cmds, *self.cxx_cmds]


def csrc_dir() -> Path:
    """The C++/CUDA sources shipped with the ``dflash_kernels`` package (a namespace package:
    no ``__init__.py``, so the checkout's ``kernels/`` folder never shadows another ``kernels``
    package, e.g. the Hub's that transformers imports)."""
    import dflash_kernels

    return Path(next(iter(dflash_kernels.__path__))).resolve() / "csrc"


def cpp_sources() -> list[Path]:
    """Every ``csrc/*.cpp``, sorted: all of them go into the one library."""
    return sorted(csrc_dir().glob("*.cpp"))


def cuda_sources() -> list[Path]:
    """Every ``csrc/*.cu``, sorted: compiled in when :func:`cuda_plan` is enabled."""
    return sorted(csrc_dir().glob("*.cu"))


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


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _nvcc_release(nvcc: str) -> tuple[str, tuple[int, int]]:
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise BuildError(f"nvcc {nvcc!r} cannot run: {exc}; set CUDA_HOME to a working "
                         f"toolkit or {CUDA_ARCH_ENV}=none for a CPU-only build") from None
    match = re.search(r"release (\d+)\.(\d+)", done.stdout)
    if done.returncode != 0 or not match:
        raise BuildError(f"nvcc {nvcc!r} printed no release number: {done.stdout[-300:]!r}")
    line = next(ln for ln in done.stdout.splitlines() if "release" in ln)
    return line.strip(), (int(match.group(1)), int(match.group(2)))


def parse_cuda_arch(spec: str) -> tuple[str, ...]:
    """``"compute_75, sm_90"`` / ``"7.0"`` -> ``("compute_75", "sm_90")`` / ``("sm_70",)``."""
    targets = []
    for token in (t.strip() for t in spec.split(",")):
        match = _ARCH_TOKEN.match(token)
        if not match:
            raise BuildError(
                f"{CUDA_ARCH_ENV}={spec!r}: {token!r} is not a CUDA target; write sm_XY, "
                "compute_XY or X.Y, comma separated (e.g. 'compute_75,sm_90'), or 'none'"
            )
        if match.group(1):
            targets.append(f"{match.group(1)}_{match.group(2)}")
        else:
            targets.append(f"sm_{match.group(3)}{match.group(4)}")
    return tuple(dict.fromkeys(targets))


def cuda_plan() -> CudaPlan:
    """Decide whether the ``.cu`` sources are compiled, and for which targets, with the reason.

    CUDA code is built when there are CUDA sources, torch was built with CUDA, nvcc is found
    (``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``PATH``, ``/usr/local/cuda/bin``) and a target is
    known (``$DFLASH_CUDA_ARCH``, else the GPU present).
    """
    import torch

    spec = os.environ.get(CUDA_ARCH_ENV, "").strip()
    if spec.lower() == "none":
        return CudaPlan(False, f"CUDA code not built: {CUDA_ARCH_ENV}=none")
    if torch.version.cuda is None:
        return CudaPlan(False, f"CUDA code not built: torch {torch.__version__} has no CUDA "
                        "support (install a CUDA build of torch)")
    if not cuda_sources():
        return CudaPlan(False, "the package ships no CUDA sources")
    nvcc = _find_nvcc()
    if nvcc is None:
        return CudaPlan(False, "CUDA code not built: nvcc not found (looked in $CUDA_HOME/bin, "
                        "$CUDA_PATH/bin, PATH, /usr/local/cuda/bin); install the CUDA toolkit "
                        f"matching torch's CUDA {torch.version.cuda} or set CUDA_HOME")
    version, (major, _) = _nvcc_release(nvcc)
    if spec:
        targets = parse_cuda_arch(spec)
    elif torch.cuda.is_available():
        cc_major, cc_minor = torch.cuda.get_device_capability()
        oldest = "compute_75" if major >= 13 else "compute_70"
        targets = tuple(dict.fromkeys((f"sm_{cc_major}{cc_minor}", oldest)))
    else:
        return CudaPlan(False, f"CUDA code not built: no CUDA device visible and "
                        f"{CUDA_ARCH_ENV} unset (set it, e.g. 'sm_70', to build without a GPU)",
                        nvcc=nvcc, version=version)
    home = str(Path(nvcc).resolve().parent.parent)
    return CudaPlan(True, f"CUDA code built with {version} for {', '.join(targets)}",
                    nvcc=nvcc, cuda_home=home, version=version, targets=targets)


def _torch_flags() -> list[str]:
    import torch
    from torch.utils import cpp_extension

    flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    return flags


def _source_text(src: Path) -> str:
    """A source with every header of its own folder it includes, recursively: what decides
    whether it uses torch headers or names a variant's macro."""
    texts, pending, seen = [], [src], set()
    while pending:
        path = pending.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        text = path.read_text(errors="replace")
        texts.append(text)
        pending.extend(path.parent / name for name in _LOCAL_INCLUDE.findall(text))
    return "\n".join(texts)


def _includes_torch(src: Path) -> bool:
    """Whether a CUDA source includes a torch header, itself or through a header of csrc/."""
    return bool(_TORCH_INCLUDE.search(_source_text(src)))


def _variant_defines(src: Path, variant: str) -> list[str]:
    """The variant's ``-D`` flags that ``src`` names (itself or through a header of csrc/): a
    macro a source never names cannot change its object, and leaving it out lets the variants
    share that object."""
    text = _source_text(src)
    return [flag for flag in VARIANTS[variant]
            if re.search(rf"\b{re.escape(flag[2:].split('=')[0])}\b", text)]


def _nvcc_torch_flags() -> list[str]:
    """nvcc flags of a CUDA source that uses torch headers (a later -std wins over NVCC_FLAGS')."""
    return [*NVCC_TORCH_FLAGS, *_torch_flags()]


def _torch_link_flags(cuda: CudaPlan) -> list[str]:
    import torch

    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    flags = [f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch", SHARED_CPP_RUNTIME]
    if cuda.enabled:
        flags += ["-lc10_cuda", "-ltorch_cuda", _cudart(Path(cuda.cuda_home or ""))]
    return [*flags, f"-Wl,-rpath,{lib_dir}"]


def _cudart(home: Path) -> str:
    """The toolkit's ``libcudart.so`` by path (``-lcudart`` if the toolkit has none), so no
    toolkit folder joins the linker's search path, where g++ also looks for the runtimes it adds
    itself. The library records the SONAME (``libcudart.so.13``): at run time it is the runtime
    torch already loaded."""
    for folder in (home / "lib64", home / "lib", *sorted((home / "targets").glob("*/lib"))):
        if (folder / "libcudart.so").is_file():
            return str(folder / "libcudart.so")
    return "-lcudart"


def _check_outside_sources(cache_dir: Path) -> None:
    """Refuse a cache inside the package sources: that is how a stale build shadows the real one."""
    resolved = cache_dir.resolve()
    for root in (csrc_dir().parent, Path(__file__).resolve().parents[1]):
        if resolved == root or root in resolved.parents:
            raise BuildError(
                f"cache directory {cache_dir} lies inside the package sources ({root}); "
                "builds never go into the source tree: set DFLASH_CACHE_DIR elsewhere"
            )


def build_plan(variant: str = "full") -> BuildPlan:
    """The commands of one build and its cache key (sources, torch, compilers, flags)."""
    import torch

    if variant not in VARIANTS:
        raise BuildError(f"unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}")
    cxx = _compiler()
    sources = cpp_sources()
    if not sources:
        raise BuildError(f"no C++ sources in {csrc_dir()}: the dflash_kernels install is broken")
    cuda = cuda_plan()
    cu_sources = cuda_sources() if cuda.enabled else []
    defines = ["-DDFLASH_WITH_CUDA"] if cuda.enabled else []
    cuda_include = [f"-I{Path(str(cuda.cuda_home)) / 'include'}"] if cuda.enabled else []
    cxx_flags = [*CFLAGS, *defines, *_torch_flags(), *cuda_include]
    cxx_cmds = [(src, [cxx, *cxx_flags, *_variant_defines(src, variant), "-c", str(src)])
                for src in sources]
    link_cmd = [cxx, *LINK_FLAGS]
    link_flags = _torch_link_flags(cuda)
    nvcc_cmds = [
        (src, [str(cuda.nvcc), *NVCC_FLAGS, "-ccbin", cxx, *cuda.gencode(), *defines,
               *_variant_defines(src, variant),
               *(_nvcc_torch_flags() if _includes_torch(src) else []), "-c", str(src)])
        for src in cu_sources
    ]
    digest = hashlib.sha256(variant.encode() + b"\0")
    for src in [*sources, *cu_sources, *sorted(csrc_dir().glob("*.h")),
                *sorted(csrc_dir().glob("*.cuh"))]:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    digest.update(torch.__version__.encode() + b"\0")
    digest.update(_compiler_version(cxx).encode() + b"\0")
    digest.update("\0".join([*LINK_FLAGS, *link_flags]).encode())
    if cuda.enabled:
        digest.update(b"\0cuda\0" + str(cuda.version).encode())
    for _, cmd in [*cxx_cmds, *nvcc_cmds]:
        digest.update(b"\0" + "\0".join(cmd[1:]).encode())
    return BuildPlan(variant, digest.hexdigest(), cxx_cmds, link_cmd, link_flags, cuda,
                     nvcc_cmds)


def build_key(variant: str = "full") -> tuple[str, list[str]]:
    """The cache key (hex sha256) and every command of the build, flattened: each compile
    minus its output path, then the link minus its objects and output path."""
    plan = build_plan(variant)
    return plan.key, [*(arg for _, cmd in plan.compiles() for arg in cmd), *plan.link_cmd,
                      *plan.link_flags]


def library_path(variant: str = "full", cache_dir: Path | None = None) -> Path:
    """Where the library of this key lives (it may not be built yet)."""
    key, _ = build_key(variant)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / key[:24] / f"{LIBRARY_STEM}_{variant}.so"


def _run(cmd: list[str], target: Path) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"building {target.name} failed: {cmd[0]} cannot run: {exc}") from None
    if done.returncode != 0:
        raise BuildError(
            f"building {target.name} failed (exit {done.returncode}):\n"
            f"$ {' '.join(cmd)}\n{(done.stderr or done.stdout)[-4000:]}"
        )


def _run_concurrently(cmds: list[tuple[list[str], Path]]) -> None:
    """Run independent compiles at once, each with the library it is for (each object is its
    own compiler process: a build takes as long as its slowest source where there are cores for
    all, not their sum); the first failure is raised once all have finished."""
    if len(cmds) <= 1:
        for cmd, target in cmds:
            _run(cmd, target)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(cmds)) as pool:
        futures = [pool.submit(_run, cmd, target) for cmd, target in cmds]
    for future in futures:
        future.result()


def build_library(variant: str = "full", cache_dir: Path | None = None) -> Path:
    """Return the cached library for ``variant``, compiling it first if needed.

    A missing variant is built with every other missing one (:func:`build_libraries`): one more
    C++ compile beside the others, and the loader gate's partial library is ready when a run
    needs it. From nothing on two cores the C++ sources take about 14 s; with CUDA sources
    about a minute.
    """
    if variant not in VARIANTS:
        raise BuildError(f"unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}")
    return build_libraries((variant, *VARIANTS), cache_dir)[variant]


def build_libraries(variants: Sequence[str], cache_dir: Path | None = None) -> dict[str, Path]:
    """Return the cached library of each variant, building the missing ones together: every
    distinct object is compiled once, all compiles at once, then each library is linked.

    Safe against concurrent builders: the first takes the locks (in path order, so two builders
    of overlapping variant sets cannot deadlock) and links into temporary files in the target
    directories, then renames them into place; the others wait on the locks and find the
    finished files.
    """
    from filelock import FileLock

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _check_outside_sources(root)
    plans = {variant: build_plan(variant) for variant in dict.fromkeys(variants)}
    targets = {variant: root / plan.key[:24] / f"{LIBRARY_STEM}_{variant}.so"
               for variant, plan in plans.items()}
    missing = sorted((v for v in plans if not targets[v].is_file()), key=lambda v: targets[v])
    if not missing:
        return targets
    with ExitStack() as locks:
        for variant in missing:
            targets[variant].parent.mkdir(parents=True, exist_ok=True)
            locks.enter_context(FileLock(str(targets[variant]) + ".lock", timeout=900))
        # built by another process while we waited; the rest in the order asked (a failed
        # compile names the first library that needs it)
        missing = [v for v in plans if v in missing and not targets[v].is_file()]
        if missing:
            _compile_and_link([(plans[v], targets[v]) for v in missing])
    return targets


def _compile_and_link(builds: list[tuple[BuildPlan, Path]]) -> None:
    """Compile the distinct objects of ``builds`` at once, then link and rename each library."""
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=builds[0][1].parent) as folder:
        objects: dict[tuple[str, ...], Path] = {}
        compiles: list[tuple[list[str], Path]] = []
        for plan, target in builds:
            for src, cmd in plan.compiles():
                if tuple(cmd) not in objects:
                    objects[tuple(cmd)] = Path(folder, f"{len(objects)}.{src.name}.o")
                    compiles.append(([*cmd, "-o", str(objects[tuple(cmd)])], target))
        _run_concurrently(compiles)
        for plan, target in builds:
            fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp",
                                            dir=target.parent)
            os.close(fd)
            tmp = Path(tmp_name)
            try:
                _run([*plan.link_cmd, *(str(objects[tuple(cmd)]) for _, cmd in plan.compiles()),
                      *plan.link_flags, "-o", str(tmp)], target)
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)


def bundled_library_path(cache_dir: Path | None = None) -> Path:
    """The package's own full build of ``kernels/csrc`` (built on first use)."""
    return build_library("full", cache_dir)


def main_build(argv: list[str] | None = None) -> int:
    """``pytest-dflash build``: compile ahead of time (e.g. in a Docker layer), print the path."""
    parser = argparse.ArgumentParser(
        prog="pytest-dflash build",
        description="Build the bundled native library (kernels/csrc) into the per-user cache.",
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="full")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache directory (default: $DFLASH_CACHE_DIR or "
                        "~/.cache/pytest-dflash)")
    args = parser.parse_args(argv)
    try:
        path = build_library(args.variant, args.cache_dir)
        plan = cuda_plan()
    except BuildError as exc:
        print(f"pytest-dflash build: {exc}", file=sys.stderr)
        return 1
    print(plan.reason, file=sys.stderr)
    print(path)
    return 0
