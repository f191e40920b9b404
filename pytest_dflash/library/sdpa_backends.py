"""torch's own SDPA backends as ``attn.d256`` routes: flash, memory-efficient and cuDNN, each
forced as ``torch.nn.attention.sdpa_kernel`` forces it, through the same flags set directly
(``dflash_kernels.attention.forced_backends``: sdpa_kernel's own per-call Python would be timed
as the backend's cost) (contract ``AttnD256``).

The call is the baseline's (``attn.d256.sdpa``, ``dflash_kernels.attention.sdpa_dense``): the
grouped heads as zero-copy views, ``is_causal`` for a whole causal prefill, an explicit
bottom-right mask over a prefix; only the backends SDPA may choose differ, so a verdict judges
the backend and nothing else. A backend
that cannot run a call (flash takes no explicit mask, cuDNN and flash have head-dim and dtype
limits that move between releases) makes torch refuse the call ("No available kernel"); the
route then
skips the gate test with torch's own reasons (its warnings), so the gate stays pending: a
backend that cannot serve the shapes is not judged on them, and is never passed either.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from pytest_dflash.native import hits

if TYPE_CHECKING:
    from torch import Tensor

FAMILY = "attn.d256"


# how torch says that no kernel of the allowed backends takes the call (CUDA builds, CPU builds)
REFUSALS = ("No available kernel", "No viable backend")


class BackendUnavailable(Exception):
    """torch has no kernel of the forced backend for this call; the message is torch's."""


class SdpaBackend:
    """One forced SDPA backend (``backend``: an ``SDPBackend`` member name)."""

    def __init__(self, route: str, backend: str) -> None:
        self.route, self.backend = route, backend

    def dense(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_scale: float,
              causal: bool) -> None:
        hits.record(self.route, "dense")
        self._attend(q, k, v, out, softmax_scale, causal)

    def paged(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
              kv_len: int, out: Tensor, softmax_scale: float, causal: bool) -> None:
        from dflash_kernels.attention import gather_pages

        hits.record(self.route, "paged")
        k, v = gather_pages(k_cache, v_cache, block_table, kv_len)
        self._attend(q, k, v, out, softmax_scale, causal)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float,
                causal: bool) -> None:
        from dflash_kernels.attention import sdpa_dense

        try:
            sdpa_dense(q, k, v, out, scale, causal, backends=(self.backend,))
        except RuntimeError as exc:
            if not any(sign in str(exc) for sign in REFUSALS):
                raise
            # torch tells why each backend declined in warnings: the call again, to hear them
            # (recording warnings on every call would be timed as the backend's cost)
            with warnings.catch_warnings(record=True) as told:
                warnings.simplefilter("always")
                try:
                    sdpa_dense(q, k, v, out, scale, causal, backends=(self.backend,))
                except RuntimeError:
                    pass
            self._unavailable(q, q.shape[0], k.shape[0], causal and q.shape[0] != k.shape[0],
                              exc, told)

    def _unavailable(self, q: Tensor, tq: int, tk: int, masked: bool, exc: Exception,
                     told: list[warnings.WarningMessage]) -> None:
        reasons = "; ".join(dict.fromkeys(str(w.message).strip() for w in told)) or str(exc)
        why = (f"{self.route}: torch's {self.backend} backend cannot run this call (Tq={tq}, "
               f"Tk={tk}, {str(q.dtype).removeprefix('torch.')}, "
               f"{'explicit mask' if masked else 'is_causal'}, {q.device.type}): {reasons}")
        try:
            import pytest
        except ImportError:  # outside a pytest run
            raise BackendUnavailable(why) from exc
        pytest.skip(why)

    def __repr__(self) -> str:
        return f"<{self.route}: SDPA forced to {self.backend}>"


FLASH = SdpaBackend(f"{FAMILY}.sdpa_flash", "FLASH_ATTENTION")
EFFICIENT = SdpaBackend(f"{FAMILY}.sdpa_efficient", "EFFICIENT_ATTENTION")
CUDNN = SdpaBackend(f"{FAMILY}.sdpa_cudnn", "CUDNN_ATTENTION")
