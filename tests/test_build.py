"""The bundled build: cache keyed by sources + torch + compiler + flags, safe under concurrent
builders, never in the source tree, clear errors when the compiler fails.

The concurrency test runs two real builders against one empty cache, on a source set of one
small file: the lock and the atomic rename are the build's own, the compile takes a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_dflash.native import build


def test_cached_library_is_reused_without_rebuilding():
    first = build.build_library("full")
    stamp = first.stat().st_mtime_ns
    again = build.build_library("full")
    assert again == first and again.stat().st_mtime_ns == stamp
    assert first.name == "libdflash_d256_full.so"
    assert build.csrc_dir() not in first.parents


def test_variants_have_distinct_keys():
    assert build.build_key("full")[0] != build.build_key("dense_only")[0]
    assert "-DDFLASH_DENSE_ONLY" in build.build_key("dense_only")[1]
    assert "-O3" in build.build_key("full")[1]
    assert not any(flag.startswith("-march") for flag in build.build_key("full")[1])


def test_key_changes_with_the_sources(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), src)
    monkeypatch.setattr(build, "csrc_dir", lambda: src)
    before = build.build_key("full")[0]
    with open(src / "attn_d256.cpp", "a") as fh:
        fh.write("\n// a changed source must never reuse a stale library\n")
    assert build.build_key("full")[0] != before


def test_unknown_variant_is_refused():
    with pytest.raises(build.BuildError, match="unknown variant 'fast'.*full, dense_only"):
        build.build_library("fast")


def test_cache_inside_the_sources_is_refused():
    with pytest.raises(build.BuildError, match="never go into the source tree"):
        build.build_library("full", cache_dir=build.csrc_dir() / "cache")


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "c"))
    assert build.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.default_cache_dir() == tmp_path / "xdg" / "pytest-dflash"


def test_a_test_with_a_home_of_its_own_keeps_the_runs_build_cache(pytester, monkeypatch):
    """pytester moves HOME into the test's tmp path. The gate sessions such a test starts, in
    process or as children, must still find the library in the run's one cache
    (tests/conftest.py pins XDG_CACHE_HOME), or each of them builds it again."""
    monkeypatch.delenv("DFLASH_CACHE_DIR", raising=False)  # the default location is tested
    assert Path.home() == pytester.path
    here = build.default_cache_dir()
    assert pytester.path not in here.parents, f"{here}: the cache moved with HOME"
    child = subprocess.run(
        [sys.executable, "-c",
         "from pytest_dflash.native import build; print(build.default_cache_dir())"],
        capture_output=True, text=True, check=True, timeout=60)
    assert Path(child.stdout.strip()) == here


def test_compiler_failure_is_a_clear_error_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    failed = r"building libdflash_d256_full.so failed \(exit 1\)"
    with pytest.raises(build.BuildError, match=failed):
        build.build_library("full", cache_dir=tmp_path)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(build.BuildError, match="cannot run.*set CXX"):
        build.build_library("full", cache_dir=tmp_path)


def test_main_build_prints_the_path(capsys):
    assert build.main_build(["--variant", "full"]) == 0
    assert Path(capsys.readouterr().out.strip()) == build.build_library("full")


TINY_SOURCE = """
extern "C" int dflash_tiny_build() { return 70; }
"""


def test_two_concurrent_builders_share_one_build(tmp_path):
    """Two processes building into one empty cache at once: both succeed, both print the same
    path, one library results (no temporary files left), and it loads. They build a source set
    of one small file with the build's real compiler, flags, lock and rename: what is shared is
    the build, not the kernels, whose full compile other tests pay once for the whole run."""
    src = tmp_path / "kernels" / "csrc"  # the cache must lie outside the sources' package
    src.mkdir(parents=True)
    (src / "tiny.cpp").write_text(TINY_SOURCE, encoding="utf-8")
    cache = tmp_path / "cache"
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-c",
           "import sys; from pathlib import Path; from pytest_dflash.native import build; "
           "build.csrc_dir = lambda: Path(sys.argv[1]); sys.exit(build.main_build([]))",
           str(src)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1, paths
    (path,) = paths
    assert Path(path).is_file() and Path(path).parent.parent == cache
    assert sorted(p.name for p in cache.rglob("*.so")) == [
        "libdflash_d256_dense_only.so", "libdflash_d256_full.so"]
    assert not list(cache.rglob("*.tmp"))
    probe = subprocess.run(
        [sys.executable, "-c", "import ctypes, sys, torch; torch.ops.load_library(sys.argv[1]); "
         "print(ctypes.CDLL(sys.argv[1]).dflash_tiny_build())", path],
        capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "70", probe.stdout


def test_every_cpp_source_in_csrc_goes_into_the_library(tmp_path, monkeypatch):
    """A new ``csrc/*.cpp`` (another engineer's kernels) is compiled in without a change to the
    build, and changes the key."""
    src = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), src)
    monkeypatch.setattr(build, "csrc_dir", lambda: src)
    before = build.build_key("full")[0]
    (src / "zz_extra.cpp").write_text("// another op family\n")
    key, cmd = build.build_key("full")
    assert str(src / "zz_extra.cpp") in cmd and str(src / "attn_d256.cpp") in cmd
    assert key != before


def test_cuda_targets_parse_and_map_to_gencode():
    assert build.parse_cuda_arch("compute_75, sm_90") == ("compute_75", "sm_90")
    assert build.parse_cuda_arch("7.0,sm_70") == ("sm_70",)
    plan = build.CudaPlan(True, "", targets=("sm_90", "compute_75"))
    assert plan.gencode() == ["-gencode=arch=compute_90,code=sm_90",
                              "-gencode=arch=compute_75,code=compute_75"]
    with pytest.raises(build.BuildError, match="'volta' is not a CUDA target.*sm_XY"):
        build.parse_cuda_arch("sm_70,volta")


def test_cuda_plan_says_why_no_cuda_code_is_built(monkeypatch):
    import torch

    monkeypatch.setenv(build.CUDA_ARCH_ENV, "none")
    plan = build.cuda_plan()
    assert not plan.enabled and "DFLASH_CUDA_ARCH=none" in plan.reason
    monkeypatch.delenv(build.CUDA_ARCH_ENV)
    plan = build.cuda_plan()
    if torch.version.cuda is None:
        assert not plan.enabled and "has no CUDA support" in plan.reason
        assert not any(part.startswith("-gencode") for part in build.build_key("full")[1])
    else:
        assert plan.enabled or "nvcc not found" in plan.reason or "no CUDA device" in plan.reason


def test_cuda_sources_get_torch_flags_only_when_they_include_torch(tmp_path):
    """A .cu including ATen directly or through a local header needs torch's include paths
    (the merged CUDA build once failed on qpn_gemm_cuda.cu without them); a plain one does not."""
    from pytest_dflash.native import build
    (tmp_path / "plain.cu").write_text('#include <cuda_fp16.h>\n#include "plain.h"\n')
    (tmp_path / "plain.h").write_text("#pragma once\n#include <cstdint>\n")
    (tmp_path / "common.h").write_text("#pragma once\n#include <ATen/ATen.h>\n")
    (tmp_path / "uses.cu").write_text('#include "common.h"\n')
    (tmp_path / "direct.cu").write_text("  #  include <c10/cuda/CUDAStream.h>\n")
    assert not build._includes_torch(tmp_path / "plain.cu")
    assert build._includes_torch(tmp_path / "uses.cu")
    assert build._includes_torch(tmp_path / "direct.cu")
    shipped = {src.name: build._includes_torch(src) for src in build.csrc_dir().glob("*.cu")}
    assert shipped == {"attn_d256_cuda.cu": False, "qpn_gemm_cuda.cu": True}


def test_concurrent_compiles_all_finish_and_the_failure_is_raised(tmp_path):
    """CUDA sources compile as parallel processes: a failing one is reported with its output,
    and only after the others have finished (no compiler is left writing into the cache)."""
    slow_ok = ["sh", "-c", f"sleep 0.3; touch {tmp_path / 'slow.o'}"]
    failing = ["sh", "-c", "echo 'error: bad kernel' >&2; exit 3"]
    lib = tmp_path / "lib.so"
    with pytest.raises(build.BuildError, match=r"(?s)exit 3.*error: bad kernel"):
        build._run_concurrently([(failing, lib), (slow_ok, lib)])
    assert (tmp_path / "slow.o").is_file()
    build._run_concurrently([(slow_ok, lib)])


def test_the_library_uses_the_shared_cpp_runtime():
    """The library must use the process's libstdc++.so.6, never a private static copy: built by
    the H200 image's own GCC it once linked libstdc++ in statically, and the copy's uninitialised
    locale crashed every error message holding a number (docs/cuda.md). Where pytest runs on a
    CUDA machine this checks the CUDA build."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils) to read the library's dynamic section")
    lib = build.build_library("full")
    dynamic = subprocess.run([readelf, "-d", "-W", str(lib)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    assert "[libstdc++.so.6]" in dynamic, dynamic
    symbols = subprocess.run([readelf, "--dyn-syms", "-W", str(lib)], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    defined = [line for line in symbols.splitlines()
               if "_ZNSo9_M_insertIlEERSoT_" in line and " UND " not in line]
    assert not defined, f"the library defines libstdc++'s ostream itself: {defined}"


def test_cuda_runtime_is_linked_by_path_not_through_the_toolkit_folders(tmp_path):
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcudart.so").write_bytes(b"")
    assert build._cudart(tmp_path) == str(tmp_path / "lib64" / "libcudart.so")
    other = tmp_path / "other" / "targets" / "x86_64-linux" / "lib"
    other.mkdir(parents=True)
    assert build._cudart(tmp_path / "other") == "-lcudart"  # the system's, if any
    (other / "libcudart.so").write_bytes(b"")
    assert build._cudart(tmp_path / "other") == str(other / "libcudart.so")
    plan = build.CudaPlan(True, "test", nvcc="nvcc", cuda_home=str(tmp_path), version="13.0")
    flags = build._torch_link_flags(plan)
    assert not [f for f in flags if f.startswith("-L") and str(tmp_path) in f], flags
    assert str(tmp_path / "lib64" / "libcudart.so") in flags and build.SHARED_CPP_RUNTIME in flags


def test_variants_built_together_compile_a_shared_object_once(tmp_path, monkeypatch):
    """The loader gate's two variants differ by one macro that one source names: built together
    they take three compiles, not four. Each compile is counted by a compiler wrapper (the real
    g++ behind it), on two small sources: one names the variant's macro, one does not."""
    src = tmp_path / "kernels" / "csrc"
    src.mkdir(parents=True)
    (src / "names.h").write_text("#pragma once\n#ifdef DFLASH_DENSE_ONLY\n"
                                 "#define DFLASH_TINY 1\n#else\n#define DFLASH_TINY 2\n#endif\n")
    (src / "a.cpp").write_text('#include "names.h"\n'
                               'extern "C" int dflash_tiny_a() { return DFLASH_TINY; }\n')
    (src / "b.cpp").write_text('extern "C" int dflash_tiny_b() { return 3; }\n')
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "$*" >> {log};; esac\n'
                       f'exec {shutil.which("g++") or shutil.which("c++")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(build, "csrc_dir", lambda: src)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv(build.CUDA_ARCH_ENV, "none")
    libs = build.build_libraries(("full", "dense_only"), cache_dir=tmp_path / "cache")
    compiles = log.read_text().splitlines()
    assert len(compiles) == 3, compiles
    assert sum("b.cpp" in line for line in compiles) == 1
    assert sorted("DFLASH_DENSE_ONLY" in line for line in compiles if "a.cpp" in line) == [
        False, True]
    import ctypes
    values = {name: ctypes.CDLL(str(path)).dflash_tiny_a() for name, path in libs.items()}
    assert values == {"full": 2, "dense_only": 1}
    assert not list((tmp_path / "cache").rglob("*.o")) and not list(
        (tmp_path / "cache").rglob("*.tmp"))
    # found in the cache: nothing is compiled again
    assert build.build_libraries(("dense_only", "full"), cache_dir=tmp_path / "cache") == libs
    assert build.build_library("dense_only", cache_dir=tmp_path / "cache") == libs["dense_only"]
    assert len(log.read_text().splitlines()) == 3
    # one variant asked for from nothing: the other is built beside it
    assert build.build_library("full", cache_dir=tmp_path / "fresh").is_file()
    assert build.library_path("dense_only", cache_dir=tmp_path / "fresh").is_file()
    assert len(log.read_text().splitlines()) == 6
