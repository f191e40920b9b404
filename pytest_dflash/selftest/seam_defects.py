"""Planted seam defects of a prefill geometry: what a chunked prefill can get wrong at a chunk
seam, each in a copy of the reference engine that differs from it in that one place only.

* :class:`StateZeroedAtSeams`: the SSM state (and the short-conv state) is zeroed at every seam
  instead of carried over, as a route that loses its state between chunks would;
* :class:`LastChunkKVDropped`: after a prefill the paged KV rows of the last chunk are zeroed, as
  a route that never commits the last chunk's KV pages would; the prefill's own logits are
  right, every step decoded on top of it is not;
* a state carried at reduced precision needs no engine of its own: a geometry whose
  ``state_dtype`` is narrower than fp16 (:data:`BF16_Q7920`, :data:`FP8_Q7920`) is it.

The ppl gate's long contexts and the cold-prefill agreement check must reject each of them
(tests/test_seam_gates.py); docs/gates.md says which catches which.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_dflash.engines.geometry import Geometry
from pytest_dflash.engines.reference import ReferenceEngine

BF16_Q7920 = Geometry("prefill.geometry.bf16_q7920", torch.bfloat16, 7920)
FP8_Q7920 = Geometry("prefill.geometry.fp8_q7920", torch.float8_e4m3fn, 7920)


class StateZeroedAtSeams(ReferenceEngine):
    """The reference engine, but every chunk after the first starts from a zero SSM and conv
    state (the paged KV of earlier chunks is kept)."""

    def _run_chunks(
        self, state: Any, ids: list[int], all_logits: bool,
        on_device: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], int]:
        outs, chunks = [], 0
        for pos in range(0, len(ids), self.chunk):
            if pos:
                for layer, (conv, ssm) in enumerate(zip(state.conv, state.ssm, strict=True)):
                    if ssm is not None:
                        state.conv[layer], state.ssm[layer] = conv * 0, ssm * 0
            rows = None if on_device is None else on_device[:, pos : pos + self.chunk]
            part, _ = super()._run_chunks(state, ids[pos : pos + self.chunk], all_logits,
                                          on_device=rows)
            outs += part
            chunks += 1
        return outs, chunks


class LastChunkKVDropped(ReferenceEngine):
    """The reference engine, but the paged KV rows of a prefill's last chunk are zeroed once it
    has run (its own logits are computed before, so only later steps see the loss)."""

    def _run_chunks(
        self, state: Any, ids: list[int], all_logits: bool,
        on_device: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], int]:
        outs, chunks = super()._run_chunks(state, ids, all_logits, on_device=on_device)
        if ids:
            end = len(state.tokens)
            start = end - (len(ids) - (chunks - 1) * self.chunk)
            for kv in state.kv:
                if kv is not None:
                    zeros = kv.k.new_zeros(end - start, *kv.k.shape[2:])
                    kv.write(start, zeros, zeros)
        return outs, chunks
