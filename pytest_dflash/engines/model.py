"""The reference model: a small hybrid of gated-delta-rule SSM and attention layers
(docs/reference-model.md).

Everything numeric that training and the reference engine share lives here, so the engine runs
exactly the arithmetic the weights were trained with:

* the gated delta rule in its recurrent form (the reference: one token at a time, as decoding
  runs it) and its chunk-parallel form (WY representation: what training and prefill run; a test
  checks both agree);
* the short causal convolution in front of the SSM, with a carried state so chunked prefill equals
  one long call;
* RMSNorm, the SSM mixer and the attention projections;
* NVFP4 fake quantization for quantization-aware training (the packed layout the engine runs is
  built by ``dflash_kernels.nvfp4``; ``export_nvfp4`` writes the same code/scale/global triple).

The training module (``HybridLM``) uses torch SDPA and float MLP weights; the engine replaces
attention and the MLP projections by the selected routes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytest_dflash.engines.tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 256
    n_groups: int = 2  # each group: ssm_per_group SSM layers, then one attention layer
    ssm_per_group: int = 3
    ssm_heads: int = 4
    ssm_head_dim: int = 64
    conv_kernel: int = 4
    attn_q_heads: int = 2
    attn_kv_heads: int = 1
    attn_head_dim: int = 256
    d_ff: int = 512
    norm_eps: float = 1e-6
    ssm_chunk: int = 64  # inner chunk of the chunk-parallel delta rule

    def __post_init__(self) -> None:
        problems = []
        if self.ssm_heads * self.ssm_head_dim != self.d_model:
            problems.append("ssm_heads * ssm_head_dim must equal d_model")
        if self.attn_q_heads % self.attn_kv_heads:
            problems.append("attn_q_heads must be a multiple of attn_kv_heads (GQA)")
        # NVFP4 projections must meet the QPN contract K % 64 == 0, N % 32 == 0
        if self.d_model % 64 or self.d_ff % 64:
            problems.append("d_model and d_ff must be multiples of 64 (QPN contract K % 64 == 0)")
        if problems:
            raise ValueError(f"invalid ModelConfig {self}: " + "; ".join(problems))

    @property
    def n_layers(self) -> int:
        return self.n_groups * (self.ssm_per_group + 1)

    def is_attention(self, layer: int) -> bool:
        return layer % (self.ssm_per_group + 1) == self.ssm_per_group

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown config keys {unknown}; known: {sorted(known)}")
        return cls(**data)


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the model's working precision: fp32, or fp64 where ``x`` already is fp64 (the
    fp64 reference that measures the fp32 engine's own rounding spread; docs/gates.md)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 (fp64 for fp64 x). Through
    ``F.rms_norm``: one fused kernel where torch has one (a decode step runs 27 of these), on
    the CPU bitwise the same as the written-out formula."""
    xw = wide(x)
    out = F.rms_norm(xw, (x.shape[-1],), weight.to(xw.dtype), eps)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- gated delta rule
# exp(x) below this is flushed to 0: results change by < 1e-26 relative, and fp32 subnormals
# (which long decays produce, e.g. exp(-100)) make CPU matmuls a hundredfold slower
_EXP_FLOOR = -60.0
_TINY = 1e-30


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x < _EXP_FLOOR, 0.0, x.exp())


def _flush(s: torch.Tensor) -> torch.Tensor:
    """|s| <= _TINY becomes 0, in one kernel: it runs once per SSM chunk or token."""
    return F.hardshrink(s, _TINY)


def gdr_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule, the reference form.

    Shapes: q, k [B, T, H, dk] (L2-normalised; q already scaled), v [B, T, H, dv], g (log decay,
    <= 0) and beta [B, T, H], state [B, H, dk, dv]. With S stored as [dk, dv]:
    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T q_t.
    The state is rounded to ``state_dtype`` after every token, as a decoder storing it would.
    """
    # per-token factors for all tokens at once: the loop keeps only the state recurrence
    qf, kf, vf = wide(q), wide(k), wide(v)
    work = vf.dtype
    s = state.to(work)
    decay = _exp(g.to(work))[..., None, None]  # [B, T, H, 1, 1]
    write = beta.to(work)[..., None]  # [B, T, H, 1]
    outs = []
    for t in range(q.shape[1]):
        qt, kt = qf[:, t], kf[:, t]
        s = decay[:, t] * s
        u = write[:, t] * (vf[:, t] - torch.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., :, None] * u[..., None, :]
        s = _flush(s.to(state_dtype).to(work))
        outs.append(torch.einsum("bhkv,bhk->bhv", s, qt))
    return torch.stack(outs, dim=1).to(v.dtype), s.to(state_dtype)


def gdr_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64, state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel gated delta rule (WY form), equal to ``gdr_recurrent`` up to rounding.

    Within a chunk with cumulative log decay G: U = (I + L)^-1 (b V - b e^G K S0) with
    L[t, j] = b_t e^(G_t - G_j) k_t.k_j (j < t); O = (Q e^G) S0 + (Q K^T * decay, lower) U;
    S_end = e^(G_C) S0 + sum_j e^(G_C - G_j) k_j u_j^T. The state is rounded to ``state_dtype``
    at every chunk boundary, which is what makes an fp16 state a numerically different route.
    """
    bsz, t_len, heads, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    pad = (-t_len) % chunk
    vf = wide(v)
    work = vf.dtype
    qf, kf, gf, bf = (x.to(work) for x in (q, k, g, beta))
    if pad:
        # padded positions: no decay (g=0), no write (beta=0), so the state is unchanged
        qf, kf, vf = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qf, kf, vf))
        gf, bf = (F.pad(x, (0, 0, 0, pad)) for x in (gf, bf))
    n = (t_len + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = x.reshape(bsz, n, chunk, heads, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    qb, kb, vb, gb, bb = blocks(qf), blocks(kf), blocks(vf), blocks(gf), blocks(bf)
    gcum = gb.cumsum(-1)  # [B, H, n, C]
    diff = gcum[..., :, None] - gcum[..., None, :]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = _exp(torch.where(lower, diff, torch.full_like(diff, -math.inf)))
    kk = kb @ kb.transpose(-1, -2)
    strict = lower.logical_not().transpose(0, 1)  # strictly lower triangle
    lmat = torch.where(strict, bb[..., :, None] * decay * kk, torch.zeros_like(kk))
    rhs = torch.cat([bb[..., None] * vb, bb[..., None] * _exp(gcum)[..., None] * kb], dim=-1)
    eye = torch.eye(chunk, dtype=lmat.dtype, device=lmat.device)
    # forward substitution: stable where a power-series inverse of (I + L) overflows (similar
    # keys make the powers of L grow binomially)
    sol = torch.linalg.solve_triangular(eye + lmat, rhs, upper=False, unitriangular=True)
    u_base, w = sol[..., :dv], sol[..., dv:]  # U = u_base - w @ S0
    qk = torch.where(lower, (qb @ kb.transpose(-1, -2)) * decay, torch.zeros_like(kk))
    # Everything that does not depend on the running state is computed for all chunks at once;
    # the sequential loop keeps only the state recurrence (a handful of kernel launches per
    # chunk: on a GPU a per-chunk chain of small ops is launch-bound, not compute-bound).
    q_decay = qb * _exp(gcum)[..., None]  # Q e^G
    k_tail = (kb * _exp(gcum[..., -1:] - gcum)[..., None]).transpose(-1, -2)  # (K e^(G_C-G_j))^T
    a_end = _exp(gcum[..., -1])[..., None, None]  # e^(G_C)

    def by_chunk(x: torch.Tensor) -> torch.Tensor:  # [B, H, n, ...] -> contiguous [n, B*H, ...]
        return x.movedim(2, 0).reshape(n, bsz * heads, *x.shape[3:])

    # chunk-major copies, so that each step's operands are plain [B*H, ...] views and each
    # update below is one fused GEMM launch: U_i = u_base_i - W_i S, S' = a_i S + K_i^T U_i
    u_base, w, k_tail, a_end = (by_chunk(x) for x in (u_base, w, k_tail, a_end))
    s = state.to(work).reshape(bsz * heads, dk, dv)
    starts, us = [], []
    for i in range(n):
        u = torch.baddbmm(u_base[i], w[i], s, alpha=-1)
        starts.append(s)
        us.append(u)
        s = _flush(torch.baddbmm(a_end[i] * s, k_tail[i], u).to(state_dtype).to(work))

    def by_head(xs: list[torch.Tensor]) -> torch.Tensor:  # n x [B*H, ...] -> [B, H, n, ...]
        return torch.stack(xs, dim=1).view(bsz, heads, n, *xs[0].shape[1:])

    # O = (Q e^G) S0 + (Q K^T * decay, lower) U, for every chunk in one batched product each
    o = q_decay @ by_head(starts) + qk @ by_head(us)  # [B, H, n, C, dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(bsz, n * chunk, heads, dv)[:, :t_len]
    return o.to(out_dtype), s.to(state_dtype).view(bsz, heads, dk, dv)


# --------------------------------------------------------------------------- SSM mixer
def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, x [B, T, C], weight [C, W], state [B, W-1, C]: the last
    W-1 inputs of the previous call, so splitting a sequence into calls changes nothing."""
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    ext = torch.cat([conv_state.to(x.dtype), x], dim=1)
    out = F.conv1d(ext.transpose(1, 2), weight.to(x.dtype)[:, None, :], groups=x.shape[2])
    return out.transpose(1, 2), ext[:, -(width - 1):].detach()


def ssm_mixer(
    p: dict[str, torch.Tensor], x: torch.Tensor, cfg: ModelConfig,
    conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
    state_dtype: torch.dtype = torch.float32, recurrent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet mixer: conv'd q/k/v, L2-normalised q/k, learned decay and write strength,
    gated RMSNorm on the output. Returns (y, conv_state, ssm_state)."""
    bsz, t_len, _ = x.shape
    h, dh = cfg.ssm_heads, cfg.ssm_head_dim
    qkv, conv_state = causal_conv(F.linear(x, p["qkv.weight"]), p["conv.weight"], conv_state)
    qkv = F.silu(qkv)
    q, k, v = qkv.reshape(bsz, t_len, 3, h, dh).unbind(2)
    q = F.normalize(wide(q), dim=-1) / math.sqrt(dh)
    k = F.normalize(wide(k), dim=-1)
    beta = torch.sigmoid(wide(F.linear(x, p["b.weight"])))
    g = -wide(p["A_log"]).exp() * F.softplus(wide(F.linear(x, p["a.weight"])) + p["dt_bias"])
    if ssm_state is None:
        ssm_state = x.new_zeros(bsz, h, dh, dh, dtype=state_dtype)
    if recurrent:
        o, ssm_state = gdr_recurrent(q, k, wide(v), g, beta, ssm_state, state_dtype)
    else:
        o, ssm_state = gdr_chunked(q, k, wide(v), g, beta, ssm_state, cfg.ssm_chunk, state_dtype)
    o = rms_norm(o, p["o_norm.weight"], cfg.norm_eps).to(x.dtype)
    o = o.reshape(bsz, t_len, h * dh) * F.silu(F.linear(x, p["gate.weight"]))
    return F.linear(o, p["out.weight"]), conv_state, ssm_state


def attn_qkv(
    p: dict[str, torch.Tensor], x: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] with per-head RMSNorm on q and k (no positional
    encoding: the SSM layers before each attention layer carry the order)."""
    bsz, t_len, _ = x.shape
    d = cfg.attn_head_dim
    q = F.linear(x, p["q.weight"]).reshape(bsz, t_len, cfg.attn_q_heads, d)
    k = F.linear(x, p["k.weight"]).reshape(bsz, t_len, cfg.attn_kv_heads, d)
    v = F.linear(x, p["v.weight"]).reshape(bsz, t_len, cfg.attn_kv_heads, d)
    q = rms_norm(q, p["q_norm.weight"], cfg.norm_eps)
    k = rms_norm(k, p["k_norm.weight"], cfg.norm_eps)
    return q, k, v


# --------------------------------------------------------------------------- NVFP4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
FP4_MAX = 6.0


def nvfp4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize w [N, K] the NVFP4 way (docs/families.md): returns (codes uint8 [N, K] of 4 bits,
    sign in bit 3; block scales float8_e4m3fn [N, K/16]; global fp32 = amax / (6 * 448))."""
    n, k = w.shape
    if k % 16:
        raise ValueError(f"NVFP4 needs K % 16 == 0, got weight of shape {tuple(w.shape)}")
    wf = w.detach().float()
    glob = (wf.abs().amax() / (FP4_MAX * E4M3_MAX)).clamp_min(1e-12)
    blocks = wf.reshape(n, k // 16, 16)
    scale = (blocks.abs().amax(-1) / FP4_MAX / glob).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * glob)[..., None]
    mag = torch.where(denom > 0, blocks.abs() / denom, torch.zeros_like(blocks))
    grid = torch.tensor(E2M1_VALUES, device=w.device)
    idx = (mag[..., None] - grid).abs().argmin(-1).to(torch.uint8)  # nearest, ties to smaller
    sign = ((blocks < 0) & (idx > 0)).to(torch.uint8) << 3
    return (idx | sign).reshape(n, k), scale, glob.reshape(())


def nvfp4_decode(codes: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """fp32 weight [N, K] = e2m1(code) * e4m3(block scale) * global."""
    n, k = codes.shape
    grid = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = grid[(codes & 7).long()]
    val = torch.where((codes & 8) > 0, -mag, mag).reshape(n, k // 16, 16)
    return (val * scale.float()[..., None] * glob.float()).reshape(n, k)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes -> packed uint8 [N, K/2]: even k in the low nibble, odd k high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


class _FakeQuant(torch.autograd.Function):
    """Straight-through NVFP4 rounding: forward sees the dequantized weight, gradients pass."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return nvfp4_decode(*nvfp4_codes(w)).to(w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad


def fake_quant_nvfp4(w: torch.Tensor) -> torch.Tensor:
    return _FakeQuant.apply(w)


# --------------------------------------------------------------------------- training module
MLP_WEIGHTS = ("mlp.gate_up.weight", "mlp.down.weight")


class HybridLM(nn.Module):
    """Training form of the model (torch SDPA, float or fake-quantized MLP weights)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, dh = cfg.d_model, cfg.ssm_heads, cfg.ssm_head_dim
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList()
        for i in range(cfg.n_layers):
            layer = nn.ModuleDict()
            layer["norm1"] = _Norm(d)
            layer["norm2"] = _Norm(d)
            mix = nn.ModuleDict()
            if cfg.is_attention(i):
                hd = cfg.attn_head_dim
                mix["q"] = nn.Linear(d, cfg.attn_q_heads * hd, bias=False)
                mix["k"] = nn.Linear(d, cfg.attn_kv_heads * hd, bias=False)
                mix["v"] = nn.Linear(d, cfg.attn_kv_heads * hd, bias=False)
                mix["o"] = nn.Linear(cfg.attn_q_heads * hd, d, bias=False)
                mix["q_norm"] = _Norm(hd)
                mix["k_norm"] = _Norm(hd)
            else:
                mix["qkv"] = nn.Linear(d, 3 * d, bias=False)
                mix["conv"] = _Param(torch.randn(3 * d, cfg.conv_kernel) / cfg.conv_kernel)
                mix["a"] = nn.Linear(d, h, bias=False)
                mix["b"] = nn.Linear(d, h, bias=False)
                mix["gate"] = nn.Linear(d, d, bias=False)
                mix["out"] = nn.Linear(d, d, bias=False)
                mix["o_norm"] = _Norm(dh)
                mix["A_log"] = _Param(torch.log(torch.linspace(1.0, 16.0, h)))
                mix["dt_bias"] = _Param(torch.log(torch.expm1(torch.linspace(0.001, 0.1, h))))
            layer["mix"] = mix
            mlp = nn.ModuleDict()
            mlp["gate_up"] = nn.Linear(d, 2 * cfg.d_ff, bias=False)
            mlp["down"] = nn.Linear(cfg.d_ff, d, bias=False)
            layer["mlp"] = mlp
            self.layers.append(layer)
        self.norm = _Norm(d)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.fake_quant = False
        for name, prm in self.named_parameters():
            if name.endswith(".weight") and prm.dim() == 2 and "embed" not in name:
                nn.init.normal_(prm, std=0.02)
                if name.endswith(("o.weight", "out.weight", "down.weight")):
                    prm.data /= math.sqrt(2 * cfg.n_layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            p = _flat(layer["mix"])
            h = rms_norm(x, layer["norm1"].weight, cfg.norm_eps)
            if cfg.is_attention(i):
                q, k, v = attn_qkv(p, h, cfg)
                rep = cfg.attn_q_heads // cfg.attn_kv_heads
                k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                )
                y = F.linear(o.transpose(1, 2).flatten(2), p["o.weight"])
            else:
                y, _, _ = ssm_mixer(p, h, cfg, None, None)
            x = x + y
            h = rms_norm(x, layer["norm2"].weight, cfg.norm_eps)
            wgu, wd = layer["mlp"]["gate_up"].weight, layer["mlp"]["down"].weight
            if self.fake_quant:
                wgu, wd = fake_quant_nvfp4(wgu), fake_quant_nvfp4(wd)
            gate, up = F.linear(h, wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wd)
        return self.head(rms_norm(x, self.norm.weight, cfg.norm_eps))


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Param(nn.Module):
    """A bare parameter inside a ModuleDict, stored under the key's own name."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(value)


def _flat(mix: nn.ModuleDict) -> dict[str, torch.Tensor]:
    """Parameters of a mixer under the names the functional code uses ("qkv.weight", "A_log")."""
    out: dict[str, torch.Tensor] = {}
    for name, module in mix.items():
        if isinstance(module, _Param):
            out[name if name in ("A_log", "dt_bias") else f"{name}.weight"] = module.value
        else:
            out[f"{name}.weight"] = module.weight
    return out


def flat_state(model: HybridLM) -> dict[str, torch.Tensor]:
    """All weights under the stable names the weight file uses: ``layers.{i}.mix.qkv.weight``,
    ``layers.{i}.mlp.gate_up.weight``, ``embed.weight``, ``norm.weight``, ``head.weight``."""
    out = {"embed.weight": model.embed.weight, "norm.weight": model.norm.weight,
           "head.weight": model.head.weight}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.norm1.weight"] = layer["norm1"].weight
        out[f"layers.{i}.norm2.weight"] = layer["norm2"].weight
        for name, t in _flat(layer["mix"]).items():
            out[f"layers.{i}.mix.{name}"] = t
        for name in MLP_WEIGHTS:
            sub = name.split(".")[1]
            out[f"layers.{i}.{name}"] = layer["mlp"][sub].weight
    return {k: v.detach() for k, v in out.items()}


# --------------------------------------------------------------------------- checkpoint files
WEIGHTS_FILE = "weights.pt"
CONFIG_FILE = "config.json"
SHA_FILE = "weights.sha256"


class CheckpointError(RuntimeError):
    """A weight file that is missing, truncated, altered or not what its sha256 file names."""


def export_tensors(model: HybridLM) -> dict[str, torch.Tensor]:
    """The shipped form: MLP weights as NVFP4 (packed codes, E4M3 scale bytes, fp32 global),
    matrices in fp16, vectors in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, t in flat_state(model).items():
        t = t.detach().float().cpu()
        if name.endswith(MLP_WEIGHTS):
            codes, scales, glob = nvfp4_codes(t)
            out[f"{name}:packed"] = pack_nibbles(codes)
            out[f"{name}:scales"] = scales.view(torch.uint8).contiguous()
            out[f"{name}:global"] = glob.reshape(1).float()
        elif t.dim() == 2:
            out[name] = t.half().contiguous()
        else:
            out[name] = t.contiguous()
    return out


def sha256_file(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(out_dir: str | Path, model: HybridLM) -> str:
    """Write weights.pt, config.json and weights.sha256 into ``out_dir``; returns the sha256."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(export_tensors(model), out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(model.cfg.to_json() + "\n", encoding="utf-8")
    sha = sha256_file(out_dir / WEIGHTS_FILE)
    (out_dir / SHA_FILE).write_text(f"{sha}  {WEIGHTS_FILE}\n", encoding="utf-8")
    return sha


def load_checkpoint(model_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and tensors of a checkpoint, after checking the weight file's sha256: a truncated
    or altered file must fail here with a clear message, never load as a subtly wrong model."""
    model_dir = Path(model_dir)
    weights, sha_file, cfg_file = (model_dir / n for n in (WEIGHTS_FILE, SHA_FILE, CONFIG_FILE))
    for path in (weights, sha_file, cfg_file):
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing; the reference model needs {WEIGHTS_FILE}, {SHA_FILE} and "
                f"{CONFIG_FILE} in {model_dir} (restore them from git or re-run fixtures/train.py)"
            )
    expected = sha_file.read_text(encoding="utf-8").split()[0] if sha_file.stat().st_size else ""
    actual = sha256_file(weights)
    if actual != expected:
        raise CheckpointError(
            f"{weights} ({weights.stat().st_size} bytes) has sha256 {actual}, but {sha_file} "
            f"expects {expected or '(empty file)'}: the weight file is truncated or altered. "
            f"Restore it (git checkout -- {weights.name}) or retrain with fixtures/train.py, "
            f"which rewrites both files."
        )
    try:
        tensors = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise CheckpointError(f"{weights} matches its sha256 but cannot be loaded: {exc}") from exc
    return ModelConfig.from_json(cfg_file), tensors


def mlp_nvfp4(
    tensors: dict[str, torch.Tensor], name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], scales float8_e4m3fn [N, K/16], global fp32 scalar) of one MLP
    weight of a checkpoint."""
    return (tensors[f"{name}:packed"], tensors[f"{name}:scales"].view(torch.float8_e4m3fn),
            tensors[f"{name}:global"].reshape(()))


def dense_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every weight as fp32 under its plain name, MLP weights dequantized from NVFP4."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name, _, part = key.partition(":")
        if not part:
            out[name] = t.float()
        elif part == "packed":
            packed, scales, glob = mlp_nvfp4(tensors, name)
            out[name] = nvfp4_decode(unpack_nibbles(packed), scales, glob)
    return out


def load_into(model: HybridLM, tensors: dict[str, torch.Tensor]) -> HybridLM:
    """Copy a checkpoint's (dequantized) weights into a training module, e.g. to evaluate the
    exact shipped numbers; fails on missing or extra names."""
    dense = dense_state(tensors)
    params = flat_state(model)
    missing, extra = sorted(set(params) - set(dense)), sorted(set(dense) - set(params))
    if missing or extra:
        raise CheckpointError(f"checkpoint does not fit the config: missing {missing}, "
                              f"unexpected {extra}")
    with torch.no_grad():
        for name, value in dense.items():
            _param_by_name(model, name).copy_(value.to(_param_by_name(model, name).dtype))
    return model


def _param_by_name(model: HybridLM, name: str) -> torch.Tensor:
    parts = name.split(".")
    if parts[0] != "layers":
        return getattr(model, parts[0]).weight
    layer = model.layers[int(parts[1])]
    if parts[2] == "mix":
        module = layer["mix"][parts[3]]
        return module.value if isinstance(module, _Param) else module.weight
    if parts[2] == "mlp":
        return layer["mlp"][parts[3]].weight
    return layer[parts[2]].weight
