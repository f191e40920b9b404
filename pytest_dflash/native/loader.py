"""The one loader of the native D256 attention ops, and the status record it returns.

Why it exists (docs/families.md, "Loader states"): the failure this project was born from is a
native op library that silently did not load, so everything fell back and nothing failed. The
loader makes every outcome explicit:

* ``bundled``: the package's own build of ``kernels/csrc`` (compiled on first use into the cache,
  see :mod:`pytest_dflash.native.build`) provides every required op, verified.
* ``sidecar``: an explicitly chosen library file (``--dflash-sidecar`` or ``$DFLASH_D256_LIBRARY``)
  provides them; it is loaded only when the bundled build does not, and never searched for.
* ``partial``: some required op is missing or fails its check: the route is not selected, the
  fallback stays, and a :class:`DflashFallbackWarning` names the missing ops.
* ``missing``: no usable library: fallback, one :class:`DflashFallbackWarning`.

An op counts as *verified* only if the dispatcher has a kernel for the device AND a tiny call
on that device matches an fp64 reference (on CUDA in fp32 and fp16, the kernels' two paths).
The status is therefore per device: a library with CPU kernels only is *bundled* on a CPU run
and *partial* on a CUDA run, with the reason the build gives (no nvcc, torch without CUDA, no
target for the GPU), so a loader gate never passes on a device where the ops do not run.

A torch op namespace can be registered by only one library: loading a second library that
registers ``dflash_d256`` aborts the process (SIGABRT, not catchable). So before any load the
loader checks which library already owns the namespace, and a library it did not build itself
(a sidecar) is first loaded in a child process, so a crashing, corrupt or clashing file
costs a child process and an error message, never the session.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    """The SHA-256 of a library file, as the evidence fingerprint records it."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


NAMESPACE = "dflash_d256"
REQUIRED_OPS: tuple[str, ...] = ("dense", "paged")
OPTIONAL_OPS: tuple[str, ...] = ("dense_splitkv",)
SIDECAR_ENV = "DFLASH_D256_LIBRARY"  # the explicit sidecar library, also for child processes
STATES: tuple[str, ...] = ("bundled", "sidecar", "partial", "missing")
PROBE_TIMEOUT_S = 300.0
# the package's own build, compiled on first use
BUNDLED = "bundled"


class DflashFallbackWarning(UserWarning):
    """The native D256 ops are not (all) usable here: the SDPA fallback serves attention."""


class LoaderError(RuntimeError):
    """A library file that was refused or failed to load; the message says why and what to do."""


@dataclass
class LoaderStatus:
    """What the loader found, as evidence: which file (path, realpath, sha256) serves which op.

    ``ops`` / ``optional_ops`` map op name -> ``{"present", "verified", "error"}``. ``attempts``
    lists every library the loader considered, in order, with its outcome.
    """

    state: str
    device: str
    path: str | None = None
    realpath: str | None = None
    sha256: str | None = None
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    optional_ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every required op is real: the native route may be selected."""
        return self.state in ("bundled", "sidecar")

    def missing_ops(self) -> list[str]:
        return [name for name, op in self.ops.items() if not op["verified"]]

    def summary(self) -> str:
        """One line for messages: state, file and what is wrong."""
        where = ""
        if self.path and self.sha256:
            where = f" from {self.path} (sha256 {self.sha256[:12]})"
        text = f"{NAMESPACE} ops {self.state}{where} on {self.device}"
        missing = self.missing_ops()
        if missing:
            text += f"; missing or failing: {', '.join(missing)}"
        if self.error:
            text += f"; {self.error}"
        return text

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Loaded:
    path: str
    realpath: str
    sha256: str
    source: str  # "bundled" | "sidecar"


# Per-process state: libraries this loader loaded, which of them owns the namespace, and the
# status computed for each argument combination (loading twice is a no-op).
_LOADED: dict[str, _Loaded] = {}
_OWNER: str | None = None  # realpath of the library that registered NAMESPACE
_STATUS: dict[tuple[str, str | None, str], LoaderStatus] = {}
_CURRENT: dict[str, LoaderStatus] = {}  # device -> status of the latest load_d256 call


def loaded_libraries() -> list[dict[str, str]]:
    """Every native library this loader loaded into the process (for the evidence fingerprint)."""
    return [asdict(lib) for lib in _LOADED.values()]


def namespace_ops() -> list[str]:
    """Names of the ops registered under ``dflash_d256`` in this process, by anyone."""
    import torch

    prefix = NAMESPACE + "::"
    return sorted(
        name[len(prefix):].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(prefix)
    )


def _dispatch_key(device: str) -> str:
    import torch

    dev = torch.device(device)
    return {"cpu": "CPU", "cuda": "CUDA"}.get(dev.type, dev.type.upper())


# ------------------------------------------------------------------------------ loading

_PROBE = r"""
import json, sys
import torch
for lib in json.loads(sys.argv[1]):
    torch.ops.load_library(lib)
torch.ops.load_library(sys.argv[2])
prefix = sys.argv[3] + "::"
print(json.dumps(sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith(prefix))))
"""


def probe_library(path: Path) -> list[str]:
    """Load ``path`` in a child process (after the libraries this process already loaded) and
    return the ``dflash_d256`` ops it registers; raise LoaderError if the child fails or dies.

    Why a child: a corrupt file fails cleanly, but a library whose static initialisers clash with
    an already registered namespace terminates the whole process, and that cannot be caught.
    Without a CUDA context the child is a fork of this process (milliseconds: it has torch and
    every loaded library already); with one, a fresh interpreter that imports torch and loads
    them again (seconds), since a forked child cannot use its parent's CUDA context.
    """
    import torch

    try:
        if torch.cuda.is_initialized():
            already = sorted(torch.ops.loaded_libraries)
            done = subprocess.run(
                [sys.executable, "-c", _PROBE, json.dumps(already), str(path), NAMESPACE],
                capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
            )
            returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
        else:
            returncode, stdout, stderr = _probe_in_fork(path, PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LoaderError(
            f"probe load of {path} did not finish in {PROBE_TIMEOUT_S:.0f} s; refusing to load it"
        ) from None
    if returncode != 0:
        last = _last_error_line(stderr)
        if returncode < 0:
            sig = signal.Signals(-returncode).name
            raise LoaderError(
                f"probe load of {path} was killed by {sig} ({last}); loading it here would abort "
                "this process, so it is refused: rebuild the library against this torch or drop it"
            )
        raise LoaderError(
            f"{path} is not a loadable op library ({last}); pass a shared library built for "
            f"this torch {torch.__version__}, or none to use the bundled build"
        )
    try:
        return list(json.loads(stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise LoaderError(
            f"probe load of {path} printed no op list: {stdout[-300:]!r}"
        ) from None


def _probe_in_fork(path: Path, timeout_s: float) -> tuple[int, str, str]:
    """``(exit status as subprocess gives it, stdout, stderr)`` of loading ``path`` in a fork.

    The child loads the library, writes the namespace's ops to a file and leaves with
    ``os._exit`` (never through this process's exit handlers or buffered output); its stderr
    goes to a file too, so an initialiser's abort message names the clash as a fresh
    interpreter's would."""
    import tempfile
    import time

    import torch

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with warnings.catch_warnings():  # Python 3.12 warns on a fork beside torch's idle thread
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.dup2(err.fileno(), 2)
                torch.ops.load_library(str(path))
                prefix = NAMESPACE + "::"
                os.write(out.fileno(), json.dumps(sorted(
                    n[len(prefix):] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(prefix))).encode())
                code = 0
            except BaseException as exc:  # noqa: BLE001 - the message is the child's answer
                os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))
            finally:
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        while True:
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(f"probe load of {path}", timeout_s)
            time.sleep(0.002)
        out.seek(0)
        err.seek(0)
        return (os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"),
                err.read().decode(errors="replace"))


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "what():" in line or "error" in line:
            return line[:400]
    return lines[-1][:400] if lines else "no output"


def _load(path: Path, source: str, *, probe: bool) -> _Loaded:
    """Load one library into this process unless that would clash; raise LoaderError if not."""
    global _OWNER
    import torch

    if not path.exists():
        raise LoaderError(f"{source} library {path} does not exist")
    if not path.is_file():
        raise LoaderError(f"{source} library {path} is not a file")
    real = str(path.resolve())
    if real in _LOADED:
        return _LOADED[real]
    present = namespace_ops()
    if present and real in {os.path.realpath(p) for p in torch.ops.loaded_libraries}:
        # this very file was loaded with torch.ops.load_library before: adopt it, no reload
        lib = _Loaded(str(path), real, file_sha256(path), source)
        _LOADED[real] = lib
        _OWNER = real
        return lib
    if present:
        owner = _OWNER or "a library this loader did not load"
        raise LoaderError(
            f"refusing to load {source} library {path}: the op namespace {NAMESPACE} is already "
            f"registered (ops {', '.join(present)}) by {owner}, and a second library registering "
            "it would abort the process (SIGABRT); use one library per process"
        )
    sha = file_sha256(path)
    if probe:
        registered = probe_library(path)
        if not registered:
            raise LoaderError(
                f"{source} library {path} loads but registers no {NAMESPACE} ops; it is not a "
                "D256 attention library"
            )
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        raise LoaderError(f"{source} library {path} failed to load: {exc}") from None
    lib = _Loaded(str(path), real, sha, source)
    _LOADED[real] = lib
    if namespace_ops():
        _OWNER = real
    return lib


# ------------------------------------------------------------------------------ verification

def _verify(op: str, device: str) -> dict[str, Any]:
    """present / verified / error of one op on ``device``: dispatcher kernel + tiny oracle check."""
    import torch

    qualified = f"{NAMESPACE}::{op}"
    if op not in namespace_ops():
        return {"present": False, "verified": False, "error": f"{qualified} is not registered"}
    key = _dispatch_key(device)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
        return {"present": True, "verified": False,
                "error": f"{qualified} has no kernel for dispatch key {key} (device {device})"
                         f"{_no_kernel_reason(key)}"}
    dtypes = _CHECK_DTYPES.get(torch.device(device).type, _CHECK_DTYPES["cpu"])
    for dtype, tolerance in dtypes:
        try:
            # the check is the same whatever mode the first caller is in: an engine first calls
            # a route's op inside inference mode, whose tensors the check must not mix with its own
            with torch.inference_mode(False):
                err = _tiny_call_error(op, torch.device(device), dtype)
        except Exception as exc:  # noqa: BLE001 - any failure of the op means "not verified"
            return {"present": True, "verified": False,
                    "error": f"{qualified} failed its {dtype} check call on {device}: "
                             f"{type(exc).__name__}: {exc}"}
        if not err <= tolerance:  # also catches NaN
            return {"present": True, "verified": False,
                    "error": f"{qualified} disagrees with the fp64 reference on {device} in "
                             f"{dtype}: max abs error {err:.3g} > {tolerance:g}"}
    return {"present": True, "verified": True, "error": None}


# (dtype, max abs error against fp64) per device type. The CUDA kernels have separate fp16
# (tensor core) and fp32 (SIMT) paths, so both are called; on the CPU both dtypes share one path.
_CHECK_DTYPES: dict[str, tuple[tuple[str, float], ...]] = {
    "cpu": (("float32", 1e-4),),
    "cuda": (("float32", 1e-4), ("float16", 5e-3)),
}


def _no_kernel_reason(key: str) -> str:
    """Why a library the loader built itself has no CUDA kernels (no nvcc, CPU torch, ...)."""
    if key != "CUDA" or _OWNER is None or _LOADED[_OWNER].source != "bundled":
        return ""
    try:
        from pytest_dflash.native import build
        return f": the bundled build has no CUDA code ({build.cuda_plan().reason})"
    except Exception as exc:  # noqa: BLE001 - the reason is a courtesy, never a crash
        return f": the bundled build has no CUDA code (reason unknown: {exc})"


def _tiny_call_error(op: str, device: Any, dtype: str = "float32") -> float:
    """Max abs error of one small GQA causal call (Tq < Tk, odd sizes) against fp64 math on
    the same (``dtype``-rounded) inputs."""
    import torch

    from dflash_kernels.attention import reference_attention

    gen = torch.Generator().manual_seed(20261129)
    tq, tk, hq, hkv, d, scale = 5, 11, 4, 2, 256, 0.0625
    dt = getattr(torch, dtype)
    q = torch.randn(tq, hq, d, generator=gen).to(dt)
    k = torch.randn(tk, hkv, d, generator=gen).to(dt)
    v = torch.randn(tk, hkv, d, generator=gen).to(dt)
    expected = reference_attention(q, k, v, scale, True)
    out = torch.full((tq, hq, d), float("nan"), device=device, dtype=dt)
    ops = getattr(torch.ops, NAMESPACE)
    if op == "dense":
        ops.dense(q.to(device), k.to(device), v.to(device), out, scale, True)
    elif op == "dense_splitkv":
        ops.dense_splitkv(q.to(device), k.to(device), v.to(device), out, scale, True, 2)
    elif op == "paged":
        block_size, table = 4, [3, 0, 4]  # scattered blocks, last one partly used
        k_cache = torch.randn(5, block_size, hkv, d, generator=gen).to(dt)
        v_cache = torch.randn(5, block_size, hkv, d, generator=gen).to(dt)
        for i, block in enumerate(table):
            n = min(block_size, tk - i * block_size)
            k_cache[block, :n] = k[i * block_size : i * block_size + n]
            v_cache[block, :n] = v[i * block_size : i * block_size + n]
        bt = torch.tensor(table, dtype=torch.int32, device=device)
        ops.paged(q.to(device), k_cache.to(device), v_cache.to(device), bt, tk, out, scale, True)
    else:
        raise LoaderError(f"no check call defined for op {op!r}")
    return float((out.cpu().double() - expected).abs().max())


# ------------------------------------------------------------------------------ the loader

def _sidecar_from(sidecar: Path | str | None) -> Path | None:
    if sidecar is not None:
        return Path(sidecar).expanduser()
    env = os.environ.get(SIDECAR_ENV)
    return Path(env).expanduser() if env else None


def _bundled_path(bundled: Path | str) -> Path:
    if bundled == BUNDLED:
        from pytest_dflash.native import build
        return build.bundled_library_path()
    return Path(bundled)


def _complete() -> bool:
    return all(op in namespace_ops() for op in REQUIRED_OPS)


def load_d256(
    sidecar: Path | str | None = None,
    *,
    device: str = "cpu",
    bundled: Path | str | None = BUNDLED,
) -> LoaderStatus:
    """Find, load and verify the D256 attention ops; never raises for a bad library, never aborts.

    ``sidecar``: an explicit library file (default: ``$DFLASH_D256_LIBRARY``), loaded only if the
    bundled build lacks required ops. ``bundled``: ``"bundled"`` (the package's own build,
    compiled on first use), a path to use as the bundled library, or None for no bundled library
    (a deployment that ships only a sidecar). The status is computed once per argument set and
    per process; a fallback warns once, with a :class:`DflashFallbackWarning`.

    Only one library can own the namespace, so when a sidecar is given the bundled library is
    first probed in a child: if it lacks required ops it is not loaded (it would shut the
    sidecar out), and it is loaded afterwards only if the sidecar fails too (state partial).
    """
    side = _sidecar_from(sidecar)
    key = (str(bundled), str(side.resolve()) if side else None, str(device))
    if key in _STATUS:
        _CURRENT[str(device)] = _STATUS[key]
        return _STATUS[key]
    status = LoaderStatus(state="missing", device=str(device))
    errors: list[str] = []

    deferred: Path | None = None  # a partial bundled library, kept out of the sidecar's way
    if bundled is not None and _OWNER is None:
        try:
            path = _bundled_path(bundled)
            if side is not None and not set(REQUIRED_OPS) <= set(probe_library(path)):
                # loading it would claim the namespace and shut the sidecar out for good
                deferred = path
                status.attempts.append({"source": "bundled", "path": str(path), "error":
                                        "lacks required ops: not loaded, the sidecar goes first"})
            else:
                _load(path, "bundled", probe=False)
                status.attempts.append({"source": "bundled", "path": str(path), "error": None})
        except Exception as exc:  # noqa: BLE001 - a failed build or load is a state, not a crash
            errors.append(f"bundled: {exc}")
            status.attempts.append({"source": "bundled", "path": None, "error": str(exc)})

    if side is not None:
        if _OWNER is not None and _LOADED[_OWNER].source == "bundled" and _complete():
            note = (f"sidecar {side} not loaded: the bundled library provides every required "
                    f"{NAMESPACE} op")
            status.warnings.append(note)
            warnings.warn(note, UserWarning, stacklevel=2)
            status.attempts.append({"source": "sidecar", "path": str(side), "error": note})
        else:
            try:
                _load(side, "sidecar", probe=True)
                status.attempts.append({"source": "sidecar", "path": str(side), "error": None})
            except LoaderError as exc:
                errors.append(f"sidecar: {exc}")
                status.attempts.append({"source": "sidecar", "path": str(side), "error": str(exc)})

    if deferred is not None and _OWNER is None:
        # the sidecar did not load: the partial bundled library still serves what it has
        try:
            _load(deferred, "bundled", probe=False)
            status.attempts.append({"source": "bundled", "path": str(deferred), "error": None})
        except LoaderError as exc:
            errors.append(f"bundled: {exc}")
            status.attempts.append({"source": "bundled", "path": str(deferred),
                                    "error": str(exc)})

    status.ops = {op: _verify(op, str(device)) for op in REQUIRED_OPS}
    status.optional_ops = {op: _verify(op, str(device)) for op in OPTIONAL_OPS}
    owner = _LOADED.get(_OWNER) if _OWNER else None
    if owner is not None:
        status.path, status.realpath, status.sha256 = owner.path, owner.realpath, owner.sha256
    if owner is not None and all(op["verified"] for op in status.ops.values()):
        status.state = owner.source
    elif owner is not None:
        status.state = "partial"
    elif namespace_ops():
        errors.append(f"the {NAMESPACE} ops present were registered by a library this loader did "
                      "not load: they cannot be bound to a file and are not used")
    status.error = "; ".join(errors) or None

    if not status.ok:
        missing = status.missing_ops()
        message = (f"{NAMESPACE} ops {status.state}; missing or failing: {', '.join(missing)}: "
                   "routes that need them are not selected, falling back to the family baseline")
        if status.error:
            message += f" ({status.error})"
        status.warnings.append(message)
        warnings.warn(DflashFallbackWarning(message), stacklevel=2)
    elif status.error:  # usable ops, but something asked for was refused (e.g. a clash)
        status.warnings.append(status.error)
        warnings.warn(status.error, UserWarning, stacklevel=2)
    _STATUS[key] = status
    _CURRENT[str(device)] = status
    return status


def current_status(device: str = "cpu") -> LoaderStatus:
    """The status this process runs with: that of the latest :func:`load_d256` call for
    ``device`` (e.g. the session's, with its ``--dflash-sidecar``), or the default load if none.

    Routes ask this rather than calling :func:`load_d256` themselves, so an engine or a gate
    that configured the loader explicitly is never second-guessed by a default load.
    """
    status = _CURRENT.get(str(device))
    return status if status is not None else load_d256(device=device)
