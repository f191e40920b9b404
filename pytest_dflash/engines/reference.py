"""The embedded reference engine (docs/reference-model.md; the engine
protocol: docs/extending.md).

It runs the trained hybrid model of ``fixtures/model`` through the *selected routes*: attention
through the ``attn.d256`` route object (dense op for the first prefill chunk, paged op over the
paged KV cache for every later chunk, decode and verify step), every MLP projection through the
``gemm.nvfp4`` route object (NVFP4 weights prepared once per route), and prefill chunking and SSM
state dtype through the ``prefill.geometry`` route. So a model-level gate of a candidate measures
the candidate's code, and ``route_hits()`` proves it ran.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from pytest_dflash.engines import (
    IN_PROCESS,
    EngineError,
    Generation,
    PrefillResult,
    Sampling,
    check_positions,
)
from pytest_dflash.engines.geometry import KV_BLOCK_SIZE
from pytest_dflash.engines.model import (
    ModelConfig,
    attn_qkv,
    load_checkpoint,
    mlp_nvfp4,
    rms_norm,
    ssm_mixer,
    wide,
)
from pytest_dflash.engines.tokenizer import BOS, EOS, decode, encode
from pytest_dflash.native import hits

if TYPE_CHECKING:
    from pytest_dflash.routes.registry import RouteRegistry

ATTN, GEMM, GEOMETRY = "attn.d256", "gemm.nvfp4", "prefill.geometry"
FAMILIES = (ATTN, GEMM, GEOMETRY)
MAX_VERIFY_ROWS = 8
PREFIX_CACHE_ENTRIES = 8
# device copies of the last verify drafts' token ids kept (see ReferenceEngine._row_ids)
DRAFT_IDS_ENTRIES = 64
# Decode/verify steps at most this long use the recurrent (reference) SSM form, as a decoder does.
RECURRENT_MAX_TOKENS = MAX_VERIFY_ROWS


def default_model_dir() -> Path:
    import dflash_fixtures

    return Path(dflash_fixtures.__file__).resolve().parent / "model"


@functools.lru_cache(maxsize=4)
def _checkpoint(path: str, mtime_ns: int, size: int) -> tuple[ModelConfig, dict[str, Any]]:
    del mtime_ns, size  # cache key only: a rewritten file is re-read and re-checked
    return load_checkpoint(path)


def _resolve(selection: Mapping[str, str],
             registry: RouteRegistry | None) -> dict[str, tuple[str, Any]]:
    if registry is None:
        from pytest_dflash.routes.registry import RouteRegistry
        from pytest_dflash.routes.shipped import SHIPPED_ROUTES

        registry = RouteRegistry()
        for route in SHIPPED_ROUTES:
            registry.register(route)
    out = {}
    for family in FAMILIES:
        name = selection.get(family) or registry.role(family, "baseline").name
        route = registry.get(name)
        if route.family != family:
            raise EngineError(f"selection maps family {family!r} to route {name!r} of family "
                              f"{route.family!r}; map each family to one of its own routes")
        out[family] = (name, route.implementation())
    attn, gemm, geom = (out[f][1] for f in FAMILIES)
    if not (callable(getattr(attn, "dense", None)) and callable(getattr(attn, "paged", None))):
        raise EngineError(f"route {out[ATTN][0]} does not offer the attn.d256 contract "
                          "(.dense(...) and .paged(...))")
    if not all(callable(getattr(gemm, m, None)) for m in ("prepare", "linear", "gate_up")):
        raise EngineError(f"route {out[GEMM][0]} does not offer the gemm.nvfp4 contract "
                          "(.prepare, .linear, .gate_up)")
    # the family's contract (families.PrefillGeometry), not the shipped class: an outside
    # project's geometry object qualifies, and so does a copy of the shipped module's class
    if not (isinstance(getattr(geom, "state_dtype", None), torch.dtype)
            and callable(getattr(geom, "chunk", None))):
        raise EngineError(f"route {out[GEOMETRY][0]} does not offer the prefill.geometry "
                          "contract (.state_dtype, a torch.dtype, and .chunk(profile))")
    return out


@dataclass
class _KV:
    """Paged KV cache of one attention layer. Logical block i lives in physical block i ^ 1, so
    the block table is a real indirection that a route ignoring it would get wrong."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    pages: torch.Tensor | None = None  # block table of the whole capacity (built on first use)

    def ensure(self, tokens: int) -> None:
        need = 2 * math.ceil(max(1, math.ceil(tokens / KV_BLOCK_SIZE)) / 2)  # even capacity
        if need > self.k.shape[0]:
            grow = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_zeros(grow, *old.shape[1:])
                new[: old.shape[0]] = old  # pairs (2i, 2i+1) keep their slots: i ^ 1 is stable
                setattr(self, name, new)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape[0] == 1:  # a decode step: one row, addressed from the host (no index math)
            block, slot = divmod(start, KV_BLOCK_SIZE)
            self.k[block ^ 1, slot] = k[0]
            self.v[block ^ 1, slot] = v[0]
            return
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        phys = (pos // KV_BLOCK_SIZE) ^ 1
        self.k[phys, pos % KV_BLOCK_SIZE] = k.to(self.k.dtype)
        self.v[phys, pos % KV_BLOCK_SIZE] = v.to(self.v.dtype)

    def table(self, tokens: int) -> torch.Tensor:
        """Block table of the first ``tokens`` positions: a view of one table per capacity, since
        a decoding engine asks for it every step."""
        n = max(1, math.ceil(tokens / KV_BLOCK_SIZE))
        if self.pages is None or self.pages.shape[0] != self.k.shape[0]:
            self.pages = torch.arange(self.k.shape[0], dtype=torch.int32,
                                      device=self.k.device) ^ 1
        return self.pages[:n]

    def clone(self, tokens: int) -> _KV:
        n = 2 * math.ceil(max(1, math.ceil(tokens / KV_BLOCK_SIZE)) / 2)
        return _KV(self.k[:n].clone(), self.v[:n].clone())


@dataclass
class _State:
    """Everything the model carries between calls, for one token sequence."""

    tokens: list[int]
    conv: list[torch.Tensor | None]
    ssm: list[torch.Tensor | None]
    kv: list[_KV | None]
    last_logits: torch.Tensor | None = None

    def clone(self) -> _State:
        n = len(self.tokens)
        return _State(list(self.tokens), [c.clone() if c is not None else None for c in self.conv],
                      [s.clone() if s is not None else None for s in self.ssm],
                      [kv.clone(n + MAX_VERIFY_ROWS) if kv is not None else None
                       for kv in self.kv],
                      None if self.last_logits is None else self.last_logits.clone())


def _stacked(states: list[_State], name: str, layer: int) -> torch.Tensor | None:
    """The conv or SSM state of ``layer`` for a batch: each sequence's [1, ...] state, stacked
    on the batch dimension (a single sequence's own tensor, None before its first token)."""
    parts = [getattr(state, name)[layer] for state in states]
    if len(parts) == 1:
        return parts[0]
    if any(part is None for part in parts):
        raise EngineError("a batched decode step needs every sequence prefilled first")
    return torch.cat(parts)


@dataclass
class _Sequence:
    """One prompt being completed: its state and the tokens generated so far."""

    index: int
    state: _State
    generator: torch.Generator
    out: list[int] = field(default_factory=list)

    def take(self, tok: int, stop: list[str], max_new_tokens: int) -> Generation | None:
        """Append the picked token; the finished Generation if it ends the completion (EOS, a
        stop string, the length limit), else None: the token then goes through the model."""
        if tok == EOS:
            return Generation(decode(self.out), self.out, "stop")
        self.out.append(tok)
        text = decode(self.out)
        hit = [text.index(s) for s in stop if s in text]
        if hit:
            return Generation(text[: min(hit)], self.out, "stop")
        if len(self.out) >= max_new_tokens:
            return Generation(text, self.out, "length")
        return None


class ReferenceEngine:
    """The reference engine: see the module docstring. Build it with :func:`build`."""

    capabilities = IN_PROCESS  # in process: full logits, verify steps, route hits, timing

    def __init__(self, selection: Mapping[str, str], profile: str, device: str | torch.device,
                 registry: RouteRegistry | None = None, model_dir: str | Path | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device)
        self.profile = profile
        routes = _resolve(selection, registry)
        self.selection = {f: routes[f][0] for f in FAMILIES}
        self.attn_route, self.attn = routes[ATTN]
        self.gemm_route, self.gemm = routes[GEMM]
        self.geometry_route, self.geometry = routes[GEOMETRY]
        self.chunk = self.geometry.chunk(profile)
        self.state_dtype = self.geometry.state_dtype
        # SM70 computes in fp16 (no bf16); the CPU profiles compute in fp32. ``compute_dtype``
        # float64 (with the oracle routes and an fp64 state) is the fp64 reference that measures
        # the spread of the fp32 engine's own rounding (docs/gates.md, "agreement")
        self.dtype = compute_dtype or (torch.float16 if self.device.type == "cuda"
                                       else torch.float32)
        if self.dtype not in (torch.float16, torch.float32, torch.float64):
            raise EngineError(f"compute_dtype must be float16, float32 or float64, got "
                              f"{self.dtype}")
        self.work = torch.float64 if self.dtype == torch.float64 else torch.float32
        path = Path(model_dir) if model_dir is not None else default_model_dir()
        weights = path / "weights.pt"
        stat = weights.stat() if weights.is_file() else None
        self.cfg, tensors = (_checkpoint(str(path), stat.st_mtime_ns, stat.st_size) if stat
                             else load_checkpoint(path))
        self._load(tensors)
        self._prefix: OrderedDict[tuple[int, ...], _State] = OrderedDict()
        self._current: _State | None = None
        self._draft_ids: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._dispatch: Counter[str] = Counter()
        self._kernel: Counter[str] = Counter()
        self._depth = 0

    # ----------------------------------------------------------------------------- weights
    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        from dflash_kernels.nvfp4 import NVFP4Weight

        cfg, dev = self.cfg, self.device
        self.w = {k: t.to(dev, self.work) for k, t in tensors.items() if ":" not in k}
        self.prepared: dict[str, Any] = {}
        for i in range(cfg.n_layers):
            for name in ("mlp.gate_up.weight", "mlp.down.weight"):
                packed, scales, glob = mlp_nvfp4(tensors, f"layers.{i}.{name}")
                weight = NVFP4Weight(packed.to(dev), scales.to(dev), float(glob))
                self.prepared[f"layers.{i}.{name}"] = self.gemm.prepare(weight)
        self.layer_params = []
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}.mix."
            self.layer_params.append(
                {k[len(prefix):]: t for k, t in self.w.items() if k.startswith(prefix)}
            )

    # ----------------------------------------------------------------------------- model
    def _fresh(self) -> _State:
        cfg = self.cfg
        kv = [
            _KV(torch.zeros(2, KV_BLOCK_SIZE, cfg.attn_kv_heads, cfg.attn_head_dim,
                            dtype=self.dtype, device=self.device),
                torch.zeros(2, KV_BLOCK_SIZE, cfg.attn_kv_heads, cfg.attn_head_dim,
                            dtype=self.dtype, device=self.device))
            if cfg.is_attention(i) else None
            for i in range(cfg.n_layers)
        ]
        return _State([], [None] * cfg.n_layers, [None] * cfg.n_layers, kv)

    def _forward(self, state: _State, ids: list[int], all_logits: bool,
                 commit: bool = True, on_device: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``ids`` on top of ``state``; logits [T or 1, V]. ``commit=False`` (verify) leaves
        the SSM/conv state and the token list untouched; KV rows past the prefix are scratch.
        ``on_device``: the same ids already on the device, [1, T] (a captured prefill)."""
        return self._forward_rows([state], [ids], all_logits, commit, on_device)[0]

    def _forward_rows(self, states: list[_State], ids: list[list[int]], all_logits: bool,
                      commit: bool = True,
                      on_device: torch.Tensor | None = None) -> list[torch.Tensor]:
        """:meth:`_forward` for several sequences at once (a decode step of a batch: one token
        each), or for one. The norms, projections, SSM and GEMM run on all rows together; each
        sequence's attention runs on its own paged KV cache. Per sequence: logits [T or 1, V]."""
        cfg = self.cfg
        if len(states) > 1 and any(len(row) != 1 for row in ids):
            raise EngineError("a batched forward takes exactly one token per sequence")
        starts = [len(state.tokens) for state in states]
        t_len = len(ids[0])
        rows = self._row_ids(ids, commit) if on_device is None else on_device
        x = self.w["embed.weight"][rows]  # [B, T, d]
        recurrent = t_len <= RECURRENT_MAX_TOKENS
        for i in range(cfg.n_layers):
            p = self.layer_params[i]
            h = rms_norm(x, self.w[f"layers.{i}.norm1.weight"], cfg.norm_eps)
            if cfg.is_attention(i):
                # an attention layer's KV exists from the state's creation on
                y = self._attention(cast("list[_KV]", [state.kv[i] for state in states]), p, h,
                                    starts)
            else:
                y, conv, ssm = ssm_mixer(p, h, cfg, _stacked(states, "conv", i),
                                         _stacked(states, "ssm", i), self.state_dtype,
                                         recurrent=recurrent)
                if commit:
                    for b, state in enumerate(states):
                        state.conv[i], state.ssm[i] = conv[b : b + 1], ssm[b : b + 1]
            x = x + y
            h = rms_norm(x, self.w[f"layers.{i}.norm2.weight"], cfg.norm_eps)
            x = x + self._mlp(i, h.flatten(0, 1)).view_as(x)
        if not all_logits:
            x = x[:, -1:]
        logits = F.linear(rms_norm(x, self.w["norm.weight"], cfg.norm_eps), self.w["head.weight"])
        if commit:
            for b, state in enumerate(states):
                state.tokens.extend(ids[b])
                state.last_logits = logits[b, -1].clone()
        return list(logits.unbind(0))

    def _row_ids(self, ids: list[list[int]], commit: bool) -> torch.Tensor:
        """The token ids of a forward, on the device.

        A verify step's drafts (one sequence, at most ``MAX_VERIFY_ROWS``, not committed) are
        kept per content (the last ``DRAFT_IDS_ENTRIES``): a deployment replays its verify steps
        as CUDA graphs, a capture refuses a host-to-device copy, and a replay must read the very
        tensor it captured. The eager calls before a capture put the drafts here, so the
        captured step copies nothing.
        """
        if commit or len(ids) != 1 or len(ids[0]) > MAX_VERIFY_ROWS:
            return torch.tensor(ids, device=self.device)
        key = tuple(ids[0])
        row = self._draft_ids.get(key)
        if row is None:
            row = self._draft_ids[key] = torch.tensor(ids, device=self.device)
            while len(self._draft_ids) > DRAFT_IDS_ENTRIES:
                self._draft_ids.popitem(last=False)
        else:
            self._draft_ids.move_to_end(key)
        return row

    def _attention(self, kvs: list[_KV], p: dict[str, torch.Tensor], h: torch.Tensor,
                   starts: list[int]) -> torch.Tensor:
        """Attention of rows h [B, T, d], sequence b on its own cache ``kvs[b]`` after
        ``starts[b]`` tokens: the route's ops take one sequence per call."""
        cfg = self.cfg
        q, k, v = attn_qkv(p, h, cfg)
        q, k, v = (t.to(self.dtype) for t in (q, k, v))
        out = torch.empty_like(q)
        scale = 1.0 / math.sqrt(cfg.attn_head_dim)
        for b, (kv, start) in enumerate(zip(kvs, starts, strict=True)):
            qb, kb, vb = (t[b].contiguous() for t in (q, k, v))
            end = start + qb.shape[0]
            kv.ensure(end + MAX_VERIFY_ROWS)
            kv.write(start, kb, vb)
            if start == 0:
                op = "dense"
                self.attn.dense(qb, kb, vb, out[b], scale, True)
            else:
                op = "paged"
                self.attn.paged(qb, kv.k, kv.v, kv.table(end), end, out[b], scale, True)
            self._dispatch[self.attn_route] += 1
            self._dispatch[f"{self.attn_route}:{op}"] += 1
        return F.linear(out.to(self.work).flatten(2), p["o.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        m = h.shape[0]
        act = self.gemm.gate_up(h.to(self.dtype), self.prepared[f"layers.{i}.mlp.gate_up.weight"])
        out = self.gemm.linear(act, self.prepared[f"layers.{i}.mlp.down.weight"])
        self._dispatch[self.gemm_route] += 2
        self._dispatch[f"{self.gemm_route}:m{'<=8' if m <= MAX_VERIFY_ROWS else '>8'}"] += 2
        return out.to(self.work)

    def _run_chunks(self, state: _State, ids: list[int], all_logits: bool,
                    on_device: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int]:
        outs, chunks = [], 0
        for pos in range(0, len(ids), self.chunk):
            rows = None if on_device is None else on_device[:, pos : pos + self.chunk]
            outs.append(self._forward(state, ids[pos : pos + self.chunk], all_logits,
                                      on_device=rows))
            chunks += 1
            self._dispatch[self.geometry_route] += 1
        return outs, chunks

    # ----------------------------------------------------------------------------- protocol
    @contextmanager
    def _tracked(self) -> Iterator[None]:
        """Collect the hits the kernels record while this engine runs (outermost call only)."""
        self._depth += 1
        try:
            if self._depth > 1:
                yield
                return
            with torch.inference_mode(), hits.counting() as delta:
                yield
            self._kernel.update({f"{r}/{op}": n for (r, op), n in delta.counts.items()})
        finally:
            self._depth -= 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of ``text``; with ``add_special_tokens`` the BOS the model prefixes."""
        return encode(text, bos=add_special_tokens)

    def _check_ids(self, token_ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise EngineError(f"{what} needs at least one token id, got an empty list")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"{what}: token ids {bad[:5]} are outside the vocabulary "
                              f"0..{self.cfg.vocab_size - 1} (bytes 0-255, BOS {BOS}, EOS {EOS})")
        return ids

    def prefill(self, token_ids: list[int]) -> PrefillResult:
        """Prefill ``token_ids`` in geometry chunks, reusing the longest cached prefix."""
        ids = self._check_ids(token_ids, "prefill")
        with self._tracked():
            self._sync()
            t0 = time.perf_counter()
            state = self._lookup(ids)
            rest = ids[len(state.tokens):]
            _, chunks = self._run_chunks(state, rest, all_logits=False)
            self._sync()
            seconds = time.perf_counter() - t0
            self._store(state)
            self._current = state
        assert state.last_logits is not None  # set by the chunk that ran last
        return prefill_result(state.last_logits, len(ids), seconds, chunks)

    def cold_prefill_call(self, token_ids: list[int]) -> ColdPrefillCall:
        """One cold prefill of ``token_ids`` as a call a CUDA graph can capture (see
        :class:`ColdPrefillCall`): the same chunks through the same routes as :meth:`prefill`
        from an empty prefix cache, the ids copied to the device here, once."""
        ids = self._check_ids(token_ids, "cold_prefill_call")
        return ColdPrefillCall(self, ids, torch.tensor([ids], device=self.device))

    def prefill_logits(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Log-probs [len(positions), V] (fp64, on the CPU) of the next token after each of
        ``positions`` (0-based; ``len(token_ids) - 1`` is the first generated token), from one
        cold prefill in geometry chunks: the prefix cache is reset first, and the prefill stays
        current afterwards, so :meth:`verify` continues it exactly as decoding would. What the
        agreement check compares between two routes after the same cold prefill."""
        ids = self._check_ids(token_ids, "prefill_logits")
        where = check_positions(positions, len(ids), "prefill_logits")
        self.reset_prefix_cache()
        with self._tracked():
            state = self._fresh()
            outs, _ = self._run_chunks(state, ids, all_logits=True)
            rows = torch.cat(outs)[torch.tensor(where, dtype=torch.long, device=self.device)]
            self._store(state)
            self._current = state
            return torch.log_softmax(rows.double(), dim=-1).cpu()

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token i+1 | tokens 0..i) for every i, from a fresh state (no prefix cache)."""
        return self.score_top(token_ids, 0)[0]

    def score_top(self, token_ids: list[int], top_k: int) -> tuple[
            list[float], list[int], list[dict[int, float]]]:
        """:meth:`score`, the rank of each scored token (1 = most likely) and, per position,
        the ``top_k`` most likely next tokens with their log-probs: what a server returns as
        prompt log-probs."""
        ids = self._check_ids(token_ids, "score")
        if len(ids) < 2:
            raise EngineError("score needs at least two token ids (e.g. BOS and one byte)")
        with self._tracked():
            outs, _ = self._run_chunks(self._fresh(), ids, all_logits=True)
            logp = torch.log_softmax(torch.cat(outs)[:-1].float(), dim=-1)
            target = torch.tensor(ids[1:], device=logp.device)
            chosen = logp.gather(1, target[:, None])
            if top_k <= 0:
                return chosen[:, 0].cpu().tolist(), [], []
            ranks = ((logp > chosen).sum(dim=1) + 1).cpu().tolist()
            values, index = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            top = [dict(zip(i, v, strict=True)) for i, v in
                   zip(index.cpu().tolist(), values.cpu().tolist(), strict=True)]
            return chosen[:, 0].cpu().tolist(), ranks, top

    def generate(self, prompt: str, max_new_tokens: int, stop: list[str] | None = None,
                 sampling: Sampling | None = None) -> Generation:
        """Complete the text ``prompt``, BOS-prefixed as the model was trained."""
        return self.generate_ids([BOS, *encode(prompt)], max_new_tokens, stop, sampling)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int,
                     stop: list[str] | None = None,
                     sampling: Sampling | None = None) -> Generation:
        """Complete a prompt given as token ids (used as given: no BOS is added)."""
        ids = self._check_ids(prompt_ids, "generate")
        return self._generate([ids], max_new_tokens, stop, sampling, 1, None)[0]

    def generate_many(self, prompts: list[str], max_new_tokens: int,
                      stop: list[str] | None = None, sampling: Sampling | None = None,
                      batch: int = 32,
                      on_complete: Callable[[int, Generation], None] | None = None,
                      ) -> list[Generation]:
        """:meth:`generate` for every prompt, decoding up to ``batch`` sequences per step
        (continuous batching: a finished sequence's slot takes the next prompt), as a server
        under load does. On a GPU one decode step of this small model is kernel launches, not
        arithmetic: on an H200 the full profile's 300 tasks took 1.9 ms per token at a batch of
        16 and 1.3 at 32, against 12 ms one sequence at a time. Each sequence is
        prefilled alone and attends over its own cache; only the rows of the other layers are
        shared, so a row's logits can differ from a lone run's in the last bits (a different
        GEMM shape), never in what it attends to. ``on_complete(index, generation)`` is called
        as each completion finishes, so its scoring can start while the rest decode."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise EngineError(f"generate_many needs batch >= 1 sequences per step, got {batch!r}")
        ids = [self._check_ids([BOS, *encode(p)], f"generate prompt {i}")
               for i, p in enumerate(prompts)]
        return self._generate(ids, max_new_tokens, stop, sampling, batch, on_complete)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, stop: list[str] | None,
                  sampling: Sampling | None, batch: int,
                  on_complete: Callable[[int, Generation], None] | None) -> list[Generation]:
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or Sampling()
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise EngineError(f"sampling needs temperature >= 0 and 0 < top_p <= 1, got "
                              f"{sampling.temperature} and {sampling.top_p}")
        stop = [s for s in (stop or []) if s]
        done: list[Generation | None] = [None] * len(prompts)
        waiting = deque(enumerate(prompts))
        active: list[_Sequence] = []
        with self._tracked():
            while waiting or active:
                while waiting and len(active) < batch:
                    index, ids = waiting.popleft()
                    self.prefill(ids)
                    assert self._current is not None  # the prefill's state
                    active.append(_Sequence(index, self._current.clone(),
                                            torch.Generator().manual_seed(sampling.seed)))
                picked = self._pick_rows(active, sampling)
                going: list[_Sequence] = []
                for seq, tok in zip(active, picked, strict=True):
                    finished = seq.take(tok, stop, max_new_tokens)
                    if finished is None:
                        going.append(seq)
                        continue
                    done[seq.index] = finished
                    if on_complete is not None:
                        on_complete(seq.index, finished)
                if going:
                    self._forward_rows([seq.state for seq in going],
                                       [[seq.out[-1]] for seq in going], all_logits=False)
                active = going
        return [gen for gen in done if gen is not None]

    def verify(self, draft_ids: list[int]) -> torch.Tensor:
        """Logits [M, V] of M <= 8 draft tokens on top of the last prefill, state unchanged."""
        ids = self._check_ids(draft_ids, "verify")
        if len(ids) > MAX_VERIFY_ROWS:
            raise EngineError(f"verify takes at most {MAX_VERIFY_ROWS} draft tokens (draft width "
                              f"7 + 1), got {len(ids)}")
        if self._current is None:
            raise EngineError("verify needs a cached prefix: call prefill(prompt_ids) first")
        with self._tracked():
            return wide(self._forward(self._current, ids, all_logits=True, commit=False))

    def reset_prefix_cache(self) -> None:
        self._prefix.clear()
        self._current = None

    def route_hits(self) -> dict[str, int]:
        """Dispatches by route name (plus ``route:op`` detail) and the hits the kernels recorded
        themselves while this engine ran (``route/op``), accumulated since build."""
        return {**dict(self._dispatch), **dict(self._kernel)}

    # ----------------------------------------------------------------------------- helpers
    def _pick_rows(self, active: list[_Sequence], sampling: Sampling) -> list[int]:
        """The next token of every active sequence: greedy picks in one device-to-host copy,
        sampled ones each from its own seeded generator (as a lone run would)."""
        if sampling.temperature == 0:
            rows = torch.stack([seq.state.last_logits for seq in active])
            return rows.float().argmax(-1).cpu().tolist()
        return [self._sample(seq.state.last_logits, sampling, seq.generator) for seq in active]

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
        logits = logits.float().cpu()
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < sampling.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    def _lookup(self, ids: list[int]) -> _State:
        best: tuple[int, ...] | None = None
        for key in self._prefix:
            if len(key) <= len(ids) and (best is None or len(key) > len(best)) \
                    and tuple(ids[: len(key)]) == key:
                best = key
        if best is None:
            return self._fresh()
        self._prefix.move_to_end(best)
        self._dispatch["prefix_cache:hit"] += 1
        return self._prefix[best].clone()

    def _store(self, state: _State) -> None:
        key = tuple(state.tokens)
        self._prefix[key] = state.clone()
        self._prefix.move_to_end(key)
        while len(self._prefix) > PREFIX_CACHE_ENTRIES:
            self._prefix.popitem(last=False)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __repr__(self) -> str:
        return f"<ReferenceEngine {self.selection} profile={self.profile} device={self.device}>"


def prefill_result(last_logits: torch.Tensor, tokens: int, seconds: float,
                   chunks: int) -> PrefillResult:
    """What a prefill reports: the greedy first token and the sha256 of the last position's
    logits (fp32 bytes), the same for an eager prefill and a graph replay of one."""
    logits = last_logits.float().cpu()
    return PrefillResult(int(logits.argmax()), hashlib.sha256(logits.numpy().tobytes())
                         .hexdigest(), tokens, seconds, chunks)


class ColdPrefillCall:
    """A cold prefill that copies nothing between host and device and keeps nothing between
    runs: each call starts a fresh state, runs every chunk through the engine's routes and
    returns the last position's logits, a device tensor. So a CUDA graph can capture it, and
    the prefill gate times its replays on CUDA, where the eager prefill of this small model is
    mostly the host launching small kernels (docs/gates.md, "prefill").

    A replay runs no Python, so it records no route hits: :meth:`book` books the hits of the
    last call again (in the engine's counters and in ``pytest_dflash.native.hits``), once per
    replay, as the replay ran the same kernels. Nothing goes to the prefix cache.
    """

    def __init__(self, engine: ReferenceEngine, ids: list[int], on_device: torch.Tensor) -> None:
        self.engine, self.ids, self.on_device = engine, ids, on_device
        self.chunks = math.ceil(len(ids) / engine.chunk)
        self._dispatch: Counter[str] = Counter()
        self._kernel: Counter[str] = Counter()
        self._hits: dict[tuple[str, str], int] = {}

    def __call__(self) -> torch.Tensor:
        engine = self.engine
        dispatch, kernel = Counter(engine._dispatch), Counter(engine._kernel)
        with hits.counting() as delta, engine._tracked():
            state = engine._fresh()
            engine._run_chunks(state, self.ids, all_logits=False, on_device=self.on_device)
        self._dispatch, self._kernel = engine._dispatch - dispatch, engine._kernel - kernel
        self._hits = dict(delta.counts)
        assert state.last_logits is not None  # set by the chunk that ran last
        return state.last_logits

    def book(self) -> None:
        """Count one more run of the last call's kernels (a graph replay of it)."""
        self.engine._dispatch.update(self._dispatch)
        self.engine._kernel.update(self._kernel)
        for (route, op), n in self._hits.items():
            hits.record(route, op, n)

    def result(self, last_logits: torch.Tensor) -> PrefillResult:
        """The PrefillResult of a run whose last-position logits are ``last_logits``."""
        return prefill_result(last_logits, len(self.ids), 0.0, self.chunks)


def build(selection: Mapping[str, str], profile: str, device: str | torch.device = "cpu",
          registry: RouteRegistry | None = None, model_dir: str | Path | None = None,
          compute_dtype: torch.dtype | None = None) -> ReferenceEngine:
    """The reference engine for a family -> route selection (missing families: baselines)."""
    return ReferenceEngine(selection, profile, device, registry=registry, model_dir=model_dir,
                           compute_dtype=compute_dtype)
