"""attn.d256 in plain torch, as another project would write it: fp32 math, GQA, bottom-right
causal mask, optionally a wrong softmax scale. The outside-route tests paste this source into
the plugin modules they hand to pytester, so both gate the same code."""

import torch

from pytest_dflash.native import hits


class Attention:
    """attn.d256 contract in plain torch: fp32 math, GQA, bottom-right causal mask."""

    def __init__(self, name, scale_error=1.0):
        self.name, self.scale_error = name, scale_error

    def _attend(self, q, k, v, out, softmax_scale, causal):
        tq, hq, _ = q.shape
        tk, hkv, _ = k.shape
        rep = hq // hkv
        qf = q.float().transpose(0, 1)
        kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = qf @ kf.transpose(1, 2) * (softmax_scale * self.scale_error)
        if causal:
            rows = torch.arange(tq).unsqueeze(1) + (tk - tq)
            scores = scores.masked_fill(torch.arange(tk).unsqueeze(0) > rows, float("-inf"))
        out.copy_((scores.softmax(-1) @ vf).transpose(0, 1).to(out.dtype))

    def dense(self, q, k, v, out, softmax_scale, causal):
        hits.record(self.name, "dense")
        self._attend(q, k, v, out, softmax_scale, causal)

    def paged(self, q, k_cache, v_cache, block_table, kv_len, out, softmax_scale, causal):
        hits.record(self.name, "paged")
        blocks = block_table.long()
        k = k_cache[blocks].flatten(0, 1)[:kv_len]
        v = v_cache[blocks].flatten(0, 1)[:kv_len]
        self._attend(q, k, v, out, softmax_scale, causal)
