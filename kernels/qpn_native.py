"""The native QPN ops (``torch.ops.dflash_qpn``): loading, route hits, poisoning, workspaces.

The QPN kernels live in the bundled native library (``kernels/csrc/qpn_gemm.cpp`` for the CPU,
``qpn_gemm_cuda.cu`` for CUDA), next to the D256 attention ops, and are loaded by the one loader
(:mod:`pytest_dflash.native.loader`): a process never loads a second library of its own for them,
which
could register an op namespace twice and abort. The routes call the ops directly; everything
here runs once per process, once per weight (``require``) or outside the timed calls (hit
snapshots, workspace peaks).

Route hits are counted by the native ops themselves (one relaxed atomic add per path taken), so
a hit proves which native code path ran, and ``pytest_dflash.native.hits`` reads them through a
source
registered here at load time.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

NAMESPACE = "dflash_qpn"
OPS = ("qpn2_linear", "qpn4_bounded_linear", "qpn2_packed_linear")
# Order of dflash_qpn::hit_counts(): (route, path) of each native counter.
HIT_KEYS: tuple[tuple[str, str], ...] = (
    ("gemm.nvfp4.qpn2", "small_m"),
    ("gemm.nvfp4.qpn4_bounded", "large_m"),
    ("gemm.nvfp4.qpn2_packed", "small_m"),
    ("gemm.nvfp4.qpn2_packed", "large_m"),
)

_lock = threading.Lock()
_loaded = False
_poison = False
_dispatch_checked = True


class NativeOpsMissing(RuntimeError):
    """The dflash_qpn ops are not available for a device; the message says why and the fix."""


def registered_ops() -> list[str]:
    """Names of the ``dflash_qpn`` ops registered in this process."""
    prefix = NAMESPACE + "::"
    return sorted(
        {name[len(prefix):].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
         if name.startswith(prefix)}
    )


def _load() -> None:
    """Load the bundled library through the loader (once), then hook up hits and flags."""
    global _loaded
    with _lock:
        if _loaded:
            return
        if not set(OPS) <= set(registered_ops()):
            from pytest_dflash.native.loader import current_status

            status = current_status("cpu")  # loads the bundled build (or the chosen sidecar)
            if not set(OPS) <= set(registered_ops()):
                raise NativeOpsMissing(
                    f"the native QPN ops ({NAMESPACE}::{', '.join(OPS)}) are not registered: "
                    f"{status.summary()}. Build the bundled library with `pytest-dflash build`; "
                    "a sidecar library must be a full build of kernels/csrc"
                )
        from pytest_dflash.native import hits
        hits.add_source(read_hits)
        ns = getattr(torch.ops, NAMESPACE)
        ns.set_poison(_poison)
        ns.set_dispatch_checked(_dispatch_checked)
        _loaded = True


def ops() -> Any:
    """``torch.ops.dflash_qpn``, loaded."""
    if not _loaded:
        _load()
    return getattr(torch.ops, NAMESPACE)


def _dispatch_key(device: torch.device) -> str:
    return {"cpu": "CPU", "cuda": "CUDA"}.get(device.type, device.type.upper())


def require(device: torch.device | str) -> Any:
    """The ops namespace, after checking every QPN op has a kernel for ``device``.

    Routes call this in ``prepare`` (once per weight), so a missing CUDA build fails there
    with the reason instead of inside the dispatcher at the first call.
    """
    ns = ops()
    key = _dispatch_key(torch.device(device))
    missing = [op for op in OPS
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key)]
    if missing:
        raise NativeOpsMissing(
            f"{NAMESPACE}::{', '.join(missing)} have no kernel for dispatch key {key} (device "
            f"{device}): the loaded library was built without it; rebuild with "
            "`pytest-dflash build` on a machine whose torch and compiler support that device"
        )
    return ns


def read_hits() -> dict[tuple[str, str], int]:
    """The native hit counters (monotonic, per process) keyed like ``pytest_dflash.native.hits``."""
    counts = getattr(torch.ops, NAMESPACE).hit_counts().tolist()
    return {key: int(n) for key, n in zip(HIT_KEYS, counts, strict=True) if n}


def set_poison(on: bool) -> None:
    """Fill every scratch, workspace and output buffer with 0xFF before use (see gemm)."""
    global _poison
    _poison = bool(on)
    if _loaded:
        getattr(torch.ops, NAMESPACE).set_poison(_poison)


def poison_enabled() -> bool:
    return _poison


def dispatch_checked() -> bool:
    return _dispatch_checked


def set_dispatch_checked(on: bool) -> None:
    """Testing hook only: switch the op's min_prefill_m > 8 check off (see gemm)."""
    global _dispatch_checked
    _dispatch_checked = bool(on)
    if _loaded:
        getattr(torch.ops, NAMESPACE).set_dispatch_checked(_dispatch_checked)


# ------------------------------------------------------------------------------ workspaces

_ids = itertools.count(1)


def device_key(device: torch.device | str) -> torch.device:
    """One key per physical device: ``cuda`` and ``cuda:0`` (when 0 is current) are the same
    device, and so are ``cpu`` and ``cpu:0``.

    Tensors report ``cuda:0`` while callers often say ``cuda``: a dict keyed by the raw
    ``torch.device`` then holds two entries for one device, and a peak recorded under one key
    is read as 0 under the other (the bug this normalisation fixes).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        if current is None:
            raise ValueError(f"device {device} has no index and no current device to fill it in")
        return torch.device(device.type, current())
    return device


class Workspace:
    """The bounded scratch of one large-M path on one device, held by the native library.

    ``id`` names the native slot the ops take their workspace from; the storage grows lazily to
    one chunk, never beyond the bound the op is given. ``peak_bytes`` is the largest storage the
    slot ever held, read from the library (a real run's figure, not chunking arithmetic).
    """

    def __init__(self, bound_bytes: int, device: torch.device | str = "cpu") -> None:
        self.bound_bytes = check_bound(bound_bytes)
        self.device = device_key(device)
        self.id = next(_ids)
        weakref.finalize(self, _release, self.id)

    def set_bound(self, bound_bytes: int) -> None:
        """Change the bound; a storage above the new bound is dropped now."""
        self.bound_bytes = check_bound(bound_bytes)
        ops().workspace_trim(self.id, self.bound_bytes)

    @property
    def peak_bytes(self) -> int:
        return int(ops().workspace_peak(self.id))

    def reset_peak(self) -> None:
        """Peak := the storage held now (0 if none)."""
        ops().workspace_reset_peak(self.id)

    def __repr__(self) -> str:
        return f"<Workspace {self.id} on {self.device}, bound {self.bound_bytes} bytes>"


def _release(workspace_id: int) -> None:
    if _loaded:
        try:
            getattr(torch.ops, NAMESPACE).workspace_release(workspace_id)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process frees it anyway
            pass


def check_bound(bound_bytes: int) -> int:
    if isinstance(bound_bytes, bool) or not isinstance(bound_bytes, int) or bound_bytes <= 0:
        raise ValueError(f"workspace bound must be a positive int of bytes, got {bound_bytes!r}")
    return bound_bytes
